"""throttle=, debounce= and batch=: each decided in Postgres, driven concurrently, costing nothing to other jobs.

Everything runs in this process on the test kit (``motir`` fixture: the real runner, ``advance``
skips time): the races with sender threads released together (a ``threading.Barrier``) and, where
the claims race too, threads that take and run due runs concurrently as worker processes would
(tests/fixtures/kit_workers.py). One test keeps real Celery workers (tests/conftest.py
``celery_worker``): a worker process SIGKILLed mid-decision. The app role's way in
(``motir_enqueue_gather``) is shown guard by guard, as tests/store/test_isolation.py does for 0008's.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from sqlalchemy import Connection, create_engine, make_url, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

import tests.fixtures.flow_jobs  # noqa: F401  (the flow jobs, registered in this process too)
from motir_celery import send_event
from motir_celery.adapter.celery_app import create_app as create_celery_app
from motir_celery.core.jobs import define_job, get_job
from motir_celery.core.producer.events import SendResult
from motir_celery.core.runspec import Batch, Debounce, Throttle, run_options
from motir_celery.core.worker import flow
from motir_celery.errors import JobDefinitionError
from motir_celery.settings import get_settings
from motir_celery.store.db import set_workspace_context
from motir_celery.store.migrate import check
from motir_celery.store.records import Queued
from motir_celery.store.rls import APP_ROLE
from motir_celery.store.sql import flow as flow_sql
from motir_celery.store.sql import producer as producer_sql
from motir_celery.testing import Motir
from tests.conftest import celery_worker, wait_for
from tests.fixtures.flow_jobs import LIMIT, PERIOD
from tests.fixtures.kit_workers import run_concurrently

A, B = "ws-a", "ws-b"
WORKER_ENV = {"MOTIR_IMPORTS": "tests.fixtures.jobs,tests.fixtures.flow_jobs", "MOTIR_REPUBLISH_AFTER": "2"}


def _rows(engine: Engine, sql: str, **params: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(text(sql), params).all())


def _together(n: int, work: Callable[[int], None]) -> None:
    """``work(i)`` in ``n`` threads released at once; re-raises the first failure."""
    barrier, errors = threading.Barrier(n), []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            work(i)
        except BaseException as exc:  # noqa: BLE001 — reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]


# --- definitions ----------------------------------------------------------------------------


def test_the_options_take_tuples_or_their_dataclasses_and_refuse_what_cannot_work() -> None:
    opts = run_options("j", {"throttle": (5, 60, "data.a"), "debounce": (2.0,)})
    assert opts.throttle == Throttle(5, 60.0, "data.a") and opts.debounce == Debounce(2.0, None, 20.0)
    assert run_options("j", {"batch": Batch(10, 5)}).batch == Batch(10, 5.0, None)
    for bad in ({"throttle": (0, 60)}, {"throttle": (5, -1)}, {"throttle": 5}, {"debounce": (5, None, 1)},
                {"batch": (5000, 1)}, {"batch": (5, float("nan"))}, {"debounce": (1,), "batch": (2, 1)},
                {"batch": (2, 1), "singleton_key": "data.k"}):
        with pytest.raises(JobDefinitionError):
            run_options("j", bad)
    with pytest.raises(JobDefinitionError, match="needs event="):
        define_job("flow.bad-direct", batch=(2, 1.0))(lambda step: None)


# --- throttle -------------------------------------------------------------------------------


def _starts(engine: Engine, job: str) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    for key, at in _rows(engine, "SELECT throttle_key, throttle_at FROM job_queue WHERE job_id = :j "
                                 "AND throttle_at IS NOT NULL ORDER BY throttle_at", j=job):
        found.setdefault(key, []).append(at)
    return found


def _never_more_than(starts: list[Any], limit: int, period: float) -> None:
    """No window of ``period`` holds more than ``limit`` starts: start i and start i + limit are a period apart."""
    gaps = [(starts[i + limit] - starts[i]).total_seconds() for i in range(len(starts) - limit)]
    assert all(g >= period - 1e-6 for g in gaps), gaps


def test_throttled_runs_wait_queued_and_start_in_the_order_they_were_sent(motir: Motir) -> None:
    sent = [motir.send_event("flow.throttle", {"key": "k", "n": n}).run_ids[0] for n in range(2 * LIMIT + 1)]
    first = [run for run, o in motir.drain() if o.state == "succeeded"]
    assert first == sent[:LIMIT]  # the rest wait: none dropped, none failed
    waiting = _rows(motir.sql, "SELECT id, flow_wait, run_at > now() FROM job_queue WHERE state = 'queued' "
                                  "ORDER BY run_at, created_at")
    assert [(r[1], r[2]) for r in waiting] == [("throttle", True)] * (LIMIT + 1)
    motir.advance(seconds=PERIOD)
    assert [run for run, o in motir.drain() if o.state == "succeeded"] == sent[LIMIT:2 * LIMIT]
    motir.advance(seconds=PERIOD)
    assert [run for run, o in motir.drain() if o.state == "succeeded"] == sent[2 * LIMIT:]
    order = _rows(motir.sql, "SELECT id FROM job_queue ORDER BY throttle_at, created_at")
    assert [r[0] for r in order] == sent


def test_a_retry_is_not_throttled_again(motir: Motir) -> None:
    first = motir.send_event("flow.throttle_flaky", {}).run_ids[0]
    second = motir.send_event("flow.throttle_flaky", {}).run_ids[0]
    motir.drain()
    assert motir.outcomes_of(motir.handles(_result(first))[0]) == ["retrying"]
    motir.advance(seconds=0.5)  # the retry's backoff, far less than the throttle's minute
    motir.drain()
    states = dict(_rows(motir.sql, "SELECT id, state FROM job_queue"))
    assert states == {first: "succeeded", second: "queued"}  # the second waits for its start slot


def _result(run_id: uuid.UUID) -> SendResult:
    return SendResult(None, [Queued(run_id, "flow.throttled_flaky")])


def test_a_keyed_throttle_is_per_workspace_and_the_job_wide_one_spans_them(motir: Motir) -> None:
    # throttle=(LIMIT, PERIOD, "data.key"): the same key in two workspaces is two keys
    for ws in (A, B):
        for n in range(LIMIT):
            motir.send_event("flow.throttle", {"key": "k", "n": n}, workspace_id=ws)
    assert sum(o.state == "succeeded" for _, o in motir.drain()) == 2 * LIMIT
    # throttle=(1, 60): one start a minute for the whole job, whichever workspace
    motir.send_event("flow.throttle_whole", {}, workspace_id=A)
    motir.send_event("flow.throttle_whole", {}, workspace_id=B)
    assert sum(o.state == "succeeded" for _, o in motir.drain()) == 1


def _lock_waiters(engine: Engine) -> int:
    return int(_rows(engine, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")[0][0])


def test_a_worker_killed_mid_decision_records_nothing_and_the_run_starts_on_another(
        engine: Engine, broker_url: str, tmp_path: Path) -> None:
    celery = create_celery_app()
    holder = create_engine(engine.url, poolclass=NullPool)
    with holder.connect() as lock:
        # The test holds the job-wide throttle key's lock: the worker's decision blocks inside it.
        with lock.begin():
            flow_sql.lock_flow_key(lock, "throttle", "flow.throttled_whole", None, "")
            (run_id,) = send_event("flow.throttle_whole", {}, app=celery).run_ids
            with celery_worker(tmp_path, broker=broker_url, name="doomed", env=WORKER_ENV) as doomed:
                wait_for(lambda: _lock_waiters(engine) >= 1, timeout=30, what="the worker to wait inside its decision")
                doomed.kill()  # SIGKILL, mid-decision: its transaction read the run and waits on the key's lock
                doomed.proc.wait(timeout=10)
        # released: the dead worker's backend finishes its statement, finds its client gone, rolls back
    holder.dispose()
    wait_for(lambda: _lock_waiters(engine) == 0, timeout=10, what="the dead worker's backend to let go")
    assert _rows(engine, "SELECT state, throttle_at, attempts FROM job_queue WHERE id = :r", r=run_id) == [
        ("queued", None, 0)]
    assert _rows(engine, "SELECT count(*) FROM job_run WHERE run_id = :r", r=run_id) == [(0,)]
    with celery_worker(tmp_path, broker=broker_url, name="next", env=WORKER_ENV):
        wait_for(lambda: _rows(engine, "SELECT state FROM job_queue WHERE id = :r", r=run_id) == [("succeeded",)],
                 timeout=40, what="the run to start on the next worker")
    assert _rows(engine, "SELECT count(*) FROM job_run WHERE run_id = :r", r=run_id) == [(1,)]


# --- debounce -------------------------------------------------------------------------------


def test_a_burst_makes_one_run_with_the_last_event_once_the_key_is_quiet(motir: Motir) -> None:
    results = [motir.send_event("flow.debounce", {"key": "k", "n": n}, workspace_id=A) for n in range(5)]
    other = motir.send_event("flow.debounce", {"key": "other", "n": 99}, workspace_id=A)
    runs = {r.runs[0].run_id for r in results}  # type: ignore[union-attr]
    assert len(runs) == 1  # every event of the burst joined the first one's run
    assert [type(r.runs[0]).__name__ for r in results] == ["Queued"] + ["Gathered"] * 4
    assert motir.drain() == []  # quiet for 5 s is not yet
    motir.advance(seconds=4)
    motir.send_event("flow.debounce", {"key": "k", "n": 5}, workspace_id=A)  # not quiet: 5 s from now
    motir.advance(seconds=4)
    assert [o.result for _, o in motir.drain()] == [{"key": "other", "n": 99}]
    motir.advance(seconds=1.5)
    done = motir.drain()
    assert [o.result for _, o in done] == [{"key": "k", "n": 5}]  # one run, the last event
    assert done[0][0] in runs and other.runs[0].run_id not in runs  # type: ignore[union-attr]
    assert _rows(motir.sql, "SELECT count(*), sum(gathered) FILTER (WHERE flow_key = 'k') FROM job_queue") == [
        (2, 6)]


def test_a_debounced_run_takes_what_its_last_events_data_keys(motir: Motir) -> None:
    # concurrency=(1, "data.account") beside debounce=: the run's slot is its last event's account
    first = motir.send_event("flow.debounce_limited", {"key": "k", "account": "a1"}).runs[0]
    motir.send_event("flow.debounce_limited", {"key": "k", "account": "a2"})
    assert _rows(motir.sql, "SELECT concurrency_key, gathered FROM job_queue") == [("a2", 2)]
    motir.advance(seconds=6)
    assert [o.result for _, o in motir.drain()] == [{"key": "k", "account": "a2"}]
    assert first.run_id == _rows(motir.sql, "SELECT id FROM job_queue")[0][0]  # type: ignore[union-attr]


def test_a_key_that_never_goes_quiet_still_runs_at_max_wait(motir: Motir) -> None:
    # debounce=(5 s, key, max_wait 30 s): an event every 4 s would put it off for ever
    for n in range(8):
        motir.send_event("flow.debounce", {"key": "k", "n": n})
        motir.advance(seconds=4)
        if n < 7:
            assert motir.drain() == [], n
    done = motir.drain()  # 32 s after the first event: past max_wait
    assert [o.result["n"] for _, o in done] == [7]
    motir.send_event("flow.debounce", {"key": "k", "n": 8})  # the next burst: a run of its own
    motir.advance(seconds=6)
    assert [o.result["n"] for _, o in motir.drain()] == [8]


def test_a_sender_killed_mid_gathering_writes_nothing(engine: Engine, database_url: str) -> None:
    import os
    import signal
    import subprocess
    import sys

    holder = create_engine(engine.url, poolclass=NullPool)
    with holder.connect() as lock, lock.begin():
        flow_sql.lock_flow_key(lock, "gather", "flow.debounced_fast", None, "k")  # the key's lock, held
        sender = subprocess.Popen(
            [sys.executable, "-c", "import tests.fixtures.flow_jobs; from tests.fixtures.engines import send; "
             "send('flow.debounce_fast', {'key': 'k'})"],
            cwd=Path(__file__).resolve().parents[2], env={**os.environ, "MOTIR_DATABASE_URL": database_url})
        wait_for(lambda: _lock_waiters(engine) >= 1, timeout=30, what="the sender to wait inside motir_gather")
        sender.send_signal(signal.SIGKILL)  # its transaction wrote the event and the run, and waits on the key
        sender.wait(timeout=10)
    holder.dispose()
    wait_for(lambda: _lock_waiters(engine) == 0, timeout=10, what="the dead sender's backend to let go")
    wait_for(lambda: _rows(engine, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                   "AND state <> 'idle' AND pid <> pg_backend_pid() "
                                   "AND query LIKE '%motir_record_event%'") == [(0,)],
             timeout=10, what="its statement to end")
    assert _rows(engine, "SELECT count(*) FROM job_event") == [(0,)]  # the event, the run: all or nothing
    assert _rows(engine, "SELECT count(*) FROM job_queue") == [(0,)]
    send_event("flow.debounce_fast", {"key": "k"})
    assert _rows(engine, "SELECT gathered, flow_wait FROM job_queue") == [(1, "debounce")]


# --- batch ----------------------------------------------------------------------------------


def test_a_batch_runs_when_full_or_when_its_timeout_passes(motir: Motir) -> None:
    for n in range(7):
        motir.send_event("flow.batch", {"key": "k", "n": n})
    full = motir.drain()
    assert [[e["n"] for e in o.result] for _, o in full] == [[0, 1, 2, 3, 4]]  # max_size 5: due at once
    motir.advance(seconds=9)
    assert motir.drain() == []
    motir.advance(seconds=1.5)  # 10 s after its first event
    assert [[e["n"] for e in o.result] for _, o in motir.drain()] == [[5, 6]]


def test_a_run_no_producer_gathered_is_gathered_at_its_claim(motir: Motir) -> None:
    # A fan-out path that does not gather (dispatch_event, a previous release's producer): the
    # runs are plain rows; their first claim gathers them under the same lock.
    job = get_job("flow.batched")
    with motir.sql.begin() as conn:
        for n in range(3):
            producer_sql.record_event(conn, "flow.batch", f'{{"key": "k", "n": {n}}}', None, None,
                                      [job.spec({"key": "k", "n": n}, None)])
    assert {o.state for _, o in motir.drain()} == {"skipped"}  # each claim gathered its run, none ran
    motir.advance(seconds=11)
    done = [o for _, o in motir.drain() if o.state == "succeeded"]
    assert [[e["n"] for e in o.result] for o in done] == [[0, 1, 2]]


def test_a_step_invoke_of_a_batch_job_runs_its_child_as_a_batch_of_one(motir: Motir) -> None:
    motir.send_event("flow.batch", {"key": "k", "n": 0})  # an open batch of the same key is there
    parent = motir.send_event("flow.invoke_batch", {"n": 7}).run_ids[0]
    motir.drain()
    assert motir.state(motir.handles(SendResult(None, [Queued(parent, "flow.invokes_batch")]))[0]) == "succeeded"
    (result,) = _rows(motir.sql, "SELECT result FROM job_queue WHERE id = :r", r=parent)
    assert result[0] == [{"key": "k", "n": 7}]  # not folded into the open batch: the parent got its child
    assert _rows(motir.sql, "SELECT gathered, flow_wait FROM job_queue WHERE job_id = 'flow.batched' "
                               "AND parent_run_id IS NULL") == [(1, "batch")]


# --- costing nothing to the jobs that do not use them -----------------------------------------


@contextmanager
def _flow_calls() -> Iterator[list[str]]:
    """Every call into flow control's claim and its statements (store/sql/flow.py) while the block runs."""
    calls: list[str] = []
    names = [n for n, v in vars(flow_sql).items() if callable(v) and not n.startswith("_")
             and getattr(v, "__module__", "") == flow_sql.__name__]
    originals = {n: getattr(flow_sql, n) for n in names}

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapped

    real_claim = flow.claim
    for n, fn in originals.items():
        setattr(flow_sql, n, spy(n, fn))
    setattr(flow, "claim", spy("flow.claim", real_claim))
    try:
        yield calls
    finally:
        for n, fn in originals.items():
            setattr(flow_sql, n, fn)
        setattr(flow, "claim", real_claim)


