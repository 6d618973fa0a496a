"""The database, not the code, refuses duplicates (DESIGN.md invariants 1 and 2).

Every test here writes straight SQL through the owner connection, so what is
being proven is the schema: a unique constraint that is missing or has the
wrong columns makes the duplicate insert succeed and the test fail.
"""

from __future__ import annotations

import re
import threading
import uuid
from datetime import datetime, timezone
from typing import Any, Iterator

import psycopg.errors
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from motir_celery.store.driver import Statement, plan
from motir_celery.store.records import AlreadyQueued, Queued
from motir_celery.store.sql import catalogue
from motir_celery.store.sql import flow as flow_sql
from motir_celery.store.sql import operator as operator_sql
from motir_celery.store.sql import reads as reads_sql
from motir_celery.store.sql.maintenance import RECLAIM_EXPIRED, REPUBLISH_DUE
from motir_celery.store.sql.producer import CANCEL_BY_KEY, enqueue_scheduled
from motir_celery.store.sql.worker import NEXT_IN_LINE

SLOT = datetime(2030, 1, 1, 9, 0, tzinfo=timezone.utc)


def _event(conn: Connection, name: str = "test.event") -> uuid.UUID:
    return conn.execute(
        text("INSERT INTO job_event (name, data) VALUES (:n, '{}'::jsonb) RETURNING id"), {"n": name}
    ).scalar_one()


def _run(conn: Connection, job_id: str = "job.a", *, event_id: uuid.UUID | None = None,
         scheduled_for: datetime | None = None) -> uuid.UUID:
    return conn.execute(
        text(
            "INSERT INTO job_queue (job_id, event_id, scheduled_for, event_name, max_attempts, retry_policy) "
            "VALUES (:job, :ev, :slot, 'test.event', 3, 'transient') RETURNING id"
        ),
        {"job": job_id, "ev": event_id, "slot": scheduled_for},
    ).scalar_one()


def _step(conn: Connection, run_id: uuid.UUID, step_id: str) -> None:
    conn.execute(
        text(
            "INSERT INTO job_step (run_id, step_id, output, attempt, started_at) "
            "VALUES (:r, :s, '1'::jsonb, 1, now())"
        ),
        {"r": run_id, "s": step_id},
    )


def _count(engine: Engine, sql: str, **params: object) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(sql), params).scalar_one())


def test_duplicate_run_and_step_is_refused_by_the_database(engine: Engine) -> None:
    with engine.begin() as conn:
        run_id = _run(conn)
        _step(conn, run_id, "charge-card")
        _step(conn, run_id, "send-receipt")  # another step of the same run is fine
    with pytest.raises(IntegrityError) as err, engine.begin() as conn:
        _step(conn, run_id, "charge-card")
    assert isinstance(err.value.orig, psycopg.errors.UniqueViolation)
    assert _count(engine, "SELECT count(*) FROM job_step WHERE run_id = :r", r=run_id) == 2


def test_same_step_id_in_another_run_is_a_different_memo(engine: Engine) -> None:
    with engine.begin() as conn:
        _step(conn, _run(conn, "job.a"), "charge-card")
        _step(conn, _run(conn, "job.b"), "charge-card")
    assert _count(engine, "SELECT count(*) FROM job_step WHERE step_id = 'charge-card'") == 2


def test_duplicate_event_and_job_is_refused_by_the_database(engine: Engine) -> None:
    with engine.begin() as conn:
        event_id = _event(conn)
        _run(conn, "job.a", event_id=event_id)
        _run(conn, "job.b", event_id=event_id)  # the same event fans out to another job
    with pytest.raises(IntegrityError) as err, engine.begin() as conn:
        _run(conn, "job.a", event_id=event_id)
    assert isinstance(err.value.orig, psycopg.errors.UniqueViolation)
    assert "uq_job_queue_event_id_job_id" in str(err.value.orig)
    assert _count(engine, "SELECT count(*) FROM job_queue WHERE event_id = :e", e=event_id) == 2


def test_duplicate_job_and_scheduled_slot_is_refused_by_the_database(engine: Engine) -> None:
    with engine.begin() as conn:
        _run(conn, "job.cron", scheduled_for=SLOT)
        _run(conn, "job.cron", scheduled_for=SLOT.replace(hour=10))  # the next slot is another run
    with pytest.raises(IntegrityError) as err, engine.begin() as conn:
        _run(conn, "job.cron", scheduled_for=SLOT)
    assert isinstance(err.value.orig, psycopg.errors.UniqueViolation)
    assert "uq_job_queue_job_id_scheduled_for" in str(err.value.orig)
    assert _count(engine, "SELECT count(*) FROM job_queue WHERE job_id = 'job.cron'") == 2


def test_event_runs_of_one_job_all_insert_because_null_slots_are_distinct(engine: Engine) -> None:
    # (job_id, scheduled_for) must not dedup event runs: their slot is NULL.
    with engine.begin() as conn:
        for _ in range(3):
            _run(conn, "job.a", event_id=_event(conn), scheduled_for=None)
    assert _count(engine, "SELECT count(*) FROM job_queue WHERE job_id = 'job.a' AND scheduled_for IS NULL") == 3


