"""Retention: `purge` deletes what is finished and old, in bounded batches, and nothing an operator still needs."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import text

from motir_celery.adapter.beat import enqueue_slot
from motir_celery.core.jobs import get_job
from motir_celery.core.operator.dlq import dismiss_dlq
from motir_celery.core.retention import retention_period
from motir_celery.core.schedule import latest_slot
from motir_celery.core.system_jobs import RETENTION
from motir_celery.core.worker.runner import Outcome
from motir_celery.ops.purge import purge
from motir_celery.store.records import Queued
from motir_celery.testing import Held
from tests.fixtures.engines import holding
from tests.fixtures.ops_helpers import WORKER, age, dead_letter, emit, run_event

THIRTY_DAYS = timedelta(days=30)


def _count(engine, table: str, where: str = "true", **params) -> int:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {table} WHERE {where}"), params).scalar_one())


def _make_old(engine) -> None:  # type: ignore[no-untyped-def]
    """Everything that exists now happened 40 days ago."""
    age(engine, "UPDATE job_queue SET created_at = now() - interval '40 days', "
                "finished_at = CASE WHEN finished_at IS NOT NULL THEN now() - interval '40 days' END")
    age(engine, "UPDATE job_event SET received_at = now() - interval '40 days'")
    age(engine, "UPDATE job_run_dlq SET replayed_at = replayed_at - interval '40 days', "
                "dismissed_at = dismissed_at - interval '40 days'")


def test_purge_deletes_old_finished_runs_with_their_steps_attempts_and_events(engine) -> None:  # type: ignore[no-untyped-def]
    old = run_event("test.flaky", {})["test.fail-after-two"]  # 3 steps, 2 attempts
    _make_old(engine)
    recent = run_event("test.three", {})["test.three-steps"]

    report = purge(THIRTY_DAYS)

    assert (report.runs, report.steps, report.attempts, report.events) == (1, 3, 2, 1)
    assert _count(engine, "job_queue", "id = :r", r=old) == 0
    assert _count(engine, "job_step", "run_id = :r", r=old) == 0
    assert _count(engine, "job_run", "run_id = :r", r=old) == 0
    assert _count(engine, "job_queue", "id = :r", r=recent) == 1
    assert _count(engine, "job_step", "run_id = :r", r=recent) == 3
    assert _count(engine, "job_event") == 1


def test_purge_never_touches_queued_or_running_runs_however_old(engine) -> None:  # type: ignore[no-untyped-def]
    emit("test.three", {})
    (running,) = emit("test.slow", {}).values()
    age(engine, "UPDATE job_queue SET state = 'running', attempts = 1, lease_expires_at = now() WHERE id = :r", r=running)
    _make_old(engine)

    report = purge(THIRTY_DAYS)

    assert (report.runs, report.events) == (0, 0)
    assert _count(engine, "job_queue") == 2 and _count(engine, "job_event") == 2


def test_purge_keeps_an_open_dlq_entry_and_its_failed_run_with_the_errors(engine) -> None:  # type: ignore[no-untyped-def]
    run_id, dlq_id = dead_letter(engine, "ws-a")
    _make_old(engine)
    age(engine, "UPDATE job_run_dlq SET last_failed_at = now() - interval '400 days', "
                "first_failed_at = now() - interval '400 days'")

    report = purge(timedelta(days=1))

    assert _count(engine, "job_run_dlq", "id = :d", d=dlq_id) == 1
    assert _count(engine, "job_queue", "id = :r", r=run_id) == 1
    assert _count(engine, "job_run", "run_id = :r AND error IS NOT NULL", r=run_id) == 1
    assert report.kept_for_open_dlq == 1
    # The event's other subscriber (test.mixed-ok) is finished and goes; the event stays for the failed run.
    assert report.runs == 1 and _count(engine, "job_event") == 1


def test_purge_deletes_dlq_entries_replayed_or_dismissed_before_the_cutoff(engine) -> None:  # type: ignore[no-untyped-def]
    _, replayed = dead_letter(engine, "ws-a")
    _, dismissed = dead_letter(engine, "ws-a")
    result = holding().replay_dlq(replayed, actor="alice")
    assert result.status == "replayed"
    assert dismiss_dlq(holding(), dismissed, actor="bob")
    _make_old(engine)
    age(engine, "UPDATE job_queue SET state = 'succeeded', finished_at = now() - interval '40 days' WHERE id = :r",
        r=result.run_id)

    report = purge(THIRTY_DAYS)

    assert report.dlq_entries == 2 and _count(engine, "job_run_dlq") == 0
    assert _count(engine, "job_queue") == 0 and _count(engine, "job_event") == 0


def test_purge_keeps_a_closed_dlq_entry_until_it_was_closed_longer_ago_than_the_cutoff(engine) -> None:  # type: ignore[no-untyped-def]
    run_id, dlq_id = dead_letter(engine, "ws-a")
    _make_old(engine)  # failed 40 days ago…
    assert dismiss_dlq(holding(), dlq_id, actor="carol")  # …but dismissed just now

    report = purge(THIRTY_DAYS)

    assert report.dlq_entries == 0 and _count(engine, "job_run_dlq", "id = :d", d=dlq_id) == 1
    # Its run is purgeable (the entry is closed); the entry keeps the job, event data and failure.
    assert _count(engine, "job_queue", "id = :r", r=run_id) == 0
    with engine.connect() as conn:
        entry = conn.execute(text("SELECT run_id, function_id, failure FROM job_run_dlq WHERE id = :d"), {"d": dlq_id}).one()
    assert entry.run_id is None and entry.function_id == "test.mixed-fail" and entry.failure["message"]


def test_purge_keeps_an_event_that_a_remaining_run_still_needs(engine) -> None:  # type: ignore[no-untyped-def]
    runs = emit("test.mixed", {"switch": "x"})
    from tests.fixtures.ops_helpers import settle

    settle(runs["test.mixed-ok"], "test.mixed-ok")  # one subscriber finished, the other is still queued
    _make_old(engine)

    report = purge(THIRTY_DAYS)

    assert report.runs == 1 and report.events == 0
    assert _count(engine, "job_event") == 1  # job_queue.event_id is ON DELETE RESTRICT anyway


def test_purge_works_in_bounded_batches_and_reports_progress(engine) -> None:  # type: ignore[no-untyped-def]
    for _ in range(5):
        run_event("test.three", {})
    _make_old(engine)
    seen: list[tuple[str, int]] = []

    report = purge(THIRTY_DAYS, batch_size=2, progress=lambda kind, n: seen.append((kind, n)))

    assert [n for kind, n in seen if kind == "runs"] == [2, 4, 5]
    # Each run's event went with it, in its batch; the events' own pass found nothing more.
    assert [n for kind, n in seen if kind == "events"] == [5]
    assert report.runs == 5 and report.steps == 15 and report.events == 5
    assert report.batches == len(seen)


def test_purge_deletes_an_event_in_the_batch_of_its_last_run_and_not_before(engine) -> None:  # type: ignore[no-untyped-def]
    from tests.fixtures.ops_helpers import fix_switch, settle

    runs = emit("test.mixed", {"switch": "both-ok"})  # one event, two subscribers
    fix_switch(engine, "both-ok")
    for job_id, run_id in runs.items():
        settle(run_id, job_id)
    _make_old(engine)
    events_left: list[tuple[str, int]] = []

    report = purge(THIRTY_DAYS, batch_size=1,
                   progress=lambda kind, n: events_left.append((kind, _count(engine, "job_event"))))

    # First run's batch: its sibling still needs the event. Second: the event goes with it.
    assert events_left[:2] == [("runs", 1), ("runs", 0)]
    assert (report.runs, report.events) == (2, 1) and _count(engine, "job_queue") == 0


def test_purge_still_deletes_old_events_no_run_points_at(engine) -> None:  # type: ignore[no-untyped-def]
    emit("test.nobody-listens", {})  # no job subscribes: an event without runs
    _make_old(engine)

    report = purge(THIRTY_DAYS)

    assert report.events == 1 and _count(engine, "job_event") == 0


def test_purge_dry_run_counts_exactly_what_a_purge_deletes_and_deletes_nothing(engine) -> None:  # type: ignore[no-untyped-def]
    run_event("test.three", {})
    run_event("test.flaky", {})
    dead_letter(engine, None)
    _make_old(engine)
    before = {t: _count(engine, t) for t in ("job_queue", "job_step", "job_run", "job_event", "job_run_dlq")}

    dry = purge(THIRTY_DAYS, dry_run=True)

    assert {t: _count(engine, t) for t in before} == before
    real = purge(THIRTY_DAYS)
    assert (dry.runs, dry.steps, dry.attempts, dry.events, dry.dlq_entries, dry.kept_for_open_dlq) == (
        real.runs, real.steps, real.attempts, real.events, real.dlq_entries, real.kept_for_open_dlq)
    assert real.runs == 3 and real.kept_for_open_dlq == 1


def test_purge_takes_a_runs_progress_and_stream_items_with_it(engine) -> None:  # type: ignore[no-untyped-def]
    from tests.fixtures.ops_helpers import settle
    from tests.fixtures.stream_jobs import watched

    def streamed() -> object:
        handle = holding().apply_async(watched, (4, 0.0), {}, {"workspace_id": "ws-a"})
        assert settle(handle.id, watched.id).state == "succeeded"
        return handle.id

    old = streamed()
    _make_old(engine)
    recent = streamed()
    assert _count(engine, "job_stream_item") == 8 and _count(engine, "job_progress") == 2
    report = purge(THIRTY_DAYS)
    assert report.runs == 1
    assert _count(engine, "job_stream_item", "run_id = :r", r=old) == 0            # with their run (cascade)
    assert _count(engine, "job_progress", "run_id = :r", r=old) == 0
    assert _count(engine, "job_stream_item", "run_id = :r", r=recent) == 4
    assert _count(engine, "job_progress", "run_id = :r", r=recent) == 1


# --- the engine's own daily retention (core/system_jobs.py), under an app's motir_retention ----------


class _AppHost(Held):
    """A host whose app's configuration is ``conf`` (as adapter/messages.py's CeleryHost reads it)."""

    def __init__(self, conf: dict[str, Any]) -> None:
        super().__init__()
        self.conf = conf

    def app_setting(self, key: str, default: object = None) -> object:
        return self.conf.get(key, default)


def _retention_run(conf: dict[str, Any]) -> Outcome:
    """One attempt of the slot's run, on an engine hosted by an app configured with ``conf``."""
    engine = holding(_AppHost(conf))
    job = get_job(RETENTION)
    slot = latest_slot(job.cron or "", job.timezone, datetime.now(timezone.utc))
    assert slot is not None
    queued = enqueue_slot(engine, RETENTION, slot)
    assert isinstance(queued, Queued)
    return engine.execute(queued.run_id, job_id=RETENTION, worker=WORKER)


