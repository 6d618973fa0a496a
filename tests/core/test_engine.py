"""The engine core against a real Postgres, executed in-process.

What a Celery worker adds (delivery, acks, kills) is in test_worker_e2e.py;
here the runner is called directly so each database property is asserted
precisely: fences, settles, the DLQ transaction, replay, cancellation.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

import tests.fixtures.jobs  # noqa: F401  (registers the test jobs)
from motir_celery import CancelOn
from motir_celery.core.engine import Engine, Tuning
from motir_celery.core.jobs import define_job
from motir_celery.core.operator import dlq
from motir_celery.core.producer import events
from motir_celery.core.worker import runner
from motir_celery.core.worker.claim import claim as engine_claim
from motir_celery.errors import JobDefinitionError, PayloadError, RetryAfterError, StepOutputError
from motir_celery.settings import Settings
from motir_celery.store import records
from motir_celery.store.pg import ConnectionLost
from motir_celery.store.sql import maintenance as maintenance_sql
from motir_celery.store.sql import worker as worker_sql
from motir_celery.testing import Held
from tests.conftest import count_effects, run_state
from tests.fixtures.engines import holding, send


def execute(run_id: Any, job_id: str, published: Held | None = None, worker: str = "test/1") -> runner.Outcome:
    return holding(published).execute(run_id, job_id=job_id, worker=worker)


def one(engine, sql: str, **params: Any) -> Any:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return conn.execute(text(sql), params).one()


def claim(engine, run_id: uuid.UUID, job_id: str, worker: str = "w") -> records.Claim | None:  # type: ignore[no-untyped-def]
    with engine.begin() as conn:
        return worker_sql.claim(conn, run_id, job_id=job_id, worker=worker, lease_seconds=30, async_commit=True)


def expire_lease(engine, run_id: uuid.UUID) -> None:  # type: ignore[no-untyped-def]
    with engine.begin() as conn:
        conn.execute(text("UPDATE job_queue SET lease_expires_at = now() - interval '1 second' WHERE id = :id"),
                     {"id": run_id})


# --- send_event and fan-out ---------------------------------------------------------


def test_event_with_two_subscribers_makes_two_runs_and_redispatch_makes_none(engine):  # type: ignore[no-untyped-def]
    published = Held()
    result = holding(published).send_event("test.mixed", {"switch": "x"})
    assert sorted(r.job_id for r in result.runs) == ["test.mixed-fail", "test.mixed-ok"]
    assert len(result.run_ids) == 2 and len(published) == 2
    again = events.dispatch_event(holding(published), result.event_id)
    assert all(isinstance(r, records.AlreadyQueued) for r in again)
    assert len(published) == 2
    assert one(engine, "SELECT count(*) FROM job_queue")[0] == 2


def _late(event: Any, step: Any) -> None:
    return None


def test_jobs_defined_after_the_first_send_subscribe_to_and_cancel_on_the_next_one(engine):  # type: ignore[no-untyped-def]
    tag = uuid.uuid4().hex[:8]
    event, stop = f"test.late-{tag}", f"test.late-stop-{tag}"
    early, late = f"test.late-b-{tag}", f"test.late-a-{tag}"
    define_job(early, event=event, retry_policy="none")(_late)
    first = holding().send_event(event, {"k": "x"})
    assert [r.job_id for r in first.runs] == [early] and first.cancelled == []
    define_job(late, event=event, retry_policy="none", cancel_on=[CancelOn(event=stop, match="data.k")])(_late)
    define_job(early, event=event, retry_policy="none")(_late)  # its module imported again: still one subscriber
    second = holding().send_event(event, {"k": "x"})
    assert [r.job_id for r in second.runs] == [late, early]  # by job id
    stopped = holding().send_event(stop, {"k": "x"})
    assert stopped.runs == [] and stopped.cancelled == [r.run_id for r in second.runs if r.job_id == late]
    define_job(late, event=stop, retry_policy="none")(_late)  # defined again: another event, no cancel_on rule
    assert [r.job_id for r in holding().send_event(event, {"k": "y"}).runs] == [early]
    moved = holding().send_event(stop, {"k": "y"})
    assert [r.job_id for r in moved.runs] == [late] and moved.cancelled == []


def test_workspace_comes_from_the_payload_when_not_given(engine):  # type: ignore[no-untyped-def]
    result = send("test.three", {"workspace_id": "acme"})
    assert one(engine, "SELECT workspace_id FROM job_queue WHERE id = :id", id=result.run_ids[0])[0] == "acme"
    assert one(engine, "SELECT workspace_id FROM job_event WHERE id = :id", id=result.event_id)[0] == "acme"


def test_reused_idempotency_key_writes_nothing_and_says_so(engine):  # type: ignore[no-untyped-def]
    first = send("test.three", {}, idempotency_key="k1")
    second = send("test.three", {"other": 1}, idempotency_key="k1")
    assert not first.deduplicated and second.deduplicated
    assert second.event_id == first.event_id and second.runs == []
    assert one(engine, "SELECT count(*) FROM job_event")[0] == 1
    assert one(engine, "SELECT count(*) FROM job_queue")[0] == 1


@pytest.mark.parametrize("data", [{1, 2}, {"when": object()}, float("nan"), {"s": "nul\x00byte"}])
def test_non_json_payload_is_refused_before_anything_is_written(engine, data):  # type: ignore[no-untyped-def]
    with pytest.raises(PayloadError, match="test.three"):
        send("test.three", data)
    assert one(engine, "SELECT count(*) FROM job_event")[0] == 0


def test_payload_over_the_size_limit_is_refused(engine, monkeypatch):  # type: ignore[no-untyped-def]

    small = Settings.from_env({**__import__("os").environ, "MOTIR_MAX_PAYLOAD_BYTES": "100"})
    with pytest.raises(PayloadError, match="over the 100-byte limit"):
        holding(settings=small).send_event("test.three", {"blob": "x" * 200})


@pytest.fixture
def refusing(monkeypatch) -> dict[str, bool]:  # type: ignore[no-untyped-def]
    """While ``refusing["on"]``, every run send_event writes breaks ck_job_queue_attempts."""
    from dataclasses import replace

    from motir_celery.core.jobs import Job

    state = {"on": False}
    real = Job.spec

    def spec(self: Job, *args: Any, **kwargs: Any) -> Any:
        made = real(self, *args, **kwargs)
        return replace(made, max_attempts=0) if state["on"] else made

    monkeypatch.setattr(Job, "spec", spec)
    return state


def test_a_send_the_database_refuses_writes_nothing_and_leaves_the_pool_usable(engine, refusing):  # type: ignore[no-untyped-def]
    """send_event's one round trip (BEGIN, event, runs, wake-up, COMMIT pipelined):
    a statement that fails takes the whole transaction with it, and the pooled
    connection comes back clean for the next send."""
    published = Held()
    refusing["on"] = True
    with pytest.raises(psycopg.errors.CheckViolation, match="ck_job_queue_attempts"):
        holding(published).send_event("test.three", {"n": "refused"})
    refusing["on"] = False
    assert published == []
    assert one(engine, "SELECT count(*) FROM job_event WHERE data->>'n' = 'refused'")[0] == 0
    aborted = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state LIKE '%aborted%'"
    assert one(engine, aborted)[0] == 0  # no pooled connection left inside the failed transaction
    assert len(holding(published).send_event("test.three", {"n": "next"}).run_ids) == 1
    assert len(published) == 1


def test_a_send_refused_inside_a_savepoint_leaves_the_callers_transaction_usable(engine, refusing):  # type: ignore[no-untyped-def]
    """With session=, the pipelined statements run in the caller's transaction: a refusal
    is the caller's to roll back (here to its savepoint), never ours to end."""
    published = Held()
    with Session(engine) as session:
        with session.begin():
            holding(published).send_event("test.three", {"n": "kept"}, session=session)
            refusing["on"] = True
            with pytest.raises(DBAPIError, match="ck_job_queue_attempts"), session.begin_nested():
                holding(published).send_event("test.three", {"n": "refused"}, session=session)
            refusing["on"] = False
    assert one(engine, "SELECT count(*) FROM job_event WHERE data->>'n' = 'kept'")[0] == 1
    assert one(engine, "SELECT count(*) FROM job_event WHERE data->>'n' = 'refused'")[0] == 0
    assert len(published) == 1