def test_cron_runs_of_one_job_all_insert_because_null_events_are_distinct(engine: Engine) -> None:
    # (event_id, job_id) must not dedup cron runs: their event is NULL.
    with engine.begin() as conn:
        for hour in (9, 10, 11):
            _run(conn, "job.cron", event_id=None, scheduled_for=SLOT.replace(hour=hour))
    assert _count(engine, "SELECT count(*) FROM job_queue WHERE job_id = 'job.cron' AND event_id IS NULL") == 3


def test_same_slot_of_two_cron_jobs_is_two_runs(engine: Engine) -> None:
    with engine.begin() as conn:
        _run(conn, "job.cron-a", scheduled_for=SLOT)
        _run(conn, "job.cron-b", scheduled_for=SLOT)
    assert _count(engine, "SELECT count(*) FROM job_queue WHERE scheduled_for = :s", s=SLOT) == 2


def test_eight_threads_enqueueing_one_slot_at_once_make_exactly_one_run(database_url: str, engine: Engine) -> None:
    threads = 8
    racing = create_engine(database_url, pool_size=threads, max_overflow=0, pool_timeout=10)
    try:
        # Warm the pool: open every connection first, so the race is the INSERT, not the connect.
        warm = [racing.connect() for _ in range(threads)]
        pids = {c.execute(text("SELECT pg_backend_pid()")).scalar_one() for c in warm}
        for c in warm:
            c.close()
        assert len(pids) == threads

        barrier = threading.Barrier(threads, timeout=10)
        results: list[Queued | AlreadyQueued] = []
        used_pids: set[int] = set()
        errors: list[BaseException] = []
        lock = threading.Lock()

        def racer() -> None:
            try:
                with racing.connect() as conn:
                    pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
                    conn.commit()
                    barrier.wait()
                    with conn.begin():
                        outcome = enqueue_scheduled(conn, "job.cron", SLOT, max_attempts=3, policy="transient")
                with lock:
                    results.append(outcome)
                    used_pids.add(pid)
            except BaseException as exc:  # noqa: BLE001  (reported below, not swallowed)
                with lock:
                    errors.append(exc)

        workers = [threading.Thread(target=racer) for _ in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(30)
        assert not errors, errors
        assert used_pids == pids  # eight sessions really raced, on the warmed connections
    finally:
        racing.dispose()

    queued = [r for r in results if isinstance(r, Queued)]
    already = [r for r in results if isinstance(r, AlreadyQueued)]
    assert len(queued) == 1 and len(already) == threads - 1
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id FROM job_queue WHERE job_id = 'job.cron' AND scheduled_for = :s"),
                            {"s": SLOT}).scalars().all()
    assert rows == [queued[0].run_id]


def test_enqueue_scheduled_refuses_a_naive_slot(engine: Engine) -> None:
    with engine.begin() as conn, pytest.raises(ValueError, match="timezone-aware"):
        enqueue_scheduled(conn, "job.cron", SLOT.replace(tzinfo=None), max_attempts=3, policy="transient")


# --- the sweeper's indexes ---------------------------------------------------------

ROWS = 60_000


def _fill_queue_like_production(conn: Connection) -> None:
    """60k runs, as a table that keeps its history looks: ~95% finished, a small
    due backlog whose messages are old, some not yet due, running runs of which
    half have an expired lease. One INSERT ... SELECT, then ANALYZE."""
    conn.execute(text(
        """
        INSERT INTO job_queue (job_id, event_name, state, run_at, dispatched_at, lease_expires_at,
                               attempts, max_attempts, retry_policy, claim_token, finished_at)
        SELECT 'job.' || (i % 20), 'bench', s.state,
               CASE WHEN s.state = 'queued' AND (i / 40) % 4 = 3
                    THEN now() + interval '1 hour'                          -- backing off: not due
                    ELSE now() - make_interval(secs => i) END,              -- due, or long done
               now() - make_interval(secs => i + 600),                     -- its message is old
               CASE WHEN s.state = 'running' THEN now() + CASE WHEN (i / 40) % 2 = 0
                    THEN -make_interval(secs => i % 300 + 1)               -- expired: the worker died
                    ELSE interval '1 minute' END END,                      -- held
               1, 3, 'transient',
               CASE WHEN s.state = 'running' THEN gen_random_uuid() END,
               CASE WHEN s.state = 'succeeded' THEN now() - make_interval(secs => i) END
        FROM generate_series(1, :n) AS i,
             LATERAL (SELECT CASE i % 40 WHEN 0 THEN 'queued' WHEN 1 THEN 'running'
                                         ELSE 'succeeded' END AS state) AS s
        """
    ), {"n": ROWS})
    conn.execute(text("ANALYZE job_queue"))


def _plan_nodes(plan: object) -> Iterator[dict[str, object]]:
    if isinstance(plan, dict):
        if "Node Type" in plan:
            yield plan
        for value in plan.values():
            yield from _plan_nodes(value)
    elif isinstance(plan, list):
        for item in plan:
            yield from _plan_nodes(item)


