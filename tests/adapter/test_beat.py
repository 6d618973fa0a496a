"""Scheduled jobs against real Postgres, real `celery beat` processes and a real worker.

Seed card 002: a scheduled run's identity is (job_id, scheduled_for), so any
number of beats ticking the same slot make ONE run. Every "only one" here is
driven concurrently (threads on a warm pool, or several beat processes), and
the blocking tests show the second writer really waiting on the first inside
Postgres, not merely losing a race in Python.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections import Counter
from contextlib import ExitStack, contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterator
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from sqlalchemy import text
from sqlalchemy.engine import Engine

import tests.fixtures.beat_jobs as bj
import tests.fixtures.jobs  # noqa: F401  (event jobs, for the "event enqueue unchanged" test)
from motir_celery import enqueue_scheduled
from motir_celery.adapter.beat import SCHEDULER, MotirScheduler, OverlapSkipped, enqueue_slot
from motir_celery.adapter.celery_app import attach, create_app
from motir_celery.adapter.messages import host, hosts
from motir_celery.core.jobs import get_job
from motir_celery.core.producer.events import dispatch_event
from motir_celery.core.retention import retention_period
from motir_celery.core.schedule import latest_slot, schedule_options, slots_between
from motir_celery.core.system_jobs import HEALTH_CHECK, RETENTION, AppSettings
from motir_celery.errors import JobDefinitionError
from motir_celery.settings import Settings
from motir_celery.store.db import workspace_session
from motir_celery.store.records import AlreadyQueued, Queued
from motir_celery.store.sql import producer as producer_sql
from motir_celery.testing import Held
from tests.conftest import ROOT, celery_worker, run_state, stop_group, wait_for
from tests.fixtures.engines import holding

UTC = timezone.utc


def db_now(engine: Engine) -> datetime:
    with engine.connect() as conn:
        return conn.execute(text("SELECT now()")).scalar_one()


def slot_of(job_id: str, now: datetime, back: int = 0) -> datetime:
    """The job's latest slot at ``now``, or the one ``back`` slots before it."""
    job = get_job(job_id)
    slot = latest_slot(job.cron or "", job.timezone, now)
    assert slot is not None
    for _ in range(back):
        slot = latest_slot(job.cron or "", job.timezone, slot - timedelta(microseconds=1))
        assert slot is not None
    return slot


def rows(engine: Engine, job_id: str) -> list[Any]:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT id, scheduled_for, state, event_id, event_name, workspace_id, skip_overlap, result "
                 "FROM job_queue WHERE job_id = :j ORDER BY scheduled_for NULLS FIRST, created_at"),
            {"j": job_id},
        ).all()