def test_send_event_in_a_rolled_back_session_writes_and_publishes_nothing(engine):  # type: ignore[no-untyped-def]
    published = Held()
    with Session(engine) as session:
        with session.begin():
            holding(published).send_event("test.three", {"n": 1}, session=session)
            assert published == []  # nothing before the commit
            session.rollback()
    assert published == []
    assert one(engine, "SELECT count(*) FROM job_event")[0] == 0
    assert one(engine, "SELECT count(*) FROM job_queue")[0] == 0


def test_send_event_in_a_session_publishes_only_after_commit(engine):  # type: ignore[no-untyped-def]
    seen_at_publish: list[str | None] = []

    class Looking(Held):
        def publish(self, run_id: uuid.UUID, job_id: str, countdown: float = 0.0) -> None:
            # Another connection must already see the row: the commit happened first.
            seen_at_publish.append(run_state(engine, run_id))

    with Session(engine) as session:
        with session.begin():
            result = holding(Looking()).send_event("test.three", {"n": 1}, session=session)
            session.execute(text("SELECT 1"))
            assert seen_at_publish == []
    assert seen_at_publish == ["queued"]
    assert run_state(engine, result.run_ids[0]) == "queued"


# --- claim and steps --------------------------------------------------------------


def test_a_run_not_yet_due_is_not_claimed(engine):  # type: ignore[no-untyped-def]
    (run_id,) = send("test.three", {}).run_ids
    with engine.begin() as conn:
        conn.execute(text("UPDATE job_queue SET run_at = now() + interval '1 hour' WHERE id = :id"), {"id": run_id})
    assert execute(run_id, "test.three-steps").state == "skipped"
    assert run_state(engine, run_id) == "queued"
    assert one(engine, "SELECT attempts FROM job_queue WHERE id = :id", id=run_id)[0] == 0


def test_a_message_naming_another_job_or_a_forged_id_claims_nothing(engine):  # type: ignore[no-untyped-def]
    (run_id,) = send("test.three", {}).run_ids
    assert execute(run_id, "test.slow").state == "skipped"
    assert execute(uuid.uuid4(), "test.three-steps").state == "skipped"
    assert execute("not-a-uuid'; DROP TABLE job_queue;--", "test.three-steps").state == "skipped"
    assert run_state(engine, run_id) == "queued"


def test_repeated_step_ids_get_a_counter_and_the_separator_is_reserved(engine):  # type: ignore[no-untyped-def]
    calls: list[int] = []

    @define_job("test.repeats", event="test.repeats")
    def repeats(event: Any, step: Any) -> Any:
        values = [step.run("charge", lambda i=i: calls.append(i) or i) for i in range(3)]
        with pytest.raises(ValueError, match="reserved"):
            step.run("charge:1", lambda: 99)
        return values

    (run_id,) = send("test.repeats", {}).run_ids
    assert execute(run_id, "test.repeats").state == "succeeded"
    with engine.connect() as conn:
        ids = conn.execute(text("SELECT step_id FROM job_step WHERE run_id = :r ORDER BY step_id"),
                           {"r": run_id}).scalars().all()
    assert ids == ["charge", "charge:1", "charge:2"]
    assert calls == [0, 1, 2]