def _index_scans(conn: Connection, statement: Statement, params: dict[str, object]) -> dict[str, str]:
    """EXPLAIN the statement's own text (bound as the engine binds it): {index name: node type}."""
    (found,) = plan(conn, statement, params)
    return {str(n["Index Name"]): str(n["Node Type"]) for n in _plan_nodes(found) if "Index Name" in n}


SWEEPER_QUERIES = {
    "republish-due": (REPUBLISH_DUE, {"after": 60.0, "batch": 500}, "ix_job_queue_stale"),
    "reclaim-expired": (RECLAIM_EXPIRED, {"batch": 500}, "ix_job_queue_leases"),
}


def test_sweeper_queries_use_their_partial_indexes_over_a_large_history(engine: Engine) -> None:
    with engine.connect() as conn, conn.begin() as tx:  # rolled back: the rows never leave this test
        _fill_queue_like_production(conn)
        assert conn.execute(text("SELECT count(*) FROM job_queue")).scalar_one() == ROWS
        # The planner knows the table is large (and, from the statistics, the backlog small).
        assert conn.execute(text("SELECT reltuples FROM pg_class WHERE relname = 'job_queue'")).scalar_one() >= ROWS * 0.9
        for query, (statement, params, index) in SWEEPER_QUERIES.items():
            scans = _index_scans(conn, statement, params)
            assert scans.get(index) in ("Index Scan", "Index Only Scan", "Bitmap Index Scan"), (query, scans)
        # Control: without its index each query reads the same data by a sequential scan,
        # so the plans above are the indexes earning their place, not the planner's only option.
        for query, (statement, params, index) in SWEEPER_QUERIES.items():
            conn.execute(text(f"DROP INDEX {index}"))
            assert index not in _index_scans(conn, statement, params), query
        tx.rollback()


#: A value for each parameter a statement that finds a run by its id takes (EXPLAIN only: never run).
BY_ID_PARAMS: dict[str, object] = {
    "job_id": "job.a", "worker": "w", "lease": 30.0, "limit": None, "async_commit": False, "step_id": "s",
    "output": "1", "elapsed": 0.0, "result": "1", "error": "{}", "delay": 1.0, "until": None, "secs": 1.0,
    "deferred": 0, "after": 60.0, "wait_event": None, "wait_path": None, "wait_value": None, "outcome": "suspended",
    "key": "k", "at": SLOT, "period": 60.0, "workspace_id": None, "traceparent": None, "detached": [],
    "cancel_keys": [], "concurrency": [], "datas": [], "delays": [], "etas": [], "ids": [], "job_ids": [], "keys": [],
    "max_attempts": [], "names": [], "policies": [], "priorities": [], "singletons": [], "steps": [],
    "terminate": True, "task_id": "t",  # adapter.REVOKE, operator.ROLLBACK_CANCEL (main's)
    # progress and streams (0019): worker.PROGRESS / STREAM_WRITE / STREAM_TRIM, reads.RUN_PROGRESS / STREAM_ITEMS
    "state": "PROGRESS", "meta": "{}", "stream": "s", "positions": [], "items": [], "sizes": [], "max_streams": 100,
    "last": 0, "offset": 0,
    "provider_key": None, "model_version": None,  # worker.SETTLE_SUCCEEDED's audit (0020: step.audit)
    "id": uuid.UUID(int=0),  # operator.REPLAY_LINK: a DLQ entry (its replay's run takes the failed run's subject)
}
#: job_queue's partial indexes whose predicate is a state alone: what a lookup by id must not read.
STATE_INDEXES = ("ix_job_queue_stale", "ix_job_queue_due", "ix_job_queue_leases")


def _quiet_statistics_then_a_backlog(conn: Connection) -> uuid.UUID:
    """ANALYZE sees 20,000 finished runs and nothing queued; then 2,000 runs are queued (the last's id)."""
    conn.execute(text(
        "INSERT INTO job_queue (job_id, event_name, state, attempts, max_attempts, retry_policy, finished_at) "
        "SELECT 'job.a', 'e', 'succeeded', 1, 3, 'transient', now() FROM generate_series(1, 20000)"))
    conn.execute(text("ANALYZE job_queue"))  # nothing queued, nothing running
    queued: uuid.UUID = conn.execute(text(
        "INSERT INTO job_queue (job_id, event_name, max_attempts, retry_policy) "
        "SELECT 'job.a', 'e', 3, 'transient' FROM generate_series(1, 2000) RETURNING id")).scalars().all()[-1]
    return queued