def test_a_job_without_flow_control_sends_none_of_its_statements(engine: Engine) -> None:
    from tests.fixtures.engines import holding
    from tests.fixtures.ops_helpers import emit

    assert not get_job("flow.plain").run_options.flow and get_job("flow.throttled").run_options.flow
    worker = holding()
    plain = emit("flow.plain", {"n": 1})["flow.plain"]
    with _flow_calls() as calls:
        assert worker.execute(plain, job_id="flow.plain", worker="t").state == "succeeded"
        assert emit("flow.plain", {"n": 2})  # nor its fan-out (send_event)
    assert calls == []  # the claim statement, the settle: as before flow control existed
    throttled = emit("flow.throttle", {"key": "x"})["flow.throttled"]
    with _flow_calls() as calls:
        assert worker.execute(throttled, job_id="flow.throttled", worker="t").state == "succeeded"
        emit("flow.batch", {"key": "x"})
    assert calls[:1] == ["flow.claim"] and {"throttle_state", "throttle_admit", "gather"} <= set(calls)  # the control


# --- the app role's way in: motir_enqueue_gather, guard by guard ----------------------------


@pytest.fixture(scope="module")
def app_login(engine: Engine) -> Iterator[str]:
    name = f"motir_f{uuid.uuid4().hex[:8]}_app"
    with engine.begin() as conn:
        conn.execute(text(f'CREATE ROLE "{name}" LOGIN IN ROLE {APP_ROLE}'))
    yield name
    with engine.begin() as conn:
        conn.execute(text(f'DROP ROLE IF EXISTS "{name}"'))