def test_non_json_step_result_fails_the_run_with_the_step_and_type_named(engine):  # type: ignore[no-untyped-def]
    @define_job("test.bad-output", event="test.bad-output")
    def bad_output(event: Any, step: Any) -> Any:
        return step.run("make-set", lambda: {1, 2})

    (run_id,) = send("test.bad-output", {}).run_ids
    assert execute(run_id, "test.bad-output").state == "failed"  # deterministic: no retry
    failure = one(engine, "SELECT failure FROM job_run_dlq WHERE run_id = :r", r=run_id)[0]
    assert failure["type"].endswith("StepOutputError")
    assert "'make-set'" in failure["message"] and "set" in failure["message"]
    assert isinstance(StepOutputError("x"), TypeError)


def test_a_step_that_returns_none_is_stored_as_json_null_and_replayed(engine):  # type: ignore[no-untyped-def]
    calls: list[str] = []

    @define_job("test.none", event="test.none")
    def returns_none(event: Any, step: Any) -> Any:
        first = step.run("first", lambda: calls.append("first"))
        step.run("second", lambda: calls.append("second"))
        if event.attempt == 1:
            raise RuntimeError("retried: the stored nulls are replayed")
        return first

    (run_id,) = send("test.none", {}).run_ids
    assert execute(run_id, "test.none").state == "retrying"
    with engine.begin() as conn:
        conn.execute(text("UPDATE job_queue SET run_at = now() WHERE id = :r"), {"r": run_id})
        stored = conn.execute(text("SELECT step_id, output = 'null'::jsonb FROM job_step WHERE run_id = :r"),
                              {"r": run_id}).all()
    assert sorted(stored) == [("first", True), ("second", True)]
    assert execute(run_id, "test.none").state == "succeeded"
    assert calls == ["first", "second"]


def test_a_step_output_with_a_nul_character_fails_the_run_naming_the_step(engine):  # type: ignore[no-untyped-def]
    @define_job("test.nul-output", event="test.nul-output")
    def nul_output(event: Any, step: Any) -> Any:
        return step.run("nul", lambda: "a\x00b")

    (run_id,) = send("test.nul-output", {}).run_ids
    assert execute(run_id, "test.nul-output").state == "failed"
    failure = one(engine, "SELECT failure FROM job_run_dlq WHERE run_id = :r", r=run_id)[0]
    assert failure["type"].endswith("StepOutputError") and "'nul'" in failure["message"]


def test_a_zombie_whose_lease_was_reclaimed_can_neither_write_a_step_nor_settle(engine):  # type: ignore[no-untyped-def]
    (run_id,) = send("test.three", {}).run_ids
    zombie = claim(engine, run_id, "test.three-steps", worker="zombie")
    assert zombie is not None
    expire_lease(engine, run_id)
    assert holding().sweep().requeued == 1
    rescuer = claim(engine, run_id, "test.three-steps", worker="rescuer")
    assert rescuer is not None and rescuer.token != zombie.token
    with engine.begin() as conn:
        assert worker_sql.store_step(conn, zombie, "a", '"zombie"', 0.0) is False
        assert worker_sql.renew_lease(conn, zombie, 30) is False
        assert worker_sql.settle_succeeded(conn, zombie, '"zombie"', async_commit=True) is False
        assert worker_sql.settle_failed(conn, zombie, '{"type": "x"}') is None
        assert worker_sql.settle_retry(conn, zombie, '{"type": "x"}', 0) is False
    with engine.begin() as conn:
        assert worker_sql.store_step(conn, rescuer, "a", '"rescuer"', 0.0) is True
        assert worker_sql.settle_succeeded(conn, rescuer, '"done"', async_commit=True) is True
    assert one(engine, "SELECT output FROM job_step WHERE run_id = :r", r=run_id)[0] == "rescuer"
    assert run_state(engine, run_id) == "succeeded"


def test_a_stored_step_keeps_its_value_and_a_cancelled_run_stores_nothing(engine):  # type: ignore[no-untyped-def]
    from motir_celery import cancel_run

    (run_id,) = send("test.three", {}).run_ids
    held = claim(engine, run_id, "test.three-steps")
    assert held is not None
    with engine.begin() as conn:
        assert worker_sql.store_step(conn, held, "a", '"first"', 0.0) is True
        assert worker_sql.store_step(conn, held, "a", '"again"', 0.0) is False  # stored already: kept
        assert worker_sql.store_step(conn, held, "b", '{"n":[1,"x\\"y"]}', 0.5) is True
    cancel_run(run_id)
    with engine.begin() as conn:  # the fence refuses
        assert worker_sql.store_step(conn, held, "c", "3", 0.0) is False
    with engine.connect() as conn:
        stored = dict(conn.execute(text("SELECT step_id, output FROM job_step WHERE run_id = :r"), {"r": run_id}).all())
    assert stored == {"a": "first", "b": {"n": [1, 'x"y']}}


def test_a_step_record_and_a_settle_in_a_transaction_that_rolls_back_are_not_kept(engine):  # type: ignore[no-untyped-def]
    """The per-step statements go through libpq itself on the runner's autocommit connection
    (store/driver.py); on a connection in a transaction they must stay in that transaction."""
    (run_id,) = send("test.three", {}).run_ids
    held = claim(engine, run_id, "test.three-steps")
    assert held is not None
    for _ in range(2):  # the second time, each statement is prepared on the connection already
        with engine.connect() as conn:
            tx = conn.begin()
            assert worker_sql.store_step(conn, held, "a", '"rolled back"', 0.0) is True
            assert worker_sql.settle_succeeded(conn, held, '"rolled back"', async_commit=True) is True
            tx.rollback()
        assert one(engine, "SELECT count(*) FROM job_step WHERE run_id = :r", r=run_id)[0] == 0
        assert run_state(engine, run_id) == "running"


