"""Durable primitives: sleep, send_event, wait_for_event, cancel_on, concurrency keys, singleton,
priority, rate-limit deferral, tracing.

Their semantics run in this process on the test kit (``motir``: the real claim, step, settle and
sweeper statements against Postgres; ``advance`` skips time), with threads as concurrent workers
where concurrency is the subject (tests/fixtures/kit_workers.py). Real ``celery worker`` processes
stay for what only a process shows: a sleeping run gives its worker process back to other runs,
and a sleeping run survives every process being killed.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import pytest
from sqlalchemy import text

import tests.fixtures.jobs  # noqa: F401  (registers the test jobs in this process too)
from motir_celery import send_event
from motir_celery.core.jobs import define_job
from motir_celery.errors import JobDefinitionError
from motir_celery.store import records
from motir_celery.store.sql import worker as worker_sql
from motir_celery.testing import Held, Motir
from tests.conftest import ROOT, celery_worker, count_effects, run_state, wait_for
from tests.fixtures.engines import holding, send
from tests.fixtures.kit_workers import run_concurrently


def _final(engine, run_id, timeout=60.0):  # type: ignore[no-untyped-def]
    return wait_for(lambda: (s := run_state(engine, run_id)) in ("succeeded", "failed", "cancelled") and s,
                    timeout=timeout, what=f"run {run_id} to finish")


def _ledger(engine, run_id) -> list[str]:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT outcome FROM job_run WHERE run_id = :r ORDER BY id"),
                                 {"r": run_id}).scalars())


def _suspended(engine, run_id) -> bool:  # type: ignore[no-untyped-def]
    return "suspended" in _ledger(engine, run_id) and run_state(engine, run_id) == "queued"


def _drain_until_settled(kit: Motir, run_id: Any, *, step: float = 1.0, rounds: int = 10) -> str:
    """Drain; while the run is still queued (a backoff, a deferral, a sleep), skip ``step`` seconds
    and drain again, ``rounds`` times at most. The run's final state."""
    for _ in range(rounds):
        kit.drain()
        state = run_state(kit.sql, run_id)
        if state in ("succeeded", "failed", "cancelled"):
            return state
        kit.advance(seconds=step)
    raise AssertionError(f"run {run_id} still {run_state(kit.sql, run_id)} after {rounds} rounds")


# --- step.sleep -------------------------------------------------------------------


def test_sleep_gives_the_worker_back_and_resumes_from_memoized_steps(engine, broker_url, tmp_path):  # type: ignore[no-untyped-def]
    # On a real worker: the subject is the worker process, free for other runs while one sleeps.
    with celery_worker(tmp_path, broker=broker_url, sweep_interval=0.3):
        (run_id,) = send_event("test.sleep", {"sleep": 3}).run_ids
        wait_for(lambda: _suspended(engine, run_id), what="the run to suspend")
        # While it sleeps the worker is free: another run goes through meanwhile, and
        # ends before the sleeper's wake time (read from the database, not from a
        # wall clock a loaded machine stretches).
        (other,) = send_event("test.three", {}).run_ids
        assert _final(engine, other) == "succeeded"
        assert _final(engine, run_id) == "succeeded"
        with engine.connect() as conn:
            woke_after = conn.execute(text("SELECT r.started_at > o.finished_at FROM job_run r, job_queue o "
                                           "WHERE r.run_id = :r AND r.outcome = 'succeeded' AND o.id = :o"),
                                      {"r": run_id, "o": other}).scalar_one()
        assert woke_after is True
    assert count_effects(engine, run_id, "before") == 1 and count_effects(engine, run_id, "after") == 1
    assert _ledger(engine, run_id) == ["suspended", "succeeded"]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT attempts FROM job_queue WHERE id = :r"), {"r": run_id}).scalar() == 1


def test_an_hour_long_sleep_holds_no_worker_and_no_countdown(kit: Motir) -> None:
    (run_id,) = kit.send_event("test.sleep", {"sleep": 3600}).run_ids
    # One executor, this thread: the attempt ends at the sleep (a sleep that held it would hold the drain).
    assert [o.state for r, o in kit.drain() if r == run_id] == ["suspended"]
    (other,) = kit.send_event("test.three", {}).run_ids  # the only executor is free
    assert [(r, o.state) for r, o in kit.drain()] == [(other, "succeeded")]
    with kit.sql.connect() as conn:
        row = conn.execute(text("SELECT state, extract(epoch FROM run_at - now()) AS wait, claim_token "
                                "FROM job_queue WHERE id = :r"), {"r": run_id}).one()
    assert row.state == "queued" and row.claim_token is None and 3500 < row.wait <= 3600