def test_a_run_found_by_its_id_is_read_through_the_primary_key_when_statistics_saw_no_backlog(
        engine: Engine) -> None:
    """Statistics taken while nothing was queued or running (the usual quiet moment), then a
    backlog: a lookup by id that checks ``state = 'queued'`` as it stands lets the planner read
    the run through a partial index on state, costed at ~0 rows, scanning the whole backlog."""
    # (throttle_state and run_flow count the throttled runs of the run's key too: the next test.)
    by_id = [e for e in catalogue()
             if re.search(r"\bid = (%\(run_id\)s|h\.run_id|c\.parent_run_id)", e.statement.sql)]
    assert {"claim", "store_step", "settle_succeeded", "settle_retry", "settle_failed", "renew_leases",
            "claim_wakes", "throttle_state", "run_flow"} <= {e.name for e in by_id}
    with engine.connect() as conn, conn.begin() as tx:  # rolled back: the rows never leave this test
        queued = _quiet_statistics_then_a_backlog(conn)
        running, token = conn.execute(text(
            "INSERT INTO job_queue (job_id, event_name, state, attempts, max_attempts, retry_policy, claim_token, "
            "lease_expires_at) SELECT 'job.a', 'e', 'running', 1, 3, 'transient', gen_random_uuid(), "
            "now() + interval '1 minute' FROM generate_series(1, 200) RETURNING id, claim_token")).all()[-1]
        # Control: the trap is set. The same lookup as the engine wrote it before reads a partial index.
        as_it_was = Statement("as_it_was", "A queued run by id, its state checked plainly.",
                              "SELECT id FROM job_queue WHERE id = %(run_id)s AND state = 'queued'")
        assert set(_index_scans(conn, as_it_was, {"run_id": queued})) & set(STATE_INDEXES)
        wrong = {}
        for entry in by_id:
            names = set(re.findall(r"%\((\w+)\)s", entry.statement.sql)) - {"run_id", "token", "run_ids", "tokens"}
            # the run in the state the statement looks for (a claim: a queued one)
            run_id = queued if re.search(r"\bstate = 'queued'", entry.statement.sql) else running
            params = {"run_id": run_id, "token": token, "run_ids": [run_id], "tokens": [token],
                      **{n: BY_ID_PARAMS[n] for n in names}}
            scans = _index_scans(conn, entry.statement, params)
            if "pk_job_queue" not in scans or set(scans) & {*STATE_INDEXES, "ix_job_queue_waiting"}:
                wrong[entry.name] = scans
        assert not wrong, f"read otherwise than by the primary key: {sorted(wrong)}; {wrong}"
        tx.rollback()


#: Flow control's lookups by key, each with the indexes it must read (migration 0015).
BY_KEY = {
    "throttle_state": (flow_sql.THROTTLE_STATE, {"ix_job_queue_throttle_queued"}),
    "run_flow": (reads_sql.RUN_FLOW, {"ix_job_queue_throttle_queued"}),
    "flow_waiting": (reads_sql.FLOW_WAITING, {"ix_job_queue_throttle_queued", "uq_job_queue_gathering_open"}),
}


def test_flow_controls_lookups_by_key_read_their_keys_index_when_statistics_saw_no_backlog(
        engine: Engine) -> None:
    """The count of a throttle key's runs waiting ahead (each throttled claim, and the run's page)
    and the flow listing, under the statistics above: each reads the key's own index, never one
    of a state alone (those scan the whole backlog)."""
    with engine.connect() as conn, conn.begin() as tx:  # rolled back: the rows never leave this test
        _quiet_statistics_then_a_backlog(conn)
        waiting = conn.execute(text(
            "INSERT INTO job_queue (job_id, event_name, max_attempts, retry_policy, flow_wait, throttle_key) "
            "SELECT 'job.t', 'e', 3, 'transient', 'throttle', 'k' FROM generate_series(1, 20) RETURNING id"
        )).scalars().all()[-1]
        # Control: the trap is set. The count as 0012 wrote it reads a partial index of a state alone.
        as_it_was = Statement("as_it_was", "A throttle key's waiting runs, their state checked plainly.",
                              "SELECT count(*) FROM job_queue WHERE job_id = 'job.t' AND throttle_key = 'k' "
                              "AND flow_wait = 'throttle' AND state = 'queued'")
        assert set(_index_scans(conn, as_it_was, {})) & set(STATE_INDEXES)
        params = {"run_id": waiting, "job_id": "job.t", "key": "k", "workspace_id": None, "limit": 5,
                  "period": 60.0}
        wrong = {}
        for name, (statement, indexes) in BY_KEY.items():
            scans = _index_scans(conn, statement, params)
            if not indexes <= set(scans) or set(scans) & set(STATE_INDEXES):
                wrong[name] = scans
        assert not wrong, f"read otherwise than by the key's index: {wrong}"
        tx.rollback()


def _a_jobs_history_then_active_runs(conn: Connection, job: str, column: str, active: int) -> None:
    """ANALYZE sees 20,000 finished runs of ``job``, each with a key in ``column`` ('' or 'order-<n>'),
    and nothing active; then ``active`` runs of it are queued with keys of their own, of priorities 0-2."""
    key = "''" if column == "concurrency_key" else "'order-' || g"
    conn.execute(text(
        f"INSERT INTO job_queue (job_id, event_name, state, attempts, max_attempts, retry_policy, finished_at, {column}) "
        f"SELECT :job, 'e', 'succeeded', 1, 3, 'transient', now(), {key} FROM generate_series(1, 20000) g"),
        {"job": job})
    conn.execute(text("ANALYZE job_queue"))
    key = "''" if column == "concurrency_key" else "'order-q' || g"
    conn.execute(text(
        f"INSERT INTO job_queue (job_id, event_name, max_attempts, retry_policy, priority, {column}) "
        f"SELECT :job, 'e', 3, 'transient', g % 3, {key} FROM generate_series(1, :n) g"), {"job": job, "n": active})