@contextmanager
def _as(login: str, workspace: str | None) -> Iterator[Connection]:
    url = make_url(get_settings().require_database_url()).set(username=login)
    eng = create_engine(url, poolclass=NullPool)
    try:
        with eng.connect() as conn, conn.begin():
            if workspace is not None:
                set_workspace_context(conn, workspace)
            yield conn
    finally:
        eng.dispose()


def _own_run(conn: Connection, ws: str = A) -> uuid.UUID:
    """A run the app role's own transaction makes, as send_event(session=...) does."""
    return conn.execute(text(
        "SELECT run_id FROM motir_enqueue_event('flow.batch', '{\"key\": \"k\"}'::jsonb, :ws, NULL, NULL, "
        "ARRAY['flow.batched'], ARRAY[1], ARRAY['none'], ARRAY[0]::smallint[], ARRAY[NULL]::text[], "
        "ARRAY[NULL]::text[], ARRAY[NULL]::text[])"), {"ws": ws}).scalar_one()


def _gather(conn: Connection, runs: list[uuid.UUID], *, wait: float = 5.0) -> list[Any]:
    n = len(runs)
    return list(conn.execute(text(
        "SELECT * FROM motir_enqueue_gather(CAST(:r AS uuid[]), CAST(:k AS text[]), CAST(:key AS text[]), "
        "CAST(:w AS float8[]), CAST(:l AS float8[]))"),
        {"r": runs, "k": ["batch"] * n, "key": ["k"] * n, "w": [wait] * n, "l": [10.0] * n}).all())