def test_a_sleeping_run_survives_every_process_being_killed(engine, broker_url, tmp_path):  # type: ignore[no-untyped-def]
    # On real workers: the subject is a SIGKILLed process, and a new one's sweeper.
    with celery_worker(tmp_path, broker=broker_url, name="first") as first:
        (run_id,) = send_event("test.sleep", {"sleep": 4}).run_ids
        wait_for(lambda: _suspended(engine, run_id), what="the run to suspend")
        first.kill(signal.SIGKILL)
    time.sleep(1)
    # A new worker, which never saw the run: its sweeper publishes it once the wake time passes.
    with celery_worker(tmp_path, broker=broker_url, name="second", sweep_interval=0.3):
        assert _final(engine, run_id) == "succeeded"
    assert count_effects(engine, run_id, "before") == 1 and count_effects(engine, run_id, "after") == 1
    with engine.connect() as conn:
        slept = conn.execute(text("SELECT (output->>'until')::timestamptz - (output->>'since')::timestamptz "
                                  "FROM job_step WHERE run_id = :r AND step_id = 'nap'"), {"r": run_id}).scalar()
        resumed = conn.execute(text("SELECT started_at FROM job_run WHERE run_id = :r ORDER BY id DESC LIMIT 1"),
                               {"r": run_id}).scalar()
        wake = conn.execute(text("SELECT (output->>'until')::timestamptz FROM job_step "
                                 "WHERE run_id = :r AND step_id = 'nap'"), {"r": run_id}).scalar()
    assert slept.total_seconds() == pytest.approx(4, abs=0.01)
    assert resumed >= wake  # not resumed early


# --- step.send_event --------------------------------------------------------------


def test_step_send_event_emits_exactly_one_event_across_retries(kit: Motir) -> None:
    (run_id,) = kit.send_event("test.emit", {}).run_ids
    assert _drain_until_settled(kit, run_id) == "succeeded"
    with kit.sql.connect() as conn:
        emitted = conn.execute(text("SELECT idempotency_key FROM job_event WHERE name = 'test.emitted'")).all()
    assert len(emitted) == 1 and emitted[0].idempotency_key == f"motir.step:{run_id}:notify"
    assert _ledger(kit.sql, run_id) == ["retrying", "succeeded"]


def test_a_step_event_sent_again_by_a_body_that_reran_is_deduplicated(engine):  # type: ignore[no-untyped-def]
    key = f"motir.step:{uuid.uuid4()}:notify"
    first = send("test.emitted", {"n": 1}, idempotency_key=key)
    again = send("test.emitted", {"n": 1}, idempotency_key=key)  # the interrupted body, re-run
    assert not first.deduplicated and again.deduplicated and again.event_id == first.event_id


# --- step.wait_for_event ----------------------------------------------------------


def test_wait_for_event_resumes_with_the_matching_event(kit: Motir) -> None:
    (run_id,) = kit.send_event("test.order", {"order_id": 7}).run_ids
    kit.drain()
    assert _suspended(kit.sql, run_id)
    kit.send_event("test.paid", {"order_id": 8, "amount": 1})   # another order: no match
    assert kit.drain() == [] and run_state(kit.sql, run_id) == "queued"
    sent = kit.send_event("test.paid", {"order_id": 7, "amount": 42})
    assert [r.run_id for r in sent.woken] == [run_id]
    kit.drain()
    assert run_state(kit.sql, run_id) == "succeeded"
    with kit.sql.connect() as conn:
        result = conn.execute(text("SELECT result FROM job_queue WHERE id = :r"), {"r": run_id}).scalar()
    assert result["data"] == {"order_id": 7, "amount": 42} and result["id"] == str(sent.event_id)
    assert count_effects(kit.sql, run_id, "placed") == 1