def test_a_reclaim_racing_a_step_write_never_loses_the_stored_step(engine):  # type: ignore[no-untyped-def]
    """The step write locks the run row (FOR SHARE): a concurrent reclaim skips the row
    (SKIP LOCKED) or, holding it first, makes the write re-check its fence and refuse.
    Either way the next claim's memo preload agrees with what was stored."""
    for _ in range(20):
        (run_id,) = send("test.three", {}).run_ids
        holder = claim(engine, run_id, "test.three-steps")
        assert holder is not None
        expire_lease(engine, run_id)
        barrier = threading.Barrier(2)
        stored: list[bool] = []

        def write() -> None:
            barrier.wait()
            with engine.begin() as conn:
                stored.append(worker_sql.store_step(conn, holder, "a", '"v"', 0.0))

        def reclaim() -> None:
            barrier.wait()
            holding().sweep()

        threads = [threading.Thread(target=write), threading.Thread(target=reclaim)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        holding().sweep()  # if the first sweep skipped the locked row, this one reclaims it
        new = claim(engine, run_id, "test.three-steps")
        assert new is not None
        assert ("a" in new.steps) == stored[0]


def _stored_steps(engine, run_id: str) -> list[str]:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:  # another connection: only what is committed
        return list(conn.execute(text("SELECT step_id FROM job_step WHERE run_id = :r ORDER BY step_id"),
                                 {"r": run_id}).scalars())


def _hold_run_row(engine, run_id: str, seconds: float) -> threading.Thread:  # type: ignore[no-untyped-def]
    """Lock the run's row from another connection for ``seconds``: a step record
    (FOR SHARE of it) waits in the server meanwhile."""
    locked = threading.Event()

    def hold() -> None:
        with engine.begin() as conn:
            conn.execute(text("SELECT 1 FROM job_queue WHERE id = :r FOR UPDATE"), {"r": run_id})
            locked.set()
            time.sleep(seconds)

    thread = threading.Thread(target=hold)
    thread.start()
    assert locked.wait(10)
    return thread


def _commits(engine, run_id: str) -> dict[str, bool]:  # type: ignore[no-untyped-def]
    """Each stored step of a run: whether it was committed with the settle (same xmin as the run's row)."""
    with engine.connect() as conn:
        return dict(conn.execute(text(  # type: ignore[arg-type]
            "SELECT s.step_id, s.xmin::text = q.xmin::text FROM job_step s JOIN job_queue q ON q.id = s.run_id "
            "WHERE s.run_id = :r"), {"r": run_id}).all())


def test_every_step_is_committed_before_the_next_body_starts_and_before_the_settle(engine):  # type: ignore[no-untyped-def]
    seen: list[list[str]] = []

    @define_job("test.committed-each", event="test.committed-each")
    def committed_each(event: Any, step: Any) -> Any:
        for name in ("a", "b", "c"):
            step.run(name, lambda: seen.append(_stored_steps(engine, event.run_id)) or 1)  # fast bodies
        seen.append(_stored_steps(engine, event.run_id))
        return "ok"

    (run_id,) = send("test.committed-each", {}).run_ids
    assert execute(run_id, "test.committed-each").state == "succeeded"
    assert seen == [[], ["a"], ["a", "b"], ["a", "b", "c"]]
    assert _commits(engine, run_id) == {"a": False, "b": False, "c": False}  # none rode in the settle


def test_a_step_record_that_waits_on_a_lock_is_committed_before_the_next_body(engine):  # type: ignore[no-untyped-def]
    seen_by_second: list[list[str]] = []

    @define_job("test.lagging", event="test.lagging")
    def lagging(event: Any, step: Any) -> Any:
        holder = step.run("first", lambda: bool(_hold_run_row(engine, event.run_id, 0.3)))
        step.run("second", lambda: seen_by_second.append(_stored_steps(engine, event.run_id)) or 2)
        return holder

    (run_id,) = send("test.lagging", {}).run_ids
    assert execute(run_id, "test.lagging").state == "succeeded"
    assert seen_by_second == [["first"]]


def test_a_handler_failing_after_its_last_step_keeps_that_step_for_the_retry(engine):  # type: ignore[no-untyped-def]
    (run_id,) = send("test.flaky", {}).run_ids  # test.fail-after-two: raises after step b
    assert execute(run_id, "test.fail-after-two").state == "retrying"
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT step_id FROM job_step WHERE run_id = :r ORDER BY step_id"),
                              {"r": run_id}).scalars().all()
    assert stored == ["a", "b"]
    with engine.begin() as conn:  # skip the backoff
        conn.execute(text("UPDATE job_queue SET run_at = now() WHERE id = :r"), {"r": run_id})
    assert execute(run_id, "test.fail-after-two").state == "succeeded"
    assert (count_effects(engine, run_id, "a"), count_effects(engine, run_id, "b"),
            count_effects(engine, run_id, "c")) == (1, 1, 1)