def _foreign_run(engine: Engine) -> uuid.UUID:
    with engine.begin() as conn:  # the engine's, in workspace B, made in another transaction
        runs = producer_sql.record_event(conn, "flow.batch", '{"key": "k"}', B, None,
                                         [get_job("flow.batched").spec({"key": "k"}, B)])[1]
    assert isinstance(runs[0], Queued)
    return runs[0].run_id


GATHER_ATTACKS: dict[str, Callable[[Connection, Engine], Any]] = {
    "workspace_set": lambda conn, engine: _gather(conn, []),
    "shape": lambda conn, engine: _gather(conn, [_own_run(conn)] * 1001),   # one call, unbounded work
    "own_runs": lambda conn, engine: _gather(conn, [_foreign_run(engine)]),
    "bounds": lambda conn, engine: _gather(conn, [_own_run(conn)], wait=10 * 365 * 86400.0),
}


def test_the_app_role_gathers_its_own_runs_through_the_checked_function(app_login: str, engine: Engine) -> None:
    with _as(app_login, A) as conn:
        first, second = _own_run(conn), _own_run(conn)
        found = _gather(conn, [first, second])
    assert sorted((r.run_id == r.into_run) for r in found) == [False, True]  # one opened, one joined it
    assert _rows(engine, "SELECT count(*), max(gathered) FROM job_queue WHERE job_id = 'flow.batched'") == [(1, 2)]