def test_the_daily_retention_keeps_the_period_the_app_configures(engine) -> None:  # type: ignore[no-untyped-def]
    ten_days = run_event("test.three", {})["test.three-steps"]
    three_days = run_event("test.three", {})["test.three-steps"]
    age(engine, "UPDATE job_queue SET finished_at = now() - interval '10 days' WHERE id = :r", r=ten_days)
    age(engine, "UPDATE job_queue SET finished_at = now() - interval '3 days' WHERE id = :r", r=three_days)

    outcome = _retention_run({"motir_retention": 7})  # Django: CELERY_MOTIR_RETENTION = 7

    result = outcome.result
    assert outcome.state == "succeeded" and result["runs"] == 1 and result["older_than_seconds"] == 7 * 86400
    assert _count(engine, "job_queue", "id = :r", r=ten_days) == 0
    assert _count(engine, "job_queue", "id = :r", r=three_days) == 1


def test_the_daily_retention_turned_off_deletes_nothing_even_when_run_by_hand(engine) -> None:  # type: ignore[no-untyped-def]
    old = run_event("test.three", {})["test.three-steps"]
    _make_old(engine)

    outcome = _retention_run({"motir_retention": False})

    assert outcome.state == "succeeded" and outcome.result["skipped"] == "motir_retention is off"
    assert _count(engine, "job_queue", "id = :r", r=old) == 1


def test_the_daily_retention_under_an_unreadable_period_fails_with_the_reason(engine) -> None:  # type: ignore[no-untyped-def]
    old = run_event("test.three", {})["test.three-steps"]
    _make_old(engine)

    outcome = _retention_run({"motir_retention": "30d"})

    assert outcome.state in ("retrying", "failed")  # each attempt fails the same way, then the DLQ
    assert "motir_retention must be False, a number of days or a timedelta" in str(outcome.error)
    assert _count(engine, "job_queue", "id = :r", r=old) == 1


@pytest.mark.parametrize("value,period", [
    (None, timedelta(days=30)), (True, timedelta(days=30)), (False, None), (0, None), (0.0, None),
    (90, timedelta(days=90)), (0.5, timedelta(hours=12)), (timedelta(hours=6), timedelta(hours=6)),
])
def test_motir_retention_values(value: object, period: timedelta | None) -> None:
    assert retention_period(value) == period


@pytest.mark.parametrize("value", ["30d", -1, timedelta(0), timedelta(days=-1), 40_000, float("inf"), [30]])
def test_motir_retention_refuses_what_it_cannot_read(value: object) -> None:
    with pytest.raises(ValueError, match="motir_retention must be"):
        retention_period(value)