def _behind_both_statistics(conn: Connection) -> Iterator[str]:
    """Plan behind the statistics as they stand (the job's history only), then behind analyzed ones."""
    yield "statistics of the job's history, nothing active"
    conn.execute(text("ANALYZE job_queue"))
    yield "analyzed statistics"


def test_the_next_run_of_a_concurrency_key_is_the_first_of_its_index_not_a_sort_of_the_backlog(
        engine: Engine) -> None:
    """When a run of a ``concurrency=`` job frees its slot, the key's next run (highest priority,
    oldest) is read from ix_job_queue_concurrency_queued in that order: no sort of every due run,
    whether the statistics saw the backlog or only the job's history (migration 0016)."""
    with engine.connect() as conn, conn.begin() as tx:  # rolled back: the rows never leave this test
        _a_jobs_history_then_active_runs(conn, "job.c", "concurrency_key", 2000)
        for statistics in _behind_both_statistics(conn):
            (found,) = plan(conn, NEXT_IN_LINE, {"job_id": "job.c", "key": "", "workspace_id": None})
            nodes = list(_plan_nodes(found))
            read = {str(n["Index Name"]) for n in nodes if "Index Name" in n}
            sorted_ = [n for n in nodes if n["Node Type"] == "Sort"]
            assert "ix_job_queue_concurrency_queued" in read and not sorted_, (statistics, read, sorted_)
        tx.rollback()


def test_a_cancel_on_event_reads_the_active_runs_of_its_key_not_the_jobs_history(engine: Engine) -> None:
    """An event a ``cancel_on`` rule listens to finds the job's active runs carrying its key through
    ix_job_queue_cancel_active, behind statistics of the job's history alone and behind analyzed
    ones: never the job's finished runs (migration 0017)."""
    with engine.connect() as conn, conn.begin() as tx:  # rolled back: the rows never leave this test
        _a_jobs_history_then_active_runs(conn, "job.k", "cancel_key", 200)
        params = {"job_id": "job.k", "key": "order-q7", "within": None, "workspace_id": None}
        for statistics in _behind_both_statistics(conn):
            scans = _index_scans(conn, CANCEL_BY_KEY, params)
            assert "ix_job_queue_cancel_active" in scans, (statistics, scans)
        tx.rollback()


def test_the_functions_find_waiters_and_parents_without_reading_the_backlog(engine: Engine) -> None:
    """The statements inside the schema's functions (migrations 0014, 0015), under the statistics
    above: an event's wake-up of its waiters, a child's settle waking its parent and the
    gather of a debounce run, each plan read from auto_explain as the function runs it."""
    with engine.connect() as conn, conn.begin() as tx:  # rolled back: the rows never leave this test
        plans: list[str] = []
        conn.connection.driver_connection.add_notice_handler(  # type: ignore[union-attr]
            lambda d: plans.append(d.message_primary or ""))
        conn.execute(text("LOAD 'auto_explain'"))
        for setting in ("auto_explain.log_min_duration = 0", "auto_explain.log_nested_statements = on",
                        "client_min_messages = log"):
            conn.execute(text(f"SET LOCAL {setting}"))
        _quiet_statistics_then_a_backlog(conn)
        # Control: what auto_explain shows is the plan, and the trap is set.
        conn.execute(text("SELECT count(*) FROM job_queue WHERE wait_event = 'x' AND state = 'queued'"))
        assert any("ix_job_queue_stale" in p or "ix_job_queue_due" in p for p in plans), plans
        plans.clear()
        waiter = conn.execute(text(
            "INSERT INTO job_queue (job_id, event_name, max_attempts, retry_policy, wait_event, wait_path, wait_value) "
            "VALUES ('job.w', 'e', 3, 'transient', 'order.paid', '{id}', '7') RETURNING id")).scalar_one()
        woken = conn.execute(text(
            "SELECT run_id FROM motir_record_event('order.paid', '{\"id\": \"7\"}', NULL, NULL, NULL, "
            "'{}', '{}', '{}', '{}', '{}', '{}', '{}') WHERE woken")).scalars().all()
        assert woken == [waiter]
        woken = conn.execute(text(
            "SELECT run_id FROM motir_record_events('{order.paid}', ARRAY['{\"id\": \"7\"}'::jsonb], '{NULL}', "
            "'{NULL}', NULL, '{}', '{}', '{}', '{}', '{}', '{}', '{}', '{}') WHERE woken")).scalars().all()
        assert woken == [waiter]
        parent = conn.execute(text(
            "INSERT INTO job_queue (job_id, event_name, max_attempts, retry_policy, wait_event) "
            "VALUES ('job.p', 'e', 3, 'transient', 'motir.children') RETURNING id")).scalar_one()
        child = conn.execute(text(
            "INSERT INTO job_queue (job_id, event_name, max_attempts, retry_policy, parent_run_id, parent_step_id) "
            "VALUES ('job.c', 'e', 3, 'transient', :p, 's') RETURNING id"), {"p": parent}).scalar_one()
        conn.execute(text("UPDATE job_queue SET state = 'succeeded', finished_at = now() WHERE id = :c"), {"c": child})
        assert conn.execute(text("SELECT dispatched_at = '-infinity' FROM job_queue WHERE id = :p"),
                            {"p": parent}).scalar_one()  # woken
        event = conn.execute(text("INSERT INTO job_event (name, data) VALUES ('e', '{}') RETURNING id")).scalar_one()
        gathered = conn.execute(text(
            "INSERT INTO job_queue (job_id, event_id, event_name, max_attempts, retry_policy) "
            "VALUES ('job.g', :e, 'e', 3, 'transient') RETURNING id"), {"e": event}).scalar_one()
        conn.execute(text("SELECT * FROM motir_write_gather(ARRAY[CAST(:r AS uuid)], '{debounce}', '{k}', '{1}', "
                          "'{NULL}')"), {"r": gathered})
        assert conn.execute(text("SELECT flow_wait FROM job_queue WHERE id = :r"), {"r": gathered}).scalar_one()
        # Each lookup, by the text of its statement: the waiters (two writers), the parent, the gathered
        # run, and the gather's key's open run (migration 0015).
        for lookup, count, index in (("q.wait_event =", 2, "ix_job_queue_waiting on job_queue q"),
                                     ("p.id = NEW.parent_run_id", 1, "pk_job_queue on job_queue p"),
                                     ("q.id = g.run_id", 1, "pk_job_queue on job_queue q"),
                                     ("q.flow_key = g.key", 1, "uq_job_queue_gathering_open on job_queue q")):
            found = [p for p in plans if lookup in p]
            assert len(found) == count, (lookup, plans)
            assert all(index in p for p in found), (index, found)
            assert not [p for p in found if "ix_job_queue_stale" in p or "ix_job_queue_due" in p], found
        tx.rollback()