@pytest.mark.parametrize("guard", list(GATHER_ATTACKS))
def test_each_guard_of_motir_enqueue_gather_is_what_stops_its_attack(guard: str, app_login: str,
                                                                     engine: Engine) -> None:
    attack = GATHER_ATTACKS[guard]
    workspace = None if guard == "workspace_set" else A
    with pytest.raises(DBAPIError) as err:  # every guard in place: refused, nothing written
        with _as(app_login, workspace) as conn:
            attack(conn, engine)
    assert str(err.value.orig).startswith("motir:"), err.value.orig
    original = str(_rows(engine, "SELECT pg_get_functiondef(oid) FROM pg_proc WHERE proname = 'motir_enqueue_gather'")[0][0])
    line = next(ln for ln in original.splitlines() if ln.rstrip().endswith(f"-- guard: {guard}"))
    mutant = original.replace(line, re.sub(r"^(\s*IF ).*?( THEN RAISE)", r"\1false\2", line, count=1))
    assert mutant != original
    with engine.begin() as conn:
        conn.execute(text(mutant))
    try:  # the same call without that one guard goes through: the guard is what stopped it
        with _as(app_login, workspace) as conn:
            attack(conn, engine)
    finally:
        with engine.begin() as conn:
            conn.execute(text(original))
    check(str(engine.url.render_as_string(hide_password=False)))  # the original is back, digest and all