def test_the_claim_and_a_succeeded_settle_commit_without_waiting_for_the_wal_flush(engine):  # type: ignore[no-untyped-def]
    """The claim and a succeeded settle turn synchronous_commit off for their own
    transaction (a lost claim is a run queued again; a lost settle is a run reclaimed
    at its lease and replayed from its flushed steps); a step write keeps the server's
    setting, and nothing leaks into the next transaction. An engine built with
    ``Tuning(claim_async_commit=False, settle_async_commit=False)`` (the ablation's "off")
    leaves both flushed."""
    setting = "SELECT current_setting('synchronous_commit')"

    def claim_as(motir: Engine, run_id: uuid.UUID) -> records.Claim:
        with engine.begin() as conn:
            held = engine_claim(motir, conn, run_id, job_id="test.three-steps", worker="w", token=uuid.uuid4())
            assert held is not None
            assert conn.execute(text(setting)).scalar_one() == ("off" if motir.tuning.claim_async_commit else "on")
        return held

    def settle_as(motir: Engine, held: records.Claim) -> None:
        with engine.begin() as conn:
            assert worker_sql.settle_succeeded(conn, held, '"done"',
                                               async_commit=motir.tuning.settle_async_commit) is True
            assert conn.execute(text(setting)).scalar_one() == ("off" if motir.tuning.settle_async_commit else "on")

    default = holding()
    assert default.tuning.claim_async_commit and default.tuning.settle_async_commit  # on unless a benchmark says
    (run_id,) = send("test.three", {}).run_ids
    held = claim_as(default, run_id)
    with engine.begin() as conn:
        assert worker_sql.store_step(conn, held, "a", '{"n":1}', 0.0) is True
        assert conn.execute(text(setting)).scalar_one() == "on"
    settle_as(default, held)
    with engine.begin() as conn:  # nothing leaks into the next transaction
        assert conn.execute(text(setting)).scalar_one() == "on"
    assert run_state(engine, run_id) == "succeeded"
    flushed = Engine(host=Held(), tuning=Tuning(claim_async_commit=False, settle_async_commit=False))
    (other,) = send("test.three", {"n": 2}).run_ids
    settle_as(flushed, claim_as(flushed, other))
    assert run_state(engine, other) == "succeeded"


def _pid(conn) -> int:  # type: ignore[no-untyped-def]
    """The server process of one of the engine pool's connections."""
    return int(conn.raw.execute("SELECT pg_backend_pid()").fetchone()[0])


def _kill_the_pooled_connection(engine) -> int:  # type: ignore[no-untyped-def]
    """Leave exactly one connection in the engine's pool (the one runs use), with its server
    process terminated: the next statement on it meets a dead socket."""
    pool = holding().pool()
    pool.dispose()
    with pool.connect() as conn:
        doomed = _pid(conn)
    with pool.connect() as again:
        assert _pid(again) == doomed  # the pool hands it back
    with engine.connect() as admin:  # a connection outside the pool
        admin.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": doomed})
    return doomed


def test_a_hot_statement_on_a_dead_socket_raises_a_disconnect_that_invalidates_it(engine):  # type: ignore[no-untyped-def]
    """The hot statements bypass SQLAlchemy's execution layer: their errors must still
    be SQLAlchemy's, and a socket that died under a checked-out connection must be
    flagged so the pool replaces it."""
    from sqlalchemy.exc import DBAPIError

    (run_id,) = send("test.three", {}).run_ids
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        doomed = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with engine.pool._creator().cursor() as admin:  # a connection outside the pool
            admin.execute("SELECT pg_terminate_backend(%s)", (doomed,))
        with pytest.raises(DBAPIError) as raised:
            worker_sql.claim(conn, run_id, job_id="test.three-steps", worker="w", lease_seconds=30,
                                      async_commit=True)
        assert raised.value.connection_invalidated
    with engine.connect() as conn:
        assert conn.execute(text("SELECT pg_backend_pid()")).scalar_one() != doomed
    assert run_state(engine, run_id) == "queued"
    engine.dispose()  # the next tests start from a fresh pool


def test_a_statement_on_a_dead_socket_of_the_engines_pool_raises_connection_lost_and_replaces_it(engine):  # type: ignore[no-untyped-def]
    """The engine's own pool (no SQLAlchemy): the error is ConnectionLost, the connection is
    dropped, and the next checkout gets a live one; nothing of the claim happened."""
    (run_id,) = send("test.three", {}).run_ids
    doomed = _kill_the_pooled_connection(engine)
    pool = holding().pool()
    with pool.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        with pytest.raises(ConnectionLost):
            worker_sql.claim(conn, run_id, job_id="test.three-steps", worker="w", lease_seconds=30,
                                      async_commit=True)
    with pool.connect() as conn:
        assert _pid(conn) != doomed
    assert pool.checkedout() == 0
    assert run_state(engine, run_id) == "queued"


def test_a_pooled_socket_killed_under_the_worker_is_replaced_and_the_run_claimed(engine):  # type: ignore[no-untyped-def]
    (run_id,) = send("test.three", {}).run_ids
    doomed = _kill_the_pooled_connection(engine)
    assert execute(run_id, "test.three-steps").state == "succeeded"
    with holding().pool().connect() as conn:
        assert _pid(conn) != doomed  # the run's statements went on a new connection


def test_a_run_hands_its_connection_back_to_the_pool_when_it_ends(engine):  # type: ignore[no-untyped-def]
    """A run holds one connection while it runs and none between runs: a threads pool of
    N never needs more than N connections, whatever happened before."""
    first, second = (send("test.three", {"i": i}).run_ids[0] for i in range(2))
    assert execute(first, "test.three-steps").state == "succeeded"
    assert holding().pool().checkedout() == 0
    assert execute(second, "test.three-steps").state == "succeeded"
    assert holding().pool().checkedout() == 0


def test_retry_after_error_requeues_at_the_requested_time_on_the_database_clock(engine):  # type: ignore[no-untyped-def]
    @define_job("test.retry-after", event="test.retry-after")
    def retry_after(event: Any, step: Any) -> Any:
        raise RetryAfterError(120)

    published = Held()
    (run_id,) = send("test.retry-after", {}).run_ids
    assert execute(run_id, "test.retry-after", published).state == "retrying"
    row = one(engine, "SELECT state, extract(epoch FROM run_at - now()) AS wait FROM job_queue WHERE id = :r", r=run_id)
    assert row.state == "queued" and 110 < row.wait <= 120
    # 120 s is beyond MOTIR_REPUBLISH_AFTER's default: the sweeper publishes it when due, not a countdown.
    assert published == []