def test_every_foreign_key_has_an_index_that_leads_with_its_column(engine: Engine) -> None:
    # Deleting a run (motir purge) makes Postgres find each row that references it: a link
    # without an index reads its whole table per deleted run (0007 added the DLQ's two).
    with engine.connect() as conn:
        unindexed = conn.execute(text(
            "SELECT c.conrelid::regclass::text || '.' || a.attname FROM pg_constraint c"
            " JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = c.conkey[1]"
            " WHERE c.contype = 'f' AND c.connamespace = current_schema()::regnamespace"
            " AND NOT EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.conrelid"
            "                 AND i.indkey[0] = c.conkey[1])")).scalars().all()
    assert unindexed == []


# --- admission (migration 0021): the dispatcher's choice and the gate --------------------------


def _held_backlog(conn: Connection, workspaces: int, per_workspace: int, *, tag: str) -> None:
    """``per_workspace`` held runs (queued, no message: dispatched_at 'infinity') in each of
    ``workspaces`` workspaces, priorities 0-2, plus two in flight each; then ANALYZE."""
    conn.execute(text(
        "INSERT INTO job_queue (job_id, event_name, workspace_id, max_attempts, retry_policy, priority, dispatched_at) "
        "SELECT 'job.a', 'e', 'ws-' || (g % :w), 3, 'transient', g % 3, 'infinity' "
        "FROM generate_series(1, :n) g"), {"w": workspaces, "n": workspaces * per_workspace})
    if tag == "first":
        conn.execute(text(
            "INSERT INTO job_queue (job_id, event_name, workspace_id, max_attempts, retry_policy, state, attempts, "
            "claim_token, lease_expires_at) SELECT 'job.a', 'e', 'ws-' || (g % :w), 3, 'transient', 'running', 1, "
            "gen_random_uuid(), now() + interval '1 minute' FROM generate_series(1, 2 * :w) g"), {"w": workspaces})
        conn.execute(text("INSERT INTO job_quota (workspace_id, weight, max_running) "
                          "SELECT 'ws-' || g, 1 + g % 3, 5 FROM generate_series(0, :w - 1) g"), {"w": workspaces})
    conn.execute(text("ANALYZE job_queue"))


def _buffers(found: Any) -> int:
    top = found["Plan"]
    return int(top.get("Shared Hit Blocks", 0)) + int(top.get("Shared Read Blocks", 0))


def test_the_dispatchers_choice_reads_its_indexes_and_does_not_grow_with_the_backlog(engine: Engine) -> None:
    """100 workspaces with held runs: the choice walks the workspaces along ix_job_queue_held (one
    probe each), counts each one's runs in flight along ix_job_queue_in_flight, never scans or sorts
    the backlog — and the pages it reads stay the same from 10,000 held runs to 100,000."""
    from motir_celery.store.sql.admission import CHOOSE_NEXT
    with engine.connect() as conn, conn.begin() as tx:  # rolled back: the rows never leave this test
        _held_backlog(conn, 100, 100, tag="first")
        params = {"limit": 1000, "run_ids": []}
        (shallow,) = plan(conn, CHOOSE_NEXT, params)
        nodes = list(_plan_nodes(shallow))
        read = {str(n["Index Name"]) for n in nodes if "Index Name" in n}
        assert {"ix_job_queue_held", "ix_job_queue_in_flight"} <= read, read
        assert not [n for n in nodes if n["Node Type"] == "Seq Scan" and n.get("Relation Name") == "job_queue"]
        cost: dict[str, int] = {}
        for depth, more in (("10k", 0), ("100k", 900)):
            if more:
                _held_backlog(conn, 100, more, tag="more")
            conn.execute(text("SAVEPOINT choice"))
            (found,) = plan(conn, CHOOSE_NEXT, params, analyze=True)   # it writes: undone below
            conn.execute(text("ROLLBACK TO SAVEPOINT choice"))
            cost[depth] = _buffers(found)
        print("choose_next buffers", cost, "ms", found.get("Execution Time"))
        assert cost["100k"] <= 1.2 * cost["10k"], cost
        tx.rollback()