def test_only_a_newly_recorded_event_wakes_its_waiters_not_a_deduplicated_resend(engine):  # type: ignore[no-untyped-def]
    send("test.paid", {"order": "o-1"}, idempotency_key="pay-o-1")
    (waiter,) = send("test.three", {}).run_ids
    with engine.begin() as conn:  # a run suspended in wait_for_event(event="test.paid", match="data.order")
        conn.execute(text("UPDATE job_queue SET wait_event = 'test.paid', wait_path = '{order}', wait_value = 'o-1', "
                          "run_at = now() + interval '1 hour' WHERE id = :r"), {"r": waiter})

    def due() -> bool:
        with engine.connect() as conn:
            return bool(conn.execute(text("SELECT run_at <= now() FROM job_queue WHERE id = :r"),
                                     {"r": waiter}).scalar_one())

    again = send("test.paid", {"order": "o-1"}, idempotency_key="pay-o-1")
    assert again.deduplicated and again.woken == [] and not due()
    fresh = send("test.paid", {"order": "o-1"}, idempotency_key="pay-o-1:again")
    assert [r.run_id for r in fresh.woken] == [waiter] and due()


def test_wait_for_event_returns_none_after_its_timeout(kit: Motir) -> None:
    (run_id,) = kit.send_event("test.order", {"order_id": 9, "timeout": 2}).run_ids
    kit.drain()
    kit.advance(seconds=1)
    assert kit.drain() == [] and run_state(kit.sql, run_id) == "queued"  # not yet
    kit.advance(seconds=1)
    kit.drain()
    assert run_state(kit.sql, run_id) == "succeeded"
    with kit.sql.connect() as conn:
        assert conn.execute(text("SELECT result FROM job_queue WHERE id = :r"), {"r": run_id}).scalar() is None
    assert count_effects(kit.sql, run_id, "done") == 1


def test_wait_for_event_under_an_event_storm_loses_no_match(kit: Motir) -> None:
    """Each payment is sent the moment its run has decided to wait (its wait's start is
    stored), so it races the look-back and the recording of the wait; unrelated
    payments hammer the same event name meanwhile. Every run must resume with its own.
    Three threads run the runs concurrently, as three worker processes would."""
    n = 24
    orders = [f"storm-{i}" for i in range(n)]
    engine = kit.sql
    runs = {o: kit.send_event("test.order", {"order_id": o, "timeout": 120}).run_ids[0] for o in orders}

    def decided_to_wait(run_id: uuid.UUID) -> bool:
        with engine.connect() as conn:
            return conn.execute(text("SELECT 1 FROM job_step WHERE run_id = :r AND step_id = 'paid:wait'"),
                                {"r": run_id}).scalar() is not None

    def pay(order_ids: list[str]) -> None:
        for o in order_ids:
            wait_for(lambda: decided_to_wait(runs[o]), timeout=60, interval=0.005, what=f"{o} to wait")
            time.sleep(random.uniform(0, 0.01))
            kit.send_event("test.paid", {"order_id": o})

    def storm() -> None:
        noise_stop = threading.Event()

        def noise() -> None:  # unrelated payments hammering the same event name
            while not noise_stop.is_set():
                kit.send_event("test.paid", {"order_id": f"noise-{uuid.uuid4().hex[:6]}"})

        payers = [threading.Thread(target=pay, args=(orders[i::3],)) for i in range(3)]
        noisy = [threading.Thread(target=noise) for _ in range(2)]
        for t in payers + noisy:
            t.start()
        for t in payers:
            t.join()
        noise_stop.set()
        for t in noisy:
            t.join()

    def all_finished() -> bool:
        with engine.connect() as conn:
            return conn.execute(text("SELECT count(*) FROM job_queue WHERE job_id = 'test.waiter' "
                                     "AND state IN ('succeeded', 'failed', 'cancelled')")).scalar() == n

    run_concurrently(kit, 3, all_finished, timeout=90, beside=storm)
    for o, run_id in runs.items():
        assert run_state(engine, run_id) == "succeeded", o
    with engine.connect() as conn:
        results = dict(conn.execute(text("SELECT id, result FROM job_queue WHERE job_id = 'test.waiter'")).all())
    assert all(results[run_id] is not None and results[run_id]["data"]["order_id"] == o
               for o, run_id in runs.items())


# --- cancel_on --------------------------------------------------------------------