def concurrently(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """Run fn(0..n-1) in n threads released together; re-raise the first error."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=10)
            results[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    if errors:
        raise errors[0]
    return results


def warm_pool(engine: Engine, n: int) -> None:
    """Open n pooled connections at once, so the threads race on INSERTs, not on connects."""
    conns = [engine.connect() for _ in range(n)]
    for c in conns:
        c.execute(text("SELECT 1"))
    for c in conns:
        c.close()


def waiting_on_lock(engine: Engine, pattern: str) -> bool:
    """Whether another backend is blocked on a lock while running a statement matching ``pattern``."""
    with engine.connect() as conn:
        return bool(conn.execute(
            text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE :p "
                 "AND pid <> pg_backend_pid()"),
            {"p": pattern},
        ).scalar_one())


# --- enqueue_scheduled: the database decides -------------------------------------------------


def test_concurrent_enqueues_of_one_slot_make_one_row_one_queued_one_publish(engine):  # type: ignore[no-untyped-def]
    warm_pool(engine, 5)
    now = db_now(engine)
    publish = Held()
    held = holding(publish)
    rounds = []
    for back in range(10):  # ten slots, each enqueued by two threads released together
        slot = slot_of(bj.EVERY_2S, now, back)
        rounds.append((slot, concurrently(2, lambda _i, s=slot: enqueue_slot(held, bj.EVERY_2S, s))))
    storm = slot_of(bj.EVERY_2S, now, 10)  # and one slot by five
    rounds.append((storm, concurrently(5, lambda _i: enqueue_slot(held, bj.EVERY_2S, storm))))

    found = rows(engine, bj.EVERY_2S)
    assert Counter(r.scheduled_for for r in found) == {slot: 1 for slot, _ in rounds}
    for slot, results in rounds:
        queued = [r for r in results if isinstance(r, Queued)]
        assert len(queued) == 1 and all(type(r) is AlreadyQueued for r in results if r is not queued[0])
        (row,) = [r for r in found if r.scheduled_for == slot]
        assert row.id == queued[0].run_id and row.event_name == f"scheduled.{bj.EVERY_2S}"
    # Published once per slot, the run that was created, after its commit.
    assert sorted(c[0] for c in publish) == sorted(r.id for r in found)


def test_second_insert_of_a_slot_waits_for_the_first_and_then_is_already_queued(engine):  # type: ignore[no-untyped-def]
    slot = slot_of(bj.EVERY_2S, db_now(engine))
    with engine.connect() as first:
        tx = first.begin()
        created = producer_sql.enqueue_scheduled(first, bj.EVERY_2S, slot, max_attempts=3, policy="transient")
        assert isinstance(created, Queued)
        outcome: list[Any] = []
        second = threading.Thread(target=lambda: outcome.append(enqueue_slot(holding(), bj.EVERY_2S, slot)))
        second.start()
        # The second INSERT is parked inside Postgres on the first's uncommitted row.
        wait_for(lambda: waiting_on_lock(engine, "%INSERT INTO job_queue%"), timeout=10, what="a blocked INSERT")
        assert not outcome
        tx.commit()
        second.join(timeout=10)
    assert outcome == [AlreadyQueued(bj.EVERY_2S)]
    assert [r.id for r in rows(engine, bj.EVERY_2S)] == [created.run_id]


def test_same_job_two_slots_two_rows_and_the_same_instant_in_another_offset_is_one(engine):  # type: ignore[no-untyped-def]
    now = db_now(engine)
    a, b = slot_of(bj.EVERY_2S, now, 1), slot_of(bj.EVERY_2S, now)
    assert isinstance(enqueue_slot(holding(), bj.EVERY_2S, a), Queued)
    assert isinstance(enqueue_slot(holding(), bj.EVERY_2S, b), Queued)
    # One instant, whatever offset it is written in (or as an ISO string): one slot.
    assert type(enqueue_slot(holding(), bj.EVERY_2S, b.astimezone(ZoneInfo("Asia/Kolkata")))) is AlreadyQueued
    assert type(enqueue_slot(holding(), bj.EVERY_2S, b.isoformat())) is AlreadyQueued
    assert [r.scheduled_for for r in rows(engine, bj.EVERY_2S)] == [a, b]


def test_an_instant_that_is_not_a_slot_or_a_job_without_cron_is_refused(engine):  # type: ignore[no-untyped-def]
    slot = slot_of(bj.EVERY_2S, db_now(engine))
    with pytest.raises(ValueError, match="is not a slot"):
        enqueue_slot(holding(), bj.EVERY_2S, slot + timedelta(seconds=1))
    with pytest.raises(ValueError, match="timezone-aware"):
        enqueue_slot(holding(), bj.EVERY_2S, slot.replace(tzinfo=None))
    with pytest.raises(JobDefinitionError, match="no cron"):
        enqueue_slot(holding(), "test.three-steps", slot)
    assert rows(engine, bj.EVERY_2S) == []


def test_event_triggered_enqueue_is_unchanged(engine):  # type: ignore[no-untyped-def]
    sent = holding().send_event("test.three", {"workspace_id": "acme"})
    (run_id,) = sent.run_ids
    (row,) = rows(engine, "test.three-steps")
    assert row.id == run_id and row.scheduled_for is None and row.event_id == sent.event_id
    assert row.skip_overlap is False and row.event_name == "test.three"
    # (event_id, job_id) still dedups: dispatching the same event again adds nothing...
    assert dispatch_event(holding(), sent.event_id) == [AlreadyQueued("test.three-steps")]
    # ...and the two unique constraints are independent halves: a scheduled row of
    # the same job id sits beside the event row (NULL scheduled_for / NULL event_id).
    slot = datetime(2026, 1, 1, tzinfo=UTC)
    with engine.begin() as conn:
        assert isinstance(producer_sql.enqueue_scheduled(conn, "test.three-steps", slot, max_attempts=1, policy="none"),
                          Queued)
        assert type(producer_sql.enqueue_scheduled(conn, "test.three-steps", slot, max_attempts=1, policy="none")) \
            is AlreadyQueued
    assert [(r.event_id is None, r.scheduled_for) for r in rows(engine, "test.three-steps")] == [
        (False, None), (True, slot)]


def test_rls_hides_a_system_scheduled_row_from_workspaces_and_shows_it_to_admins(engine):  # type: ignore[no-untyped-def]
    result = enqueue_slot(holding(), bj.EVERY_2S, slot_of(bj.EVERY_2S, db_now(engine)))
    assert isinstance(result, Queued)
    (row,) = rows(engine, bj.EVERY_2S)  # the owner sees it: it exists, with a NULL workspace
    assert row.workspace_id is None
    count = text("SELECT count(*) FROM job_queue WHERE id = :id")
    with workspace_session(None, admin=True, settings=Settings.from_env()) as s:
        assert s.execute(text("SELECT current_user")).scalar_one() == "motir_admin"
        assert s.execute(count, {"id": result.run_id}).scalar_one() == 1
    for ws, admin in (("acme", False), (None, False)):
        with workspace_session(ws, admin=admin, settings=Settings.from_env()) as s:
            assert s.execute(count, {"id": result.run_id}).scalar_one() == 0


# --- overlap ----------------------------------------------------------------------------------


def test_overlap_allow_is_the_default_every_slot_gets_its_run(engine):  # type: ignore[no-untyped-def]
    now = db_now(engine)
    first = enqueue_slot(holding(), bj.EVERY_2S, slot_of(bj.EVERY_2S, now, 1))
    with engine.begin() as conn:
        conn.execute(text("UPDATE job_queue SET state = 'running' WHERE id = :id"), {"id": first.run_id})  # type: ignore[union-attr]
    assert isinstance(enqueue_slot(holding(), bj.EVERY_2S, slot_of(bj.EVERY_2S, now)), Queued)
    assert schedule_options(bj.EVERY_2S, get_job(bj.EVERY_2S).options).overlap == "allow"


def test_overlap_skip_admits_one_active_run_when_slots_race(engine):  # type: ignore[no-untyped-def]
    warm_pool(engine, 5)
    now = db_now(engine)
    slots = [slot_of(bj.EVERY_1S_SKIP, now, back) for back in range(5)]
    publish = Held()
    held = holding(publish)
    results = concurrently(5, lambda i: enqueue_slot(held, bj.EVERY_1S_SKIP, slots[i]))
    queued = [r for r in results if isinstance(r, Queued)]
    skipped = [r for r in results if isinstance(r, OverlapSkipped)]
    assert len(queued) == 1 and len(skipped) == 4
    assert {s.blocking_run_id for s in skipped} == {queued[0].run_id}
    assert [c[0] for c in publish] == [queued[0].run_id]  # a skip publishes nothing
    found = rows(engine, bj.EVERY_1S_SKIP)
    assert sorted(r.scheduled_for for r in found) == sorted(slots)  # every slot has its row: a run or its skip
    assert Counter(r.state for r in found) == {"queued": 1, "cancelled": 4}
    assert all(r.result == {"skipped": "overlap", "blocking_run_id": str(queued[0].run_id)}
               for r in found if r.state == "cancelled")
    # A skipped slot stays decided (no late run once the blocker ends), and any slot
    # again is plainly AlreadyQueued.
    for slot in slots:
        assert type(enqueue_slot(holding(), bj.EVERY_1S_SKIP, slot)) is AlreadyQueued
    # Still running (a retry puts it back to queued: still active) → the next slot is skipped too;
    # once it has finished, the next slot runs.
    with engine.begin() as conn:
        conn.execute(text("UPDATE job_queue SET state = 'running' WHERE id = :id"), {"id": queued[0].run_id})
    later = slot_of(bj.EVERY_1S_SKIP, db_now(engine))
    assert isinstance(enqueue_slot(holding(), bj.EVERY_1S_SKIP, later + timedelta(seconds=1)), OverlapSkipped)
    with engine.begin() as conn:
        conn.execute(text("UPDATE job_queue SET state = 'succeeded' WHERE id = :id"), {"id": queued[0].run_id})
    assert isinstance(enqueue_slot(holding(), bj.EVERY_1S_SKIP, later + timedelta(seconds=2)), Queued)


@pytest.mark.parametrize("first_commits", [True, False])
def test_overlap_skip_decision_waits_for_an_uncommitted_run_of_another_slot(engine, first_commits):  # type: ignore[no-untyped-def]
    # The race a `WHERE NOT EXISTS (active run)` check would lose: the first run is
    # inserted but not committed when the next slot is enqueued. The unique index
    # makes the second INSERT wait, then skip (first committed) or run (rolled back).
    now = db_now(engine)
    s1, s2 = slot_of(bj.EVERY_1S_SKIP, now, 1), slot_of(bj.EVERY_1S_SKIP, now)
    opts = schedule_options(bj.EVERY_1S_SKIP, get_job(bj.EVERY_1S_SKIP).options)

    assert opts.overlap == "skip"
    with engine.connect() as first:
        tx = first.begin()
        assert isinstance(producer_sql.enqueue_scheduled(first, bj.EVERY_1S_SKIP, s1, max_attempts=3, policy="transient", skip_overlap=True),
                          Queued)
        outcome: list[Any] = []
        second = threading.Thread(target=lambda: outcome.append(enqueue_slot(holding(), bj.EVERY_1S_SKIP, s2)))
        second.start()
        wait_for(lambda: waiting_on_lock(engine, "%INSERT INTO job_queue%"), timeout=10, what="a blocked INSERT")
        assert not outcome
        tx.commit() if first_commits else tx.rollback()
        second.join(timeout=10)
    (result,) = outcome
    assert isinstance(result, OverlapSkipped if first_commits else Queued)


# --- the scheduler's policies, one pass at a time ------------------------------------------


@pytest.fixture
def published() -> Held:
    """What the scheduler's app published: its engine's host."""
    return Held()


@pytest.fixture
def scheduler(broker_url: str, tmp_path: Path, published: Held) -> Iterator[MotirScheduler]:
    app = Celery("beat-test", set_as_current=False)
    host(app, holding(published))  # the beat's app hosts an engine that holds its messages
    sched = MotirScheduler(app=app, schedule_filename=str(tmp_path / "schedule"), lazy=True)
    yield sched


def test_latest_slot_only_by_default_and_catchup_enqueues_every_slot_of_its_window(scheduler):  # type: ignore[no-untyped-def]
    now = datetime(2026, 6, 1, 12, 0, 1, tzinfo=UTC)
    default, catchup = get_job(bj.EVERY_2S), get_job(bj.EVERY_3S_CATCHUP)
    d_opts, c_opts = (schedule_options(j.id, j.options) for j in (default, catchup))
    assert c_opts.catchup == timedelta(seconds=30)
    # A beat back from a long absence: the latest slot only, or every slot of the last 30 s.
    assert scheduler._motir_due_slots(default, d_opts, now) == [datetime(2026, 6, 1, 12, 0, 0, tzinfo=UTC)]
    window = scheduler._motir_due_slots(catchup, c_opts, now)
    assert window == slots_between(catchup.cron, "UTC", now - timedelta(seconds=30), now) and len(window) == 10
    # What this beat has seen answered is not asked again; a later pass asks only newer slots.
    scheduler._motir_fired[default.id] = window[-1]
    scheduler._motir_fired[catchup.id] = window[-1]
    assert scheduler._motir_due_slots(default, d_opts, now) == []
    later = now + timedelta(seconds=7)  # a beat that ticked late: latest only, or every missed slot
    assert scheduler._motir_due_slots(default, d_opts, later) == [datetime(2026, 6, 1, 12, 0, 8, tzinfo=UTC)]
    assert scheduler._motir_due_slots(catchup, c_opts, later) == [
        datetime(2026, 6, 1, 12, 0, 3, tzinfo=UTC), datetime(2026, 6, 1, 12, 0, 6, tzinfo=UTC)]


def test_a_scheduler_pass_enqueues_each_cron_job_once_and_sleeps_until_the_next_slot(engine, scheduler, published):  # type: ignore[no-untyped-def]
    delay = scheduler._motir_pass()
    assert 0 < delay <= 1.01  # the next every-second slot
    first = {job: len(rows(engine, job)) for job in (bj.EVERY_2S, bj.EVERY_1S_SKIP, HEALTH_CHECK, bj.FAILING)}
    assert first == {bj.EVERY_2S: 1, bj.EVERY_1S_SKIP: 1, HEALTH_CHECK: 1, bj.FAILING: 1}
    assert len(rows(engine, bj.EVERY_3S_CATCHUP)) >= 10  # its 30 s window
    assert {bj.EVERY_2S, bj.EVERY_3S_CATCHUP, bj.EVERY_1S_SKIP, HEALTH_CHECK} <= {c[1] for c in published}
    # A second beat (no memory) in the same second adds nothing.
    twin = MotirScheduler(app=scheduler.app, schedule_filename=scheduler.schedule_filename, lazy=True)
    before = len(published)
    twin._motir_pass()
    assert len(rows(engine, HEALTH_CHECK)) == 1 and len(rows(engine, bj.FAILING)) == 1
    assert all(c[1] not in (HEALTH_CHECK, bj.FAILING) for c in published[before:])


def test_an_app_that_turns_the_health_check_off_fires_every_cron_job_but_it(engine, scheduler, published):  # type: ignore[no-untyped-def]
    scheduler.app.conf.motir_health_check = False   # Django: CELERY_MOTIR_HEALTH_CHECK = False
    scheduler._motir_pass()
    assert rows(engine, HEALTH_CHECK) == [] and HEALTH_CHECK not in {c[1] for c in published}
    assert len(rows(engine, bj.EVERY_2S)) == 1 and len(rows(engine, bj.FAILING)) == 1
    assert HEALTH_CHECK not in scheduler.info and bj.EVERY_2S in scheduler.info


@pytest.mark.parametrize("setting,fired", [(None, True), (7, True), (timedelta(hours=12), True),
                                             ("30d", True), (False, False), (0, False)])
def test_beat_fires_the_daily_retention_unless_the_app_turns_it_off(engine, scheduler, published, setting, fired):  # type: ignore[no-untyped-def]
    if setting is not None:
        scheduler.app.conf.motir_retention = setting  # Django: CELERY_MOTIR_RETENTION = ...
    scheduler._motir_pass()
    # A value it cannot read ("30d") is fired all the same: its run fails with the reason, in the DLQ.
    assert len(rows(engine, RETENTION)) == (1 if fired else 0)
    assert (RETENTION in {c[1] for c in published}) is fired
    assert len(rows(engine, HEALTH_CHECK)) == 1 and len(rows(engine, bj.EVERY_2S)) == 1


def test_attach_installs_our_scheduler_unless_the_user_chose_one(broker_url):  # type: ignore[no-untyped-def]
    plain = Celery("plain", set_as_current=False)
    plain.conf.broker_url = "memory://"
    assert attach(plain).conf.beat_scheduler == SCHEDULER
    theirs = Celery("theirs", set_as_current=False)
    theirs.conf.update(broker_url="memory://", beat_scheduler="django_celery_beat.schedulers:DatabaseScheduler")
    assert attach(theirs).conf.beat_scheduler == "django_celery_beat.schedulers:DatabaseScheduler"
    assert f"motir.{HEALTH_CHECK}" in attach(plain).tasks and f"motir.{RETENTION}" in attach(plain).tasks


def test_the_daily_retention_reads_its_period_from_the_app_its_worker_attached() -> None:
    app = Celery("retention-key", set_as_current=False)
    app.conf.broker_url = "memory://"
    engine = hosts(attach(app))
    assert engine is not None
    on_app = engine.host
    assert isinstance(on_app, AppSettings) and on_app.app_setting("motir_retention") is None  # the default
    app.conf.motir_retention = 90   # Django: CELERY_MOTIR_RETENTION = 90
    assert retention_period(on_app.app_setting("motir_retention")) == timedelta(days=90)


# --- real processes --------------------------------------------------------------------------


def _beat_env(queue: str, imports: str = "tests.fixtures.beat_jobs") -> dict[str, str]:
    env = dict(os.environ)  # MOTIR_DATABASE_URL of this session, the broker...
    env.update({"MOTIR_IMPORTS": imports, "PYTHONPATH": str(ROOT), "MOTIR_QUEUE": queue})
    return env


@contextmanager
def celery_beat(tmp_path: Path, name: str, env: dict[str, str], app: str = "motir_celery") -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A real `celery -A <app> beat` process with its own schedule file and pidfile."""
    log = tmp_path / f"beat-{name}.log"
    cmd = [sys.executable, "-m", "celery", "-A", app, "beat", "-l", "DEBUG",
           "-s", str(tmp_path / f"schedule-{name}"), "--pidfile", str(tmp_path / f"beat-{name}.pid")]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        wait_for(lambda: "beat: Starting..." in log.read_text(errors="replace") or proc.poll() is not None,
                 timeout=60, what=f"beat {name} to start")
        assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
        yield proc, log
    finally:
        stop_group(proc)


def _drop_queues(broker: str, *names: str) -> None:
    from kombu import Connection

    with Connection(broker) as conn:
        for name in names:
            try:
                conn.default_channel.queue_delete(name)
            except Exception:  # noqa: BLE001 — never declared: nothing to drop
                pass


def _assert_every_slot_once(engine: Engine, job_id: str, *, may_miss: int = 0) -> list[datetime]:
    """Each slot of ``job_id`` between its first run and its last has one run; ``may_miss``: a
    latest-slot-only job's slots a beat may skip by design, when a starved host holds its pass
    past the next slot (a slot on the schedule all the same, and never twice)."""
    job = get_job(job_id)
    seen = [r.scheduled_for for r in rows(engine, job_id)]
    assert seen, f"no rows for {job_id}"
    assert max(Counter(seen).values()) == 1
    expected = slots_between(job.cron or "", job.timezone, seen[0] - timedelta(microseconds=1), seen[-1])
    missing = sorted(set(expected) - set(seen))
    assert set(seen) <= set(expected) and len(missing) <= may_miss, f"{job_id}: missing {missing}"
    return seen


def test_three_real_beats_make_exactly_one_run_per_slot_none_missing(engine, broker_url, tmp_path):  # type: ignore[no-untyped-def]
    queue_name = f"{os.environ['MOTIR_QUEUE']}.beats"
    env = _beat_env(queue_name)
    try:
        with ExitStack() as stack:
            beats = [stack.enter_context(celery_beat(tmp_path, f"b{i}", env)) for i in range(3)]
            started = db_now(engine)
            # The beats race for a while (at least two of them have won slots), then one
            # dies hard mid-run: the other two carry on, nothing missing.
            wait_for(lambda: (db_now(engine) - started).total_seconds() >= 10
                     and sum("motir: queued " in log.read_text(errors="replace") for _, log in beats) >= 2,
                     timeout=60, interval=0.5, what="10 s of racing beats, two of them with runs queued")
            os.killpg(beats[0][0].pid, signal.SIGKILL)
            beats[0][0].wait(timeout=10)
            killed = db_now(engine)
            wait_for(lambda: sum(r.scheduled_for > killed for r in rows(engine, bj.EVERY_2S)) >= 6
                     and sum(r.scheduled_for > killed for r in rows(engine, bj.EVERY_3S_CATCHUP)) >= 4,
                     timeout=60, interval=0.5, what="the two survivors to queue 12 s of slots after the kill")
            for proc, log in beats[1:]:
                assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
            ended = db_now(engine)
    finally:
        _drop_queues(broker_url, queue_name)

    logs = [log.read_text(errors="replace") for _, log in beats]
    for text_ in logs:
        assert "scheduler -> motir_celery.adapter.beat.MotirScheduler" in text_
        assert "could not enqueue" not in text_ and "cron pass failed" not in text_, text_[-4000:]

    every2 = _assert_every_slot_once(engine, bj.EVERY_2S, may_miss=1)  # (all three beats starved at once)
    catchup = _assert_every_slot_once(engine, bj.EVERY_3S_CATCHUP)
    skip = _assert_every_slot_once(engine, bj.EVERY_1S_SKIP, may_miss=1)
    # The slots cover the whole minute the beats ran, up to its last slot or so.
    for seen, period in ((every2, 2), (catchup, 3), (skip, 1)):
        assert seen[0] <= started + timedelta(seconds=period + 3) and seen[-1] >= ended - timedelta(seconds=period + 3)
    # overlap="skip": its first run was never picked up (no worker), so every later slot is a recorded skip.
    skip_states = Counter(r.state for r in rows(engine, bj.EVERY_1S_SKIP))
    assert skip_states == {"queued": 1, "cancelled": len(skip) - 1}
    for daily in (HEALTH_CHECK, RETENTION):  # one run per slot: its last, and the next if the test crossed it
        slots = [r.scheduled_for for r in rows(engine, daily)]
        assert 1 <= len(slots) <= 2 and len(set(slots)) == len(slots), (daily, slots)

    # The beats really raced: runs were created by more than one of them, and the
    # losers were answered AlreadyQueued by the database.
    created = [len(re.findall(r"motir: queued ", t)) for t in logs]
    answered = sum(len(re.findall(r"already queued", t)) for t in logs)
    total_runs = sum(1 for job in (bj.EVERY_2S, bj.EVERY_3S_CATCHUP, bj.EVERY_1S_SKIP, HEALTH_CHECK, RETENTION,
                                   bj.FAILING)
                     for r in rows(engine, job) if r.state != "cancelled")
    # (the SIGKILLed beat may have died between a commit and its log line)
    assert total_runs - 1 <= sum(created) <= total_runs, (created, total_runs)
    assert sum(1 for c in created if c) >= 2, created
    assert answered > len(every2), answered


def test_a_users_own_app_keeps_its_beat_entries_beside_the_cron_jobs(engine, broker_url, tmp_path):  # type: ignore[no-untyped-def]
    queue_name = f"{os.environ['MOTIR_QUEUE']}.userbeat"
    try:
        with celery_beat(tmp_path, "user", _beat_env(queue_name), app="tests.fixtures.beat_jobs") as (_, log):
            # Five slots: one skipped in a stall is tolerated below, a beat skipping every other one is not.
            wait_for(lambda: len(rows(engine, bj.EVERY_2S)) >= 5
                     and log.read_text().count("Sending due task user-heartbeat (user.heartbeat)") >= 3,
                     timeout=30, what="user entries and cron runs")
        banner = log.read_text(errors="replace")
        assert "scheduler -> motir_celery.adapter.beat.MotirScheduler" in banner
    finally:
        _drop_queues(broker_url, queue_name, f"{queue_name}.user")
    # "None missing" is the catch-up job's promise; a lone beat's pass that comes more than a
    # period late skips a slot of the latest-slot-only job by design.
    _assert_every_slot_once(engine, bj.EVERY_3S_CATCHUP)
    assert len(_assert_every_slot_once(engine, bj.EVERY_2S, may_miss=1)) >= 5


def test_health_check_and_a_failing_cron_job_run_end_to_end_on_a_real_worker(engine, broker_url, tmp_path):  # type: ignore[no-untyped-def]
    app = create_app(Settings.from_env())
    with celery_worker(tmp_path, broker=broker_url, env={"MOTIR_IMPORTS": "tests.fixtures.jobs,tests.fixtures.beat_jobs"}):
        now = db_now(engine)
        slot = slot_of(HEALTH_CHECK, now)
        result = enqueue_scheduled(HEALTH_CHECK, slot, app=app)
        assert isinstance(result, Queued)
        wait_for(lambda: run_state(engine, result.run_id) == "succeeded", timeout=60, what="the health check")
        failing = enqueue_scheduled(bj.FAILING, slot_of(bj.FAILING, now), app=app)
        assert isinstance(failing, Queued)
        wait_for(lambda: run_state(engine, failing.run_id) == "failed", timeout=60, what="the failing cron run")
        # Run again for the same slot: nothing new, however often.
        assert type(enqueue_scheduled(HEALTH_CHECK, slot, app=app)) is AlreadyQueued
    with engine.connect() as conn:
        ledger = conn.execute(text("SELECT run_id, event_name, outcome FROM job_run ORDER BY started_at")).all()
        run = conn.execute(text("SELECT result, scheduled_for, workspace_id FROM job_queue WHERE id = :id"),
                           {"id": result.run_id}).one()
        dlq = conn.execute(text("SELECT function_id, event_name, event_data, failure FROM job_run_dlq")).one()
    assert [(r.run_id, r.event_name, r.outcome) for r in ledger] == [
        (result.run_id, "scheduled.system.daily-health-check", "succeeded"),
        (failing.run_id, f"scheduled.{bj.FAILING}", "failed"),
    ]
    # The handler got the synthetic event: scheduled.<job_id>, carrying its slot.
    assert datetime.fromisoformat(run.result["scheduled_for"]) == slot and run.result["ok"] is True
    assert run.workspace_id is None
    assert dlq.function_id == bj.FAILING and dlq.event_name == f"scheduled.{bj.FAILING}"
    assert datetime.fromisoformat(dlq.event_data["scheduled_for"]) == slot_of(bj.FAILING, now)
    assert "scheduled failure" in dlq.failure["message"]