def test_cancelling_a_queued_run_means_it_never_starts(engine):  # type: ignore[no-untyped-def]
    from motir_celery import cancel_run

    (run_id,) = send("test.three", {}).run_ids
    assert cancel_run(run_id) is True
    assert execute(run_id, "test.three-steps").state == "skipped"
    assert run_state(engine, run_id) == "cancelled"
    assert cancel_run(run_id) is False  # a finished run stays as it ended


def test_cancelling_a_running_run_stops_it_at_the_next_step_boundary(engine):  # type: ignore[no-untyped-def]
    from motir_celery import cancel_run

    reached: list[str] = []

    @define_job("test.cancellable", event="test.cancellable")
    def cancellable(event: Any, step: Any) -> Any:
        # Longer than steps.MAX_LAG: "first" is stored before the next body starts.
        step.run("first", lambda: reached.append("first") or time.sleep(0.01) or 1)
        def second() -> int:
            # An operator cancels while the second step's body runs. The body outlasts
            # steps.MAX_LAG, so the refusal of its record is read before the next body.
            assert cancel_run(event.run_id)
            reached.append("second")
            time.sleep(0.01)
            return 2

        step.run("second", second)
        step.run("third", lambda: reached.append("third") or 3)

    (run_id,) = send("test.cancellable", {}).run_ids
    assert execute(run_id, "test.cancellable").state == "cancelled"
    assert reached == ["first", "second"]  # the body in flight finishes; its result is not stored
    with engine.connect() as conn:
        steps = conn.execute(text("SELECT step_id FROM job_step WHERE run_id = :r"), {"r": run_id}).scalars().all()
        outcome = conn.execute(text("SELECT outcome FROM job_run WHERE run_id = :r"), {"r": run_id}).scalar()
    assert steps == ["first"] and outcome == "cancelled"
    assert run_state(engine, run_id) == "cancelled"


# --- failure, DLQ and replay ----------------------------------------------------


def test_failure_beyond_the_retry_budget_leaves_a_failed_run_and_its_dlq_row(engine):  # type: ignore[no-untyped-def]
    published = Held()
    result = send("test.doomed", {"order": 7}, workspace_id="acme", idempotency_key="doom-1")
    (run_id,) = result.run_ids
    assert execute(run_id, "test.doomed", published).state == "retrying"
    assert published == [(run_id, "test.doomed", pytest.approx(0.1))]
    with engine.begin() as conn:  # skip the backoff
        conn.execute(text("UPDATE job_queue SET run_at = now() WHERE id = :r"), {"r": run_id})
    assert execute(run_id, "test.doomed").state == "failed"
    run = one(engine, "SELECT state, attempts, finished_at FROM job_queue WHERE id = :r", r=run_id)
    entry = one(engine, "SELECT * FROM job_run_dlq WHERE run_id = :r", r=run_id)
    assert run.state == "failed" and run.attempts == 2 and run.finished_at is not None
    assert entry.function_id == "test.doomed" and entry.event_name == "test.doomed"
    assert entry.event_data == {"order": 7} and entry.workspace_id == "acme"
    assert entry.attempts == 2 and entry.idempotency_key == "doom-1"
    assert entry.failure["message"] == "always fails"
    assert entry.first_failed_at < entry.last_failed_at
    assert count_effects(engine, run_id, "a") == 1  # step a was memoized across the retry


def test_failed_run_and_dlq_row_are_one_transaction_and_a_refused_settle_follows_the_retry_policy(engine):  # type: ignore[no-untyped-def]
    """Make the DLQ insert fail inside the settle: the run is not marked failed either,
    and the attempt is not left to its lease — it ends with the database's own message
    and the run is retried under its policy."""
    (run_id,) = send("test.refuses", {}).run_ids
    with engine.begin() as conn:
        conn.execute(text("""
            CREATE FUNCTION test.crash() RETURNS trigger LANGUAGE plpgsql AS
              $$ BEGIN RAISE EXCEPTION 'simulated crash while writing the DLQ row'; END $$;
            CREATE TRIGGER crash BEFORE INSERT ON job_run_dlq FOR EACH ROW EXECUTE FUNCTION test.crash();
        """))
    try:
        assert execute(run_id, "test.refuses").state == "retrying"
        row = one(engine, "SELECT state, (SELECT count(*) FROM job_run_dlq) AS dlq FROM job_queue WHERE id = :r",
                  r=run_id)
        assert (row.state, row.dlq) == ("queued", 0)  # neither half of the failure happened
        error = one(engine, "SELECT error FROM job_run WHERE run_id = :r", r=run_id)[0]
        assert "simulated crash" in error["message"]
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP TRIGGER crash ON job_run_dlq; DROP FUNCTION test.crash()"))
    with engine.begin() as conn:
        conn.execute(text("UPDATE job_queue SET max_attempts = 2, run_at = now() WHERE id = :r"), {"r": run_id})
    assert execute(run_id, "test.refuses").state == "failed"
    row = one(engine, "SELECT state, (SELECT count(*) FROM job_run_dlq WHERE run_id = :r) AS dlq "
                      "FROM job_queue WHERE id = :r", r=run_id)
    assert (row.state, row.dlq) == ("failed", 1)

def test_non_retriable_error_goes_straight_to_the_dlq(engine):  # type: ignore[no-untyped-def]
    (run_id,) = send("test.refuses", {}).run_ids
    assert execute(run_id, "test.refuses").state == "failed"
    assert one(engine, "SELECT attempts FROM job_queue WHERE id = :r", r=run_id)[0] == 1
    assert one(engine, "SELECT count(*) FROM job_run_dlq WHERE run_id = :r", r=run_id)[0] == 1