def test_cancel_on_event_cancels_the_matching_run_only(kit: Motir) -> None:
    (target,) = kit.send_event("test.order.placed", {"order_id": "o-1"}).run_ids
    (bystander,) = kit.send_event("test.order.placed", {"order_id": "o-2"}).run_ids
    kit.drain()
    assert _suspended(kit.sql, target) and _suspended(kit.sql, bystander)  # both sleep
    result = kit.send_event("test.order.cancelled", {"order_id": "o-1"})
    assert result.cancelled == [target]
    assert run_state(kit.sql, target) == "cancelled"
    assert run_state(kit.sql, bystander) == "queued"
    kit.advance(seconds=30)  # both sleeps are over: the bystander wakes and finishes, the target never does
    kit.drain()
    assert run_state(kit.sql, target) == "cancelled" and run_state(kit.sql, bystander) == "succeeded"
    assert count_effects(kit.sql, target, "b") == 0 and count_effects(kit.sql, bystander, "b") == 1


def test_cancel_on_stops_a_running_run_at_its_next_step_boundary(engine):  # type: ignore[no-untyped-def]
    from motir_celery import CancelOn

    seen: list[str] = []

    @define_job("test.cancel-on-running", event="test.long", cancel_on=[CancelOn("test.stop", "data.key")])
    def long_job(event, step):  # type: ignore[no-untyped-def]
        step.run("one", lambda: seen.append("one") or 1)
        def two() -> int:
            # The cancelling event arrives while step "two" runs. The body outlasts
            # steps.MAX_LAG, so the refusal of its record is read before the next body.
            send_event("test.stop", {"key": event.data["key"]})
            seen.append("two")
            time.sleep(0.01)
            return 2

        step.run("two", two)
        step.run("three", lambda: seen.append("three") or 3)

    (run_id,) = send("test.long", {"key": "k"}).run_ids
    assert holding().execute(run_id, job_id="test.cancel-on-running", worker="w").state == "cancelled"
    assert seen == ["one", "two"]


def test_cancel_on_timeout_limits_how_long_the_rule_applies(engine):  # type: ignore[no-untyped-def]
    from motir_celery import CancelOn

    define_job("test.cancel-window", event="test.window",
               cancel_on=[CancelOn("test.window.stop", "data.key", timeout=60)])(lambda e, s: None)
    (recent,) = send("test.window", {"key": "a"}).run_ids
    (old,) = send("test.window", {"key": "b"}).run_ids
    with engine.begin() as conn:
        conn.execute(text("UPDATE job_queue SET created_at = now() - interval '2 minutes' WHERE id = :r"),
                     {"r": old})
    send("test.window.stop", {"key": "a"})
    send("test.window.stop", {"key": "b"})
    assert run_state(engine, recent) == "cancelled" and run_state(engine, old) == "queued"


# --- concurrency keys -------------------------------------------------------------


def _peak_overlap(engine, step: str) -> int:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT step, at FROM test.side_effect WHERE step IN (:s, :e)"),
                            {"s": f"{step}:start", "e": f"{step}:end"}).all()
    timeline = sorted(((r.at, 1 if r.step.endswith("start") else -1) for r in rows),
                      key=lambda x: (x[0], x[1]))  # at the same instant, an end before a start
    peak = current = 0
    for _, delta in timeline:
        current += delta
        peak = max(peak, current)
    return peak


def test_concurrency_key_limit_2_holds_across_8_concurrent_workers(kit: Motir) -> None:
    # Eight threads take and run due runs at once (as 4 workers x 2 processes did): every claim
    # of a run over its key's limit is refused, and taken again until a slot is free.
    engine = kit.sql
    runs = [kit.send_event("test.limited", {"tenant": "acme", "sleep": 0.4}).run_ids[0] for _ in range(20)]
    (other,) = kit.send_event("test.limited", {"tenant": "globex", "sleep": 0.4}).run_ids

    def all_finished() -> bool:
        with engine.connect() as conn:
            return conn.execute(text("SELECT count(*) FROM job_queue WHERE state IN ('succeeded', 'failed', "
                                     "'cancelled')")).scalar() == 21

    done = run_concurrently(kit, 8, all_finished, timeout=120)
    for run_id in runs + [other]:
        assert run_state(engine, run_id) == "succeeded"
    assert any(o.state == "skipped" for _, _, o in done)  # the limit did refuse claims
    peak = _peak_overlap(engine, "work")
    # Measured from the bodies' own start/end instants: acme (limit 2) plus globex (its own key).
    with engine.connect() as conn:
        acme = conn.execute(text(
            "SELECT count(*) FROM test.side_effect s JOIN job_queue q ON q.id::text = s.run_id "
            "WHERE q.concurrency_key = 'acme' AND s.step = 'work:start'")).scalar()
    assert acme == 20
    assert peak <= 3
    # And for the limited key alone:
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM test.side_effect WHERE run_id = :r"), {"r": str(other)})
    acme_peak = _peak_overlap(engine, "work")
    print(f"\npeak concurrent executions of one key with limit 2 (20 runs, 8 concurrent workers): {acme_peak}")
    assert 1 <= acme_peak <= 2