def test_the_gate_reads_the_runs_by_id_and_the_fleet_through_its_ranges(engine: Engine) -> None:
    """The gate before a publish: its runs by primary key, the fleet's running and sent runs
    through ix_job_queue_leases and _stale (ranges that stop at the limit), the held check through
    ix_job_queue_held — never a scan of the held backlog."""
    from motir_celery.store.sql.admission import ADMIT
    with engine.connect() as conn, conn.begin() as tx:  # rolled back: the rows never leave this test
        _held_backlog(conn, 100, 100, tag="first")
        fresh = conn.execute(text("INSERT INTO job_queue (job_id, event_name, workspace_id, max_attempts, "
                                  "retry_policy) VALUES ('job.a', 'e', 'ws-7', 3, 'transient') RETURNING id"))
        params = {"limit": 1000, "run_ids": [fresh.scalar_one()]}
        (found,) = plan(conn, ADMIT, params)
        nodes = list(_plan_nodes(found))
        read = {str(n["Index Name"]) for n in nodes if "Index Name" in n}
        assert {"pk_job_queue", "ix_job_queue_held", "ix_job_queue_in_flight"} <= read, read
        assert not [n for n in nodes if n["Node Type"] == "Seq Scan" and n.get("Relation Name") == "job_queue"]
        tx.rollback()


# --- listings that stay fast (issue 47; migration 0020) ----------------------------------------

#: Workspaces the listing rows are spread over.
TENANTS = 50


def _fill_tenants_history(conn: Connection, tenants: int = TENANTS) -> None:
    """ROWS runs over ``tenants`` workspaces, 90 % finished, one created a second apart; analyzed."""
    conn.execute(text(
        """
        INSERT INTO job_queue (job_id, event_name, workspace_id, state, max_attempts, retry_policy, created_at,
                               finished_at)
        SELECT 'job.' || (i % 20), 'bench', 'ws-' || (i % :tenants), s.state, 3, 'transient',
               now() - make_interval(secs => :n - i),
               CASE WHEN s.state = 'succeeded' THEN now() - make_interval(secs => :n - i) END
        FROM generate_series(1, :n) AS i,
             LATERAL (SELECT CASE WHEN i % 10 = 0 THEN 'queued' ELSE 'succeeded' END AS state) AS s
        """
    ), {"n": ROWS, "tenants": tenants})
    conn.execute(text("ANALYZE job_queue"))


def _listing_plan(conn: Connection, **filters: object) -> tuple[set[str], list[str]]:
    """LIST_RUNS's plan for these filters (limit 50): the indexes it reads, and its Sort nodes."""
    params = {"job": None, "state": None, "workspace": None, "since": None, "limit": 50, **filters}
    (found,) = plan(conn, reads_sql.LIST_RUNS, params)
    nodes = list(_plan_nodes(found))
    return ({str(n["Index Name"]) for n in nodes if "Index Name" in n},
            [str(n["Node Type"]) for n in nodes if n["Node Type"] in ("Sort", "Incremental Sort")])


LISTINGS = {  # (who lists, the filters, the index that serves it in the listing's order)
    "the operator's newest runs": ({}, "ix_job_queue_recent"),
    "the operator's runs of one workspace": ({"workspace": "ws-7"}, "ix_job_queue_workspace_recent"),
}


@pytest.mark.parametrize("listing", list(LISTINGS))
def test_a_listing_reads_the_newest_runs_from_an_index_in_its_order_not_a_sort_of_the_table(
        listing: str, engine: Engine) -> None:
    filters, index = LISTINGS[listing]
    with engine.connect() as conn, conn.begin() as tx:  # rolled back: the rows never leave this test
        _fill_tenants_history(conn)
        read, sorts = _listing_plan(conn, **filters)
        assert index in read and not sorts, (read, sorts)
        # Control: without the listing indexes, the same listing sorts the table (or the workspace's rows).
        conn.execute(text("DROP INDEX ix_job_queue_recent; DROP INDEX ix_job_queue_workspace_recent"))
        read, sorts = _listing_plan(conn, **filters)
        assert index not in read and sorts, (read, sorts)
        tx.rollback()


