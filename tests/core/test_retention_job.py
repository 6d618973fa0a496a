"""``system.daily-retention``: ``motir purge`` on the beat's schedule, in-process through the test kit.

The kit's engine has no Celery app, so the job keeps the documented default period (30 days,
core/retention.py); tests/ops/test_purge.py runs it under an app's ``motir_retention``."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from motir_celery import define_job
from motir_celery.core.retention import DEFAULT_RETENTION
from motir_celery.core.system_jobs import RETENTION, daily_retention
from motir_celery.testing import Motir


@define_job("retention.done", event="retention.go", retry_policy="none")
def done(event: Any, step: Any) -> str:
    return step.run("only", lambda: "done")


@define_job("retention.waits", event="retention.wait", retry_policy="none")
def waits(event: Any, step: Any) -> Any:
    return step.wait_for_event("reply", event="retention.reply", match="data.n", timeout=86400 * 90)


def _backdate(motir: Motir, run_ids: list[Any], days: int) -> None:
    with motir.sql.begin() as conn:
        conn.execute(text(
            "UPDATE job_queue SET created_at = now() - make_interval(days => :d), "
            "finished_at = CASE WHEN finished_at IS NOT NULL THEN now() - make_interval(days => :d) END "
            "WHERE id = ANY(:ids)"), {"d": days, "ids": run_ids})


def _present(motir: Motir, run_ids: list[Any]) -> set[Any]:
    with motir.sql.connect() as conn:
        return set(conn.execute(text("SELECT id FROM job_queue WHERE id = ANY(:ids)"), {"ids": run_ids}).scalars())


def _runs(motir: Motir, event: str, data: Any) -> list[Any]:
    return [r.run_id for r in motir.send_event(event, data).runs]


def test_the_daily_retention_purges_old_finished_runs_and_keeps_recent_and_open_ones(motir: Motir) -> None:
    assert DEFAULT_RETENTION.days == 30
    old = _runs(motir, "retention.go", {"n": 1}) + _runs(motir, "retention.go", {"n": 2})
    recent = _runs(motir, "retention.go", {"n": 3})
    waiting = _runs(motir, "retention.wait", {"n": 4})
    motir.drain()
    _backdate(motir, old, 31)        # finished 31 days ago: past the default period
    _backdate(motir, recent, 29)     # finished 29 days ago: kept
    _backdate(motir, waiting, 400)   # created 400 days ago and still waiting: never purged

    (run,) = motir.tick(RETENTION)
    assert motir.tick(RETENTION) == []  # one run per slot, however often beats tick
    motir.drain()

    assert _present(motir, old + recent + waiting) == set(recent + waiting)
    with motir.sql.connect() as conn:
        state, result = conn.execute(text("SELECT state, result FROM job_queue WHERE id = :r"), {"r": run}).one()
    assert state == "succeeded"
    assert result["runs"] == 2 and result["older_than_seconds"] == DEFAULT_RETENTION.total_seconds()
    assert result["ok"] is True and result["notes"] == []


def test_the_daily_retention_is_a_cron_job_that_skips_a_slot_while_the_last_run_goes_on() -> None:
    assert daily_retention.cron == "30 3 * * *" and daily_retention.timezone == "UTC"
    assert daily_retention.options.get("overlap") == "skip"