def _fail_mixed(engine, switch: str, key: str | None = None):  # type: ignore[no-untyped-def]
    result = send("test.mixed", {"switch": switch}, idempotency_key=key)
    for r in result.runs:
        execute(r.run_id, r.job_id)
    return result, one(engine, "SELECT id FROM job_run_dlq")[0]


def test_replay_runs_only_the_failed_job_and_records_the_actor(engine):  # type: ignore[no-untyped-def]
    from tests.fixtures.jobs import record

    result, dlq_id = _fail_mixed(engine, "sw-1")
    ok_run = next(r.run_id for r in result.runs if r.job_id == "test.mixed-ok")
    record(runner.Event("x", {}, None, None, "sw-1", 1), "fixed")  # the operator fixed the dependency
    published = Held()
    replay = holding(published).replay_dlq(dlq_id, actor="alice@example.com")
    assert replay.status == "replayed"
    assert published == [(replay.run_id, "test.mixed-fail", 0.0)]
    assert execute(replay.run_id, "test.mixed-fail").state == "succeeded"
    entry = one(engine, "SELECT replayed_at, replayed_by, replay_run_id FROM job_run_dlq WHERE id = :d", d=dlq_id)
    assert entry.replayed_at is not None and entry.replayed_by == "alice@example.com"
    assert entry.replay_run_id == replay.run_id
    assert count_effects(engine, ok_run) == 1  # the subscriber that succeeded did not run again
    assert one(engine, "SELECT count(*) FROM job_queue WHERE job_id = 'test.mixed-ok'")[0] == 1


def test_two_concurrent_replays_of_one_entry_make_one_run(engine):  # type: ignore[no-untyped-def]
    _, dlq_id = _fail_mixed(engine, "sw-2")
    barrier = threading.Barrier(2)
    results: list[dlq.ReplayResult] = []

    def replay(actor: str) -> None:
        barrier.wait()
        results.append(holding().replay_dlq(dlq_id, actor=actor))

    threads = [threading.Thread(target=replay, args=(a,)) for a in ("alice", "bob")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.status for r in results) == ["already_replayed", "replayed"]
    assert one(engine, "SELECT count(*) FROM job_queue WHERE job_id = 'test.mixed-fail'")[0] == 2


def test_replay_of_an_idempotency_keyed_event_is_deduplicated_until_given_a_new_key(engine):  # type: ignore[no-untyped-def]
    _, dlq_id = _fail_mixed(engine, "sw-3", key="order-42")
    replay = holding().replay_dlq(dlq_id, actor="alice")
    assert replay.status == "deduplicated"
    assert one(engine, "SELECT replayed_at FROM job_run_dlq WHERE id = :d", d=dlq_id)[0] is None
    again = holding().replay_dlq(dlq_id, actor="alice", idempotency_key="order-42-replay-1")
    assert again.status == "replayed" and again.run_id is not None


def _engine_role_session(engine) -> Session:  # type: ignore[no-untyped-def]
    """A caller's session whose transaction runs as the engine role (the role that may replay)."""
    session = Session(engine)
    session.execute(text("SET LOCAL ROLE motir_engine"))
    return session


def _entry(engine, dlq_id: uuid.UUID) -> Any:  # type: ignore[no-untyped-def]
    return one(engine, "SELECT replayed_at, replayed_by, replay_run_id FROM job_run_dlq WHERE id = :d", d=dlq_id)


def test_replay_in_a_callers_transaction_that_commits_is_written_and_published_on_its_commit(engine):  # type: ignore[no-untyped-def]
    from tests.fixtures.jobs import record

    _, dlq_id = _fail_mixed(engine, "sw-4")
    record(runner.Event("x", {}, None, None, "sw-4", 1), "fixed")
    published = Held()
    with _engine_role_session(engine) as session:
        replay = holding(published).replay_dlq(dlq_id, actor="alice", session=session)
        assert replay.status == "replayed" and replay.run_id is not None
        assert run_state(engine, replay.run_id) is None  # not committed: invisible, and not published
        assert _entry(engine, dlq_id).replayed_at is None and published == []
        session.commit()
    assert published == [(replay.run_id, "test.mixed-fail", 0.0)]
    entry = _entry(engine, dlq_id)
    assert entry.replayed_by == "alice" and entry.replay_run_id == replay.run_id
    assert execute(replay.run_id, "test.mixed-fail").state == "succeeded"


def test_replay_in_a_callers_transaction_that_rolls_back_writes_and_publishes_nothing(engine):  # type: ignore[no-untyped-def]
    _, dlq_id = _fail_mixed(engine, "sw-5")
    runs_before = one(engine, "SELECT count(*) FROM job_queue")[0]
    published = Held()
    with _engine_role_session(engine) as session:
        replay = holding(published).replay_dlq(dlq_id, actor="alice", session=session)
        assert replay.status == "replayed"
        session.rollback()
    assert published == []
    assert run_state(engine, replay.run_id) is None
    assert one(engine, "SELECT count(*) FROM job_queue")[0] == runs_before
    entry = _entry(engine, dlq_id)
    assert (entry.replayed_at, entry.replayed_by, entry.replay_run_id) == (None, None, None)  # still open
    again = holding(published).replay_dlq(dlq_id, actor="bob")  # and replayable
    assert again.status == "replayed" and published == [(again.run_id, "test.mixed-fail", 0.0)]