# --- races: concurrent senders, and claims taken by concurrent workers (threads) ----------------


def test_throttle_never_starts_more_than_its_limit_per_period_across_workers(kit: Motir) -> None:
    engine = kit.sql
    per_key = 4 * LIMIT
    made: list[uuid.UUID] = []

    def sender(i: int) -> None:  # 8 threads: 4 per key, each sends LIMIT events
        for n in range(LIMIT):
            made.extend(kit.send_event("flow.throttle", {"key": "ab"[i % 2], "n": n}).run_ids)

    started = time.monotonic()
    _together(8, sender)
    assert len(made) == 2 * per_key

    def all_succeeded() -> bool:
        return _rows(engine, "SELECT count(*) FROM job_queue WHERE job_id = 'flow.throttled' "
                             "AND state = 'succeeded'")[0][0] == 2 * per_key

    # Six threads take and run due runs at once, in real time (as two workers of three processes
    # did): every start is decided by the throttle under their concurrent claims. None dropped.
    run_concurrently(kit, 6, all_succeeded, timeout=90, idle=0.05)
    took = time.monotonic() - started
    starts = _starts(engine, "flow.throttled")
    assert sorted(starts) == ["a", "b"] and all(len(s) == per_key for s in starts.values())
    for key_starts in starts.values():
        _never_more_than(key_starts, LIMIT, PERIOD)
        # and the throttle did hold them: 4 × LIMIT starts need at least 3 full periods
        assert (key_starts[-1] - key_starts[0]).total_seconds() >= 3 * PERIOD - 1e-6
    assert took >= 3 * PERIOD
    # Two keys, two windows: the keys' starts interleave, neither waited for the other.
    assert abs((starts["a"][0] - starts["b"][0]).total_seconds()) < PERIOD


def test_concurrent_senders_of_one_key_make_one_debounced_run(kit: Motir) -> None:
    engine = kit.sql
    sent: list[Any] = []

    def sender(i: int) -> None:  # engine-role senders and app-role ones (a user's transaction)
        for n in range(2):
            data = {"key": "k", "n": f"{i}.{n}"}
            if i % 2:
                with kit.engine.session(A) as s:
                    sent.append(send_event("flow.debounce_fast", data, workspace_id=A, session=s))
                    s.commit()
            else:
                sent.append(send_event("flow.debounce_fast", data, workspace_id=A))

    _together(8, sender)  # the quiet period is 1 s: the whole burst is in before it ends
    (run,) = _rows(engine, "SELECT id, gathered, state FROM job_queue WHERE job_id = 'flow.debounced_fast'")
    assert run.gathered == 16 and run.state in ("queued", "running", "succeeded")
    assert {r.runs[0].run_id for r in sent} == {run.id}  # type: ignore[union-attr]
    kit.advance(seconds=1)  # quiet for its second
    kit.drain()
    assert _rows(engine, "SELECT state FROM job_queue WHERE id = :r", r=run.id) == [("succeeded",)]
    (result,) = _rows(engine, "SELECT result FROM job_queue WHERE id = :r", r=run.id)
    assert result[0]["n"] in {f"{i}.{n}" for i in range(8) for n in range(2)}
    assert _rows(engine, "SELECT count(*) FROM test.side_effect WHERE run_id = :r", r=str(run.id)) == [(1,)]


def test_concurrent_senders_fill_batches_and_every_event_lands_in_exactly_one(kit: Motir) -> None:
    engine = kit.sql

    def sender(i: int) -> None:
        for n in range(5):
            send_event("flow.batch_fast", {"key": "k", "n": i * 5 + n})

    _together(5, sender)
    kit.drain()  # the full batches
    kit.advance(seconds=1)  # the last one's timeout
    kit.drain()
    assert _rows(engine, "SELECT count(*) FROM job_queue WHERE job_id = 'flow.batched_fast' "
                         "AND state <> 'succeeded'") == [(0,)]  # every batch ran
    results = [r[0] for r in _rows(engine, "SELECT result FROM job_queue WHERE job_id = 'flow.batched_fast'")]
    assert sorted(n for batch in results for n in batch) == list(range(25))  # each event once, none lost
    assert all(1 <= len(batch) <= 10 for batch in results) and len(results) >= 3
    assert _rows(engine, "SELECT count(*) FROM job_batch_item") == [(25,)]