def test_one_tenants_listing_under_row_level_security_reads_its_workspaces_index(engine: Engine) -> None:
    """The app role's listing, as the dashboard sends it for a tenant: its policy, and its workspace named
    (the policy alone, an OR with the admin arm, is no index condition: the planner then walks every
    workspace's newest runs for this one's)."""
    with engine.connect() as conn, conn.begin() as tx:  # rolled back: the rows never leave this test
        _fill_tenants_history(conn, tenants=5)   # 12,000 runs a workspace: more than a page to sort
        conn.execute(text("SET LOCAL ROLE motir_app"))
        conn.execute(text("SELECT set_config('motir.workspace_id', 'ws-3', true)"))
        read, sorts = _listing_plan(conn, workspace="ws-3")
        assert "ix_job_queue_workspace_recent" in read and not sorts, (read, sorts)
        read, _ = _listing_plan(conn)
        assert "ix_job_queue_workspace_recent" not in read, read   # control: the policy alone does not
        listed = conn.execute(text("SELECT count(*), count(DISTINCT workspace_id) FROM ("
                                   + reads_sql.LIST_RUNS.sql.replace("%(", ":").replace(")s", "") + ") AS l"),
                              {"job": None, "state": None, "workspace": "ws-3", "since": None, "limit": 50}).one()
        assert tuple(listed) == (50, 1)
        tx.rollback()


# --- subjects (issue 47, seed 003) ---------------------------------------------------------------

def _fill_subject_history(conn: Connection) -> None:
    """ROWS runs over 50 workspaces, each about one of 2,000 media items, 90 % finished; analyzed."""
    conn.execute(text(
        """
        INSERT INTO job_queue (job_id, event_name, workspace_id, state, max_attempts, retry_policy, created_at,
                               finished_at, subject_type, subject_id)
        SELECT 'job.' || (i % 20), 'bench', 'ws-' || (i % 50), s.state, 3, 'transient',
               now() - make_interval(secs => :n - i),
               CASE WHEN s.state = 'succeeded' THEN now() - make_interval(secs => :n - i) END,
               'media_item', (i % 2000)::text
        FROM generate_series(1, :n) AS i,
             LATERAL (SELECT CASE WHEN i % 10 = 0 THEN 'queued' ELSE 'succeeded' END AS state) AS s
        """
    ), {"n": ROWS})
    conn.execute(text("ANALYZE job_queue"))


def _generic_plan(conn: Connection, statement: Statement, params: dict[str, object]) -> str:
    """The plan Postgres keeps for ``statement`` prepared (its generic plan: parameters unknown), as text."""
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", statement.sql)))
    sql = re.sub(r"%\((\w+)\)s", lambda m: f"${names.index(m.group(1)) + 1}", statement.sql)
    conn.exec_driver_sql(f"PREPARE subject_q AS {sql}")
    conn.exec_driver_sql("SET LOCAL plan_cache_mode = force_generic_plan")
    values = ", ".join("'" + str(params[n]).replace("'", "''") + "'" for n in names)
    found = "\n".join(r[0] for r in conn.exec_driver_sql(f"EXPLAIN EXECUTE subject_q({values})"))
    conn.exec_driver_sql("DEALLOCATE subject_q")
    conn.exec_driver_sql("RESET plan_cache_mode")
    return found


#: (statement, its parameters): "cancel every open run of this subject", "is one active for it".
SUBJECT_QUERIES: dict[str, tuple[Statement, dict[str, object]]] = {
    "cancel_subject": (operator_sql.CANCEL_SUBJECT, {"workspace": "ws-10", "subject_type": "media_item",
                                                     "subject_id": "1010", "actor": "ops", "reason": "r"}),
    "active_for_subject": (reads_sql.ACTIVE_FOR_SUBJECT, {"workspace_id": "ws-10", "subject_type": "media_item",
                                                          "subject_id": "1010", "limit": 10}),
}


@pytest.mark.parametrize("query", list(SUBJECT_QUERIES))
def test_a_subjects_open_runs_are_read_from_the_partial_index_of_open_subjects(query: str, engine: Engine) -> None:
    statement, params = SUBJECT_QUERIES[query]
    with engine.connect() as conn, conn.begin() as tx:  # rolled back: the rows never leave this test
        _fill_subject_history(conn)
        # The index holds only the open runs that name a subject (a tenth of the history here).
        size = conn.execute(text("SELECT count(*) FROM job_queue WHERE subject_type IS NOT NULL "
                                 "AND state IN ('queued', 'running')")).scalar_one()
        assert size == ROWS // 10
        if query == "active_for_subject":   # the tenant's read: the app role under its policy
            conn.execute(text("SET LOCAL ROLE motir_app"))
            conn.execute(text("SELECT set_config('motir.workspace_id', 'ws-10', true)"))
        scans = _index_scans(conn, statement, params)
        assert scans.get("ix_job_queue_subject_open") in ("Index Scan", "Index Only Scan", "Bitmap Index Scan"), scans
        # A prepared statement's generic plan (after five calls) uses it too: subject_type = $1 implies the
        # index's subject_type IS NOT NULL whatever $1 is, and the states are written as the index has them.
        generic = _generic_plan(conn, statement, params)
        assert "ix_job_queue_subject_open" in generic and "$1" in generic, generic
        # Control: without it, the same statement reads the table some other way.
        conn.execute(text("RESET ROLE"))
        conn.execute(text("DROP INDEX ix_job_queue_subject_open"))
        if query == "active_for_subject":
            conn.execute(text("SET LOCAL ROLE motir_app"))
        assert "ix_job_queue_subject_open" not in _index_scans(conn, statement, params)
        tx.rollback()