def test_a_deduplicated_replay_in_a_callers_transaction_undoes_only_its_own_stamp(engine):  # type: ignore[no-untyped-def]
    _, dlq_id = _fail_mixed(engine, "sw-6", key="order-43")
    published = Held()
    with Session(engine) as session:
        session.execute(text("INSERT INTO test.side_effect (run_id, step) VALUES ('caller', 'own-write')"))
        session.execute(text("SET LOCAL ROLE motir_engine"))
        replay = holding(published).replay_dlq(dlq_id, actor="alice", session=session)
        assert replay.status == "deduplicated"
        session.commit()
    assert published == [] and _entry(engine, dlq_id).replayed_at is None
    assert one(engine, "SELECT count(*) FROM test.side_effect WHERE run_id = 'caller'")[0] == 1


def test_replay_in_an_app_role_transaction_is_refused_and_writes_nothing(engine):  # type: ignore[no-untyped-def]
    _, dlq_id = _fail_mixed(engine, "sw-7")
    published = Held()
    with Session(engine) as session:
        session.execute(text("SET LOCAL ROLE motir_app"))
        with pytest.raises(PermissionError, match="motir_app"):
            holding(published).replay_dlq(dlq_id, actor="mallory", session=session)
        session.commit()
    assert published == [] and _entry(engine, dlq_id).replayed_at is None
    assert one(engine, "SELECT count(*) FROM job_queue WHERE job_id = 'test.mixed-fail'")[0] == 1


# --- definition-time errors -------------------------------------------------------


def test_define_job_refuses_what_cannot_work():
    with pytest.raises(JobDefinitionError, match="already defined"):
        define_job("test.three-steps", event="x")(lambda e, s: None)
    with pytest.raises(JobDefinitionError, match="unknown retry_policy 'sometimes'"):
        define_job("test.bad-policy", event="x", retry_policy="sometimes")
    with pytest.raises(JobDefinitionError, match="invalid cron expression"):
        define_job("test.bad-cron", cron="61 * * * *")
    with pytest.raises(JobDefinitionError, match="must be 1-200 characters"):
        define_job("bad id with spaces", event="x")


# --- sweeper ------------------------------------------------------------------


def test_heartbeat_keeps_a_long_step_claimed_past_its_lease(engine):  # type: ignore[no-untyped-def]
    import os


    short = Settings.from_env({**os.environ, "MOTIR_LEASE_SECONDS": "1"})
    (run_id,) = send("test.slow", {"sleep": 3}).run_ids
    stop = threading.Event()

    worker = holding(settings=short)  # the worker's engine: its runs' leases are renewed by its keeper

    def sweep_constantly() -> None:
        while not stop.wait(0.2):
            holding(settings=short).sweep()

    t = threading.Thread(target=sweep_constantly)
    t.start()
    heartbeat = threading.Thread(target=lambda: [worker.leases.renew_due() for _ in iter(lambda: stop.wait(0.1), True)])
    heartbeat.start()  # the worker's engine thread (adapter/worker.py) does this
    try:
        outcome = worker.execute(run_id, job_id="test.slow", worker="w")
    finally:
        stop.set()
        t.join()
        heartbeat.join()
    assert outcome.state == "succeeded"
    with engine.connect() as conn:
        outcomes = conn.execute(text("SELECT outcome FROM job_run WHERE run_id = :r"), {"r": run_id}).scalars().all()
    assert outcomes == ["succeeded"]  # never reclaimed: the lease was renewed every ~0.33 s


def test_republish_finds_only_old_messages_and_sends_a_deep_backlog_in_slices(engine):  # type: ignore[no-untyped-def]
    result_ids = [send("test.three", {"i": i}).run_ids[0] for i in range(30)]
    with engine.begin() as conn:
        assert maintenance_sql.republish_due(conn, after_seconds=60, batch=10) == []  # messages are fresh
        conn.execute(text("UPDATE job_queue SET dispatched_at = now() - interval '5 minutes'"))
    with engine.begin() as conn:
        first = maintenance_sql.republish_due(conn, after_seconds=60, batch=10)
    with engine.begin() as conn:
        second = maintenance_sql.republish_due(conn, after_seconds=60, batch=10)
    assert len(first) == 10 and len(second) == 10
    assert not {r for r, _ in first} & {r for r, _ in second}  # re-stamped: not sent again
    assert {r for r, _ in first + second} <= set(result_ids)


def test_a_run_whose_worker_keeps_dying_ends_in_the_dlq_not_a_loop(engine):  # type: ignore[no-untyped-def]
    (run_id,) = send("test.refuses", {}).run_ids
    with engine.begin() as conn:
        conn.execute(text("UPDATE job_queue SET max_attempts = 2 WHERE id = :r"), {"r": run_id})
    for expected in ("queued", "failed"):
        assert claim(engine, run_id, "test.refuses") is not None  # ...and the worker dies
        expire_lease(engine, run_id)
        holding().sweep()
        assert run_state(engine, run_id) == expected
    entry = one(engine, "SELECT attempts, failure FROM job_run_dlq WHERE run_id = :r", r=run_id)
    assert entry.attempts == 2 and entry.failure["type"] == "LeaseExpired"
    with engine.connect() as conn:
        outcomes = conn.execute(text("SELECT outcome FROM job_run WHERE run_id = :r ORDER BY attempt"),
                                {"r": run_id}).scalars().all()
    assert outcomes == ["lost", "lost"]


def test_schedule_options_are_checked_at_definition_time():
    with pytest.raises(JobDefinitionError, match="cron jobs only"):
        define_job("test.overlap-on-event", event="x", overlap="skip")
    with pytest.raises(JobDefinitionError, match="overlap must be 'allow' or 'skip'"):
        define_job("test.bad-overlap", cron="* * * * *", overlap="sometimes")
    with pytest.raises(JobDefinitionError, match="catchup must be"):
        define_job("test.bad-catchup", cron="* * * * *", catchup="yesterday")