# --- singleton ------------------------------------------------------------------


def test_singleton_key_allows_one_active_run_and_frees_the_key_when_it_settles(engine):  # type: ignore[no-untyped-def]
    first = send("test.singleton", {"customer": "c1"})
    second = send("test.singleton", {"customer": "c1"})
    other = send("test.singleton", {"customer": "c2"})
    assert len(first.run_ids) == 1 and second.run_ids == [] and len(other.run_ids) == 1
    assert isinstance(second.runs[0], records.AlreadyQueued)
    assert holding().execute(first.run_ids[0], job_id="test.singleton", worker="w").state == "succeeded"
    third = send("test.singleton", {"customer": "c1"})
    assert len(third.run_ids) == 1


def test_singleton_is_decided_by_the_database_under_concurrent_sends(engine):  # type: ignore[no-untyped-def]
    barrier = threading.Barrier(8)
    created: list[int] = []

    def race() -> None:
        barrier.wait()
        created.append(len(send("test.singleton", {"customer": "race"}).run_ids))

    threads = [threading.Thread(target=race) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(created) == [0] * 7 + [1]


# --- priority --------------------------------------------------------------------


def test_priority_decides_which_waiting_run_gets_a_freed_concurrency_slot(engine):  # type: ignore[no-untyped-def]
    define_job("test.prio", event="test.prio", concurrency=(1, None))(lambda e, s: None)
    low = send("test.prio", {}, priority=1).run_ids[0]
    high = send("test.prio", {}, priority=9).run_ids[0]
    mid = send("test.prio", {}, priority=5).run_ids[0]
    with engine.begin() as conn:
        order = [worker_sql.next_in_line(conn, "test.prio", "", None) for _ in range(3)]
    assert order[0] == high
    with engine.begin() as conn:
        conn.execute(text("UPDATE job_queue SET state = 'succeeded' WHERE id = :r"), {"r": high})
        assert worker_sql.next_in_line(conn, "test.prio", "", None) == mid
        conn.execute(text("UPDATE job_queue SET state = 'succeeded' WHERE id = :r"), {"r": mid})
        assert worker_sql.next_in_line(conn, "test.prio", "", None) == low
    with pytest.raises(JobDefinitionError, match="priority"):
        define_job("test.bad-prio", event="x", priority=10)


# --- rate-limit deferral -------------------------------------------------------------


def test_rate_limited_defers_without_charging_an_attempt(kit: Motir) -> None:
    (run_id,) = kit.send_event("test.throttled", {}).run_ids  # max_attempts=1: a charged deferral would fail it
    assert _drain_until_settled(kit, run_id, step=0.2) == "succeeded"
    with kit.sql.connect() as conn:
        row = conn.execute(text("SELECT attempts, deferrals FROM job_queue WHERE id = :r"), {"r": run_id}).one()
    assert (row.attempts, row.deferrals) == (1, 2)
    assert _ledger(kit.sql, run_id) == ["deferred", "deferred", "succeeded"]


# --- tracing ---------------------------------------------------------------------


def test_run_span_is_a_child_of_the_sender_and_steps_are_children_of_the_run(engine):  # type: ignore[no-untyped-def]
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from motir_celery.core import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    previous = tracing._tracer
    tracing._tracer = provider.get_tracer("motir_celery")
    try:
        with tracer.start_as_current_span("checkout") as sender:
            (run_id,) = send("test.three", {}).run_ids
        assert holding().execute(run_id, job_id="test.three-steps", worker="w").state == "succeeded"
    finally:
        tracing._tracer = previous
    spans = {s.name: s for s in exporter.get_finished_spans()}
    run_span = spans["motir.run test.three-steps"]
    assert run_span.parent.span_id == sender.get_span_context().span_id
    assert run_span.context.trace_id == sender.get_span_context().trace_id
    for step in ("a", "b", "c"):
        assert spans[f"motir.step {step}"].parent.span_id == run_span.context.span_id
    with engine.connect() as conn:
        assert conn.execute(text("SELECT traceparent FROM job_queue WHERE id = :r"), {"r": run_id}).scalar()
    assert trace is not None


def test_no_span_is_made_until_an_sdk_tracer_provider_is_set():  # type: ignore[no-untyped-def]
    # A fresh interpreter: the global tracer provider can be set only once per process.
    script = """
from contextlib import nullcontext
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from motir_celery.core import tracing

assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
assert type(tracing.run_span("j", "r", 1, None)) is nullcontext
assert type(tracing.step_span("s")) is nullcontext

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
# A caller's SDK span still propagates, whatever the global provider.
with provider.get_tracer("caller").start_as_current_span("checkout") as sender:
    ctx = sender.get_span_context()
    traceparent = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
    assert tracing.current_traceparent() == traceparent

trace.set_tracer_provider(provider)  # after import: the module's tracer must follow it
with tracing.run_span("j", "r", 1, None):
    with tracing.step_span("s"):
        pass
print(sorted(s.name for s in exporter.get_finished_spans()))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "['checkout', 'motir.run j', 'motir.step s']"


def test_singleton_refuses_a_second_run_while_the_first_runs_until_it_settles(kit: Motir) -> None:
    engine = kit.sql
    (first,) = kit.send_event("test.singleton", {"customer": "w1", "sleep": 1.5}).run_ids
    # The first run, in a thread of its own (a worker), is running while the second is sent.
    holder = threading.Thread(target=kit.drain)
    holder.start()
    try:
        wait_for(lambda: run_state(engine, first) == "running", what="the first run to start")
        refused = kit.send_event("test.singleton", {"customer": "w1"})
        assert refused.run_ids == [] and isinstance(refused.runs[0], records.AlreadyQueued)
    finally:
        holder.join(timeout=60)
    assert run_state(engine, first) == "succeeded"
    (later,) = kit.send_event("test.singleton", {"customer": "w1"}).run_ids  # the key is free again
    kit.drain()
    assert run_state(engine, later) == "succeeded"


def test_priority_runs_the_most_urgent_waiting_run_first_when_the_slot_frees(kit: Motir) -> None:
    """As on a worker, messages arrive in the order they were sent (a FIFO queue here), and a
    message whose claim the one slot refuses is dropped: the run that frees the slot publishes the
    next in line (``next_in_line``), so its choice alone decides the order (the kit's ``drain``,
    which takes due runs by priority, is not used)."""
    engine, queue = kit.sql, Held()  # the broker's queue: what the workers publish, in order
    worker = holding(queue, kit.settings)

    def deliver(run_id: Any) -> str:  # a worker process taking one message
        return worker.execute(run_id, job_id="test.prio-worker", worker="w").state

    (blocker,) = kit.send_event("test.prio-worker", {"label": "blocker", "sleep": 1.5}).run_ids
    holder = threading.Thread(target=deliver, args=(blocker,))  # the blocker holds the only slot
    holder.start()
    try:
        wait_for(lambda: run_state(engine, blocker) == "running", what="the blocker to hold the only slot")
        runs = {label: kit.send_event("test.prio-worker", {"label": label}, priority=p).run_ids[0]
                for label, p in (("low", 1), ("high", 9), ("mid", 5))}
        # their messages, in the order sent, reach the other worker process: no slot, dropped
        assert [deliver(runs[label]) for label in ("low", "high", "mid")] == ["skipped"] * 3
    finally:
        holder.join(timeout=60)
    while queue:  # the messages the freed slots publish, in order
        assert deliver(queue.pop(0)[0]) == "succeeded"
    for run_id in [blocker, *runs.values()]:
        assert run_state(engine, run_id) == "succeeded"
    with engine.connect() as conn:
        order = list(conn.execute(text("SELECT step FROM test.side_effect WHERE step LIKE :p ORDER BY at"),
                                  {"p": "prio-%:start"}).scalars())
    assert order == ["prio-blocker:start", "prio-high:start", "prio-mid:start", "prio-low:start"]
