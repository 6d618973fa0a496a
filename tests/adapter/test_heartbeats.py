"""Heartbeats a GIL-holding body cannot starve (issue 24, item 6).

Real ``celery worker`` processes on the real Redis and Postgres. The worker under
test (``subject``) consumes a queue of its own, where the tests send their runs
(direct jobs, ``apply_async(queue=)``); a second worker, present throughout,
sweeps every second: a lease that runs out there is reclaimed and its run handed
out again (to the queue of the worker that swept it), which is what cost the
issue's unrelated runs their steps. A step of ``tests.fixtures.jobs.gil_hog`` holds the
GIL for over twice the 2 s lease in one C call (a backtracking regex); every
step body records each execution (``count_effects``).

* each pool type, with ~15 unrelated runs in flight in the GIL holder's process
  where the pool allows it: no step of any run runs twice, nothing reaches the
  DLQ, every run succeeds on its first attempt;
* a killed holder — a prefork pool child, then the worker's whole process group —
  loses its runs after the lease, as before (the renewer forgets the dead
  process's claims), while a live process's run in the same worker keeps its own;
* under prefork the renewer is a thread of the worker's main process (no process more
  than Celery's own);
* the renewer killed (its own process, under threads): the holders renew in process
  meanwhile, the worker starts it again, and the run in flight is not harmed; the new
  renewer carries a GIL holder;
* a run held past its bound (the job's ``time_limit=``, else the engine's ``max_hold_seconds``)
  is no longer renewed, and is reclaimed (in process: the renewer's ledger is the same).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
from sqlalchemy import text

from motir_celery.core.engine import Engine
from motir_celery.settings import Settings
from motir_celery.testing import Held
from tests.conftest import Worker, celery_worker, count_effects, wait_for
from tests.fixtures.jobs import beside, beside_until, gil_hog, long_first, time_limited, until_lost, until_released

LEASE = 2.0
#: How long the GIL-holding step holds it at least: past the lease and a sweep.
HOG = 2 * LEASE
UNRELATED = 15


@pytest.fixture(scope="module")
def second_worker(engine: Any, broker_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """The other worker of the fleet: it sweeps every second and runs what it reclaims. (It
    re-publishes no message younger than a minute: a run waiting on the subject's queue stays
    the subject's.)"""
    with celery_worker(tmp_path_factory.mktemp("second"), broker=broker_url, name="second", lease=LEASE,
                       env={"MOTIR_REPUBLISH_AFTER": "60"}) as worker:
        yield worker


def _subject(tmp_path: Path, broker_url: str, pool: str, concurrency: int, queue: str):  # type: ignore[no-untyped-def]
    return celery_worker(tmp_path, broker=broker_url, pool=pool, concurrency=concurrency, lease=LEASE,
                         name=f"subject-{pool}", env={"MOTIR_QUEUE": queue})


def _queue() -> str:
    return f"{os.environ['MOTIR_QUEUE']}.subject-{uuid.uuid4().hex[:6]}"


def _rows(engine: Any, sql: str, **params: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(text(sql), params))


def _all_ended(engine: Any, run_ids: list[uuid.UUID], timeout: float) -> dict[str, int]:
    def states() -> dict[str, int]:
        return dict(_rows(engine, "SELECT state, count(*) FROM job_queue WHERE id = ANY(:r) GROUP BY state",
                          r=run_ids))

    try:
        wait_for(lambda: set(states()) <= {"succeeded", "failed"}, timeout=timeout, interval=0.2,
                 what=f"{len(run_ids)} runs to end")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {states()}") from None
    return states()


def _attempts(engine: Any, run_id: uuid.UUID) -> list[str]:
    return [r.outcome for r in _rows(engine, "SELECT outcome FROM job_run WHERE run_id = :r ORDER BY attempt",
                                     r=run_id)]


def _executions(engine: Any, run_ids: list[uuid.UUID]) -> dict[tuple[str, str], int]:
    return {(r.run_id, r.step): r.n for r in _rows(
        engine, "SELECT run_id, step, count(*) AS n FROM test.side_effect WHERE run_id = ANY(:r) GROUP BY 1, 2",
        r=[str(i) for i in run_ids])}


def _started(engine: Any, run_ids: list[uuid.UUID], step: str) -> int:
    return len(_rows(engine, "SELECT DISTINCT run_id FROM test.side_effect WHERE run_id = ANY(:r) AND step = :s",
                     r=[str(i) for i in run_ids], s=step))


# --- a GIL-holding step, under each pool type --------------------------------------


@pytest.mark.parametrize("pool, concurrency, sleep", [
    ("prefork", 4, 0.1),   # the GIL holder's process runs it alone; the others run in 3 children beside it
    ("threads", 16, 0.3),  # all 15 unrelated runs in flight in the GIL holder's process
    ("solo", 1, 0.02),     # one run at a time: the others wait behind it
])
def test_a_step_holding_the_gil_past_the_lease_runs_once_and_costs_no_other_run_anything(  # type: ignore[no-untyped-def]
        engine, broker_url, second_worker, tmp_path, pool, concurrency, sleep):
    queue = _queue()
    with _subject(tmp_path, broker_url, pool, concurrency, queue) as subject:
        if pool == "threads":
            # In flight until the step holding the GIL is over: their step b lasts until released.
            key = f"release-{uuid.uuid4()}"
            unrelated = [beside_until.apply_async([sleep, key], queue=queue).id for _ in range(UNRELATED)]
            wait_for(lambda: _started(engine, unrelated, "b") == UNRELATED, what=f"{UNRELATED} runs in flight")
            hog = gil_hog.apply_async([HOG], queue=queue).id
            _all_ended(engine, [hog], timeout=120)
            with engine.begin() as conn:
                conn.execute(text("INSERT INTO test.side_effect (run_id, step) VALUES (:k, 'release')"), {"k": key})
        else:
            hog = gil_hog.apply_async([HOG], queue=queue).id
            wait_for(lambda: count_effects(engine, hog, "gil") == 1, what="the GIL-holding step to start")
            unrelated = [beside.apply_async([sleep], queue=queue).id for _ in range(UNRELATED)]
        runs = [hog, *unrelated]
        states = _all_ended(engine, runs, timeout=120)
        log = subject.output()
    executions = _executions(engine, runs)
    assert {step: executions.get((str(hog), step)) for step in ("before", "gil", "after")} == \
        {"before": 1, "gil": 1, "after": 1}
    assert {key: n for key, n in executions.items() if n != 1} == {}  # no step of any run ran twice
    assert sum(1 for run in unrelated for step in "abc" if (str(run), step) in executions) == 3 * UNRELATED
    assert states == {"succeeded": len(runs)}
    assert {run: _attempts(engine, run) for run in runs if _attempts(engine, run) != ["succeeded"]} == {}
    assert _rows(engine, "SELECT count(*) AS n FROM job_run_dlq WHERE run_id = ANY(:r)", r=runs)[0].n == 0
    assert "renew their leases themselves" not in log and "renews its runs' leases itself" not in log
    # What makes the above worth asserting: the step held the GIL past the lease and a sweep,
    (held,) = _rows(engine, "SELECT output FROM job_step WHERE run_id = :r AND step_id = 'gil'", r=hog)
    assert held.output["held"] > LEASE + 1.0, f"the step held the GIL for {held.output['held']:.1f} s only"
    if pool == "threads":
        # and under threads, every unrelated run was in flight in its process when it took the
        # GIL, and finished after it let go.
        beside_hog = _rows(engine, """
            SELECT count(*) AS n FROM job_run r, job_step g
            WHERE g.run_id = :hog AND g.step_id = 'gil' AND r.run_id = ANY(:r)
              AND r.started_at < g.started_at AND r.finished_at > g.completed_at""", hog=hog, r=unrelated)
        assert beside_hog[0].n == UNRELATED


# --- a killed holder loses its runs after the lease, as before ----------------------


def _lost_after(engine: Any, run_id: uuid.UUID, killed_at: Any) -> float:
    """Seconds from ``killed_at`` (the database's clock) to the reclaim of the run's first attempt."""
    wait_for(lambda: _attempts(engine, run_id)[:1] == ["lost"], timeout=LEASE + 30, interval=0.1,
             what=f"run {run_id} to be reclaimed")
    (row,) = _rows(engine, "SELECT extract(epoch FROM finished_at - :k) AS s FROM job_run "
                   "WHERE run_id = :r AND attempt = 1", r=run_id, k=killed_at)
    return float(row.s)


def _now(engine: Any) -> Any:
    return _rows(engine, "SELECT now() AS now")[0].now


def _holder_of(engine: Any, run_id: uuid.UUID, worker: Worker) -> int:
    """The pid of ``worker``'s process that claimed ``run_id`` (its first attempt), once its step has started."""
    wait_for(lambda: count_effects(engine, run_id, "long") >= 1, what=f"the step of {run_id} to start")
    (row,) = _rows(engine, "SELECT worker FROM job_run WHERE run_id = :r AND attempt = 1", r=run_id)
    host, pid = row.worker.rsplit("/", 1)
    assert host == worker.nodename, row.worker
    return int(pid)


def test_a_killed_holder_loses_its_runs_when_their_leases_run_out_and_a_live_one_keeps_its_own(  # type: ignore[no-untyped-def]
        engine, broker_url, second_worker, tmp_path):
    queue = _queue()
    with _subject(tmp_path, broker_url, "prefork", 2, queue) as subject:
        first = long_first.apply_async([60], queue=queue).id
        first_pid = _holder_of(engine, first, subject)
        second = long_first.apply_async([60], queue=queue).id
        second_pid = _holder_of(engine, second, subject)
        assert first_pid != second_pid

        os.kill(first_pid, signal.SIGKILL)  # one pool child: its worker and the renewer live on
        killed_at = _now(engine)
        lost_after = _lost_after(engine, first, killed_at)
        wait_for(lambda: _attempts(engine, first) == ["lost", "succeeded"], timeout=20, what="the retry")
        assert _attempts(engine, second) == ["running"]  # the live child's run kept its lease all along
        assert re.search(rf"holder pid {first_pid} is gone .*1 run\(s\) are no longer renewed", subject.output())

        subject.kill(signal.SIGKILL)  # the whole process group: the main process (and its renewer), the children
        killed_at = _now(engine)
        group_lost_after = _lost_after(engine, second, killed_at)
        wait_for(lambda: _attempts(engine, second) == ["lost", "succeeded"], timeout=20,
                 what="the retry on the second worker")
    # Renewed up to the kill, then no more: reclaimed once the lease ran out and a sweep came
    # (renewed on, it would never have been; the bound above is the time a loaded machine takes).
    for after in (lost_after, group_lost_after):
        assert LEASE / 4 < after < LEASE + 10
    assert count_effects(engine, first, "long") == 2 and count_effects(engine, second, "long") == 2


# --- where the renewer runs -----------------------------------------------------------


def _group(worker: Worker) -> dict[int, str]:
    """The processes of ``worker``'s process group: pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) == worker.proc.pid:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (ProcessLookupError, OSError):
            continue
    return found


def test_under_prefork_the_renewer_is_a_thread_of_the_main_process(  # type: ignore[no-untyped-def]
        engine, broker_url, tmp_path):
    """Its renewals are the GIL test's and the killed holder's above: here, where it runs."""
    subject_queue = _queue()
    with _subject(tmp_path, broker_url, "prefork", 2, subject_queue) as subject:
        wait_for(lambda: "lease renewer started in the worker's main process" in subject.output(), timeout=30,
                 what="the renewer's start")
        assert f"lease renewer started in the worker's main process (pid {subject.proc.pid})" in subject.output()
        group = _group(subject)
        long_first.apply_async([0], queue=subject_queue).get(timeout=30)  # a run renewed from there
        log = subject.output()
    assert "cannot be reached" not in log and "renewer's thread ended" not in log, log
    assert len(group) == 3, group  # the main process and its 2 pool children: no process more
    assert not [cmd for cmd in group.values() if "motir_celery.adapter.renewer" in cmd], group


# --- the renewer killed -------------------------------------------------------------


def test_a_killed_renewer_is_started_again_and_the_runs_in_flight_keep_their_leases(  # type: ignore[no-untyped-def]
        engine, broker_url, second_worker, tmp_path):
    queue = _queue()
    # Under threads, the renewer is a process of its own (under prefork, the main process's thread).
    with _subject(tmp_path, broker_url, "threads", 2, queue) as subject:
        (old,) = map(int, re.findall(r"lease renewer started \(pid (\d+)\)", subject.output()))
        run = until_released.apply_async([120], queue=queue).id  # runs until released, below
        _holder_of(engine, run, subject)
        os.kill(old, signal.SIGKILL)

        def restarted() -> list[int]:
            return [int(p) for p in re.findall(r"lease renewer started \(pid (\d+)\)", subject.output())[1:]]

        (new,) = wait_for(restarted, timeout=30, what="the renewer to be started again")
        wait_for(lambda: "the worker's lease renewer is back" in subject.output(), timeout=30,
                 what="the run's process to reconnect")
        # The new renewer carries a step that holds the GIL past the lease, as the first did.
        hog = gil_hog.apply_async([HOG], queue=queue).id
        _all_ended(engine, [hog], timeout=120)
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO test.side_effect (run_id, step) VALUES (:r, 'release')"), {"r": str(run)})
        _all_ended(engine, [run], timeout=60)
        log = subject.output()
    assert new != old
    assert f"the lease renewer (pid {old}) exited with status -9; starting it again" in log
    assert "the worker's lease renewer is gone" in log  # the run's process renewed in process meanwhile
    # The run spanned it all (the renewer killed, the holders on their own, the new renewer):
    assert _attempts(engine, run) == ["succeeded"] and count_effects(engine, run, "long") == 1
    assert _attempts(engine, hog) == ["succeeded"] and count_effects(engine, hog, "gil") == 1


# --- the bound -------------------------------------------------------------------------


@pytest.mark.parametrize("job, setting, bound", [
    (time_limited, {}, "time_limit=1"),
    (until_lost, {"max_hold_seconds": 1.0}, "default_hold=1s"),
], ids=["the job's time_limit", "the engine's max_hold_seconds"])
def test_a_run_held_past_its_bound_is_no_longer_renewed_and_is_reclaimed(  # type: ignore[no-untyped-def]
        engine, broker_url, caplog, job, setting, bound):
    """In this process, with its heartbeat and a sweeper running as a worker's would."""
    settings = replace(Settings.from_env({**os.environ, "MOTIR_LEASE_SECONDS": "1"}), **setting)
    queue = _queue()  # nobody consumes it: this process runs the run
    run = job.apply_async([60], queue=queue).id  # its step runs until the run is reclaimed
    stop = threading.Event()

    def every(seconds: float, duty: Any) -> threading.Thread:
        thread = threading.Thread(target=lambda: [duty() for _ in iter(lambda: stop.wait(seconds), True)])
        thread.start()
        return thread

    here = Engine(settings, host=Held())  # a worker's engine whose sweeps and runs publish nothing
    duties = [every(0.1, here.leases.renew_due), every(0.2, here.sweep)]
    caplog.set_level(logging.WARNING, logger="motir_celery.leases")
    try:
        outcome = here.execute(run, job_id=job.id, worker="here")
    finally:
        stop.set()
        for thread in duties:
            thread.join()
        redis.Redis.from_url(broker_url).delete(queue)
    assert outcome.state == "lost"  # its step's record refused: the run was reclaimed while it ran
    # This attempt was reclaimed ("lost"). Whoever reclaimed it may run it again: this process's
    # sweeper publishes nothing, the module's second worker (when an earlier test started it)
    # publishes what it reclaims and takes it, a later attempt of the same run.
    assert _attempts(engine, run)[0] == "lost"
    assert f"run {run}: held past its bound ({bound})" in caplog.text
