"""The engine through a real `celery worker` process and a real broker."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import redis
from sqlalchemy import text

import tests.fixtures.jobs  # noqa: F401  (registers the jobs in this process too, for send_event)
from motir_celery import send_event
from motir_celery.adapter.celery_app import create_app
from motir_celery.adapter.messages import engine_of
from motir_celery.settings import Settings
from tests.conftest import celery_worker, count_effects, run_state, wait_for
from tests.fixtures.engines import holding


def _final(engine, run_id, timeout=60.0):  # type: ignore[no-untyped-def]
    return wait_for(
        lambda: (s := run_state(engine, run_id)) in ("succeeded", "failed", "cancelled") and s,
        timeout=timeout, what=f"run {run_id} to finish",
    )


@pytest.fixture(params=["redis", "amqp"])
def broker(request: pytest.FixtureRequest, broker_url: str) -> str:
    if request.param == "amqp":
        return str(request.getfixturevalue("amqp_url"))
    return broker_url


@pytest.fixture
def app(broker, monkeypatch):  # type: ignore[no-untyped-def]
    """A Celery app publishing to the broker under test (the worker consumes from the same)."""
    monkeypatch.setenv("CELERY_BROKER_URL", broker)
    return create_app(Settings.from_env())


def test_three_step_job_runs_end_to_end_on_a_real_worker(engine, broker, app, tmp_path):  # type: ignore[no-untyped-def]
    with celery_worker(tmp_path, broker=broker):
        result = send_event("test.three", {"workspace_id": "acme"}, app=app)
        (run_id,) = result.run_ids
        assert _final(engine, run_id) == "succeeded"
    with engine.connect() as conn:
        steps = conn.execute(text("SELECT step_id, output FROM job_step WHERE run_id = :r ORDER BY step_id"),
                             {"r": run_id}).all()
        attempts = conn.execute(text("SELECT attempt, outcome, worker FROM job_run WHERE run_id = :r"),
                                {"r": run_id}).all()
        run = conn.execute(text("SELECT result, workspace_id FROM job_queue WHERE id = :r"), {"r": run_id}).one()
    assert [(s.step_id, s.output) for s in steps] == [("a", {"n": 1}), ("b", {"n": 2}), ("c", {"n": 3})]
    assert [(a.attempt, a.outcome) for a in attempts] == [(1, "succeeded")]
    assert attempts[0].worker
    assert run.result == {"total": 6} and run.workspace_id == "acme"


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_concurrent_handlers_in_one_worker_process_store_every_step_once(engine, broker_url, tmp_path, pool):  # type: ignore[no-untyped-def]
    """Several handlers holding step records at once share their process's flusher
    thread (the threads pool: four in one process); each run stores its four steps
    and runs its slow one once."""
    with celery_worker(tmp_path, broker=broker_url, pool=pool, concurrency=4):
        run_ids = [send_event("test.mixed-bodies", {"i": i}).run_ids[0] for i in range(12)]
        for run_id in run_ids:
            assert _final(engine, run_id) == "succeeded"
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT run_id, count(*) FROM job_step WHERE run_id = ANY(:r) GROUP BY run_id"),
                              {"r": run_ids}).all()
        results = conn.execute(text("SELECT result FROM job_queue WHERE id = ANY(:r)"), {"r": run_ids}).scalars().all()
    assert sorted(n for _, n in stored) == [4] * 12
    assert results == [4] * 12
    assert [count_effects(engine, run_id, "slow") for run_id in run_ids] == [1] * 12


def test_retry_does_not_repeat_completed_steps(engine, broker, app, tmp_path):  # type: ignore[no-untyped-def]
    with celery_worker(tmp_path, broker=broker):
        (run_id,) = send_event("test.flaky", {}, app=app).run_ids
        assert _final(engine, run_id) == "succeeded"
    assert count_effects(engine, run_id, "a") == 1
    assert count_effects(engine, run_id, "b") == 1
    assert count_effects(engine, run_id, "c") == 1
    with engine.connect() as conn:
        outcomes = conn.execute(text("SELECT outcome FROM job_run WHERE run_id = :r ORDER BY attempt"),
                                {"r": run_id}).scalars().all()
    assert outcomes == ["retrying", "succeeded"]


def test_same_run_published_five_times_concurrently_runs_its_body_once(engine, broker, app, tmp_path):  # type: ignore[no-untyped-def]
    publish = engine_of(app).publish
    with celery_worker(tmp_path, broker=broker, concurrency=4):
        # Write the run without publishing, then publish its id five times at once.
        (run_id,) = holding().send_event("test.slow", {"sleep": 1}).run_ids
        barrier = threading.Barrier(5)

        def fire() -> None:
            barrier.wait()
            publish(run_id, "test.slow", 0.0)

        threads = [threading.Thread(target=fire) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert _final(engine, run_id) == "succeeded"
        time.sleep(1.0)  # let the four duplicates be consumed (and refused by the claim)
    assert count_effects(engine, run_id) == 3  # a, b, c: each body once
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM job_run WHERE run_id = :r"), {"r": run_id}).scalar() == 1


def test_killed_worker_run_is_finished_by_another_without_redoing_steps(engine, broker, app, tmp_path):  # type: ignore[no-untyped-def]
    with celery_worker(tmp_path, broker=broker, name="doomed", lease=2.0) as first:
        (run_id,) = send_event("test.slow", {"sleep": 30}, app=app).run_ids
        wait_for(lambda: count_effects(engine, run_id, "b") == 1, what="step b to start")
        first.kill(signal.SIGKILL)
    with celery_worker(tmp_path, broker=broker, name="rescuer", lease=2.0):
        # The lease (2 s) expires, the rescuer's sweeper requeues the run and publishes it.
        with engine.begin() as conn:  # the second attempt must not sleep 30 s again
            conn.execute(text("UPDATE job_event SET data = '{\"sleep\": 0}'"))
        assert _final(engine, run_id) == "succeeded"
    assert count_effects(engine, run_id, "a") == 1  # stored before the kill: never again
    assert count_effects(engine, run_id, "b") == 2  # interrupted before its store: runs again
    assert count_effects(engine, run_id, "c") == 1
    with engine.connect() as conn:
        outcomes = conn.execute(text("SELECT outcome FROM job_run WHERE run_id = :r ORDER BY attempt"),
                                {"r": run_id}).scalars().all()
    assert outcomes == ["lost", "succeeded"]


def test_dlq_replay_through_a_worker_runs_only_the_failed_subscriber(engine, broker, app, tmp_path):  # type: ignore[no-untyped-def]
    from motir_celery import replay_dlq
    from motir_celery.core.worker.runner import Event
    from tests.fixtures.jobs import record

    with celery_worker(tmp_path, broker=broker):
        result = send_event("test.mixed", {"switch": f"e2e-{broker[:4]}"}, app=app)
        for run_id in result.run_ids:
            _final(engine, run_id)
        with engine.connect() as conn:
            dlq_id, failed_run = conn.execute(text("SELECT id, run_id FROM job_run_dlq")).one()
            assert run_state(engine, failed_run) == "failed"
        record(Event("x", {}, None, None, f"e2e-{broker[:4]}", 1), "fixed")
        replay = replay_dlq(dlq_id, actor="ops@example.com", app=app)
        assert replay.status == "replayed"
        assert _final(engine, replay.run_id) == "succeeded"
    with engine.connect() as conn:
        per_job = dict(conn.execute(text("SELECT job_id, count(*) FROM job_queue GROUP BY job_id")).all())
        replayed_by = conn.execute(text("SELECT replayed_by FROM job_run_dlq WHERE id = :d"), {"d": dlq_id}).scalar()
    assert per_job == {"test.mixed-ok": 1, "test.mixed-fail": 2}
    assert replayed_by == "ops@example.com"


def test_a_run_whose_message_was_never_published_is_found_by_the_sweeper(engine, broker_url, tmp_path):  # type: ignore[no-untyped-def]
    # A crash between the commit and the publish: the row exists, no message does.
    (run_id,) = holding().send_event("test.three", {}).run_ids
    with celery_worker(tmp_path, broker=broker_url, env={"MOTIR_REPUBLISH_AFTER": "1"}, sweep_interval=0.5):
        assert _final(engine, run_id) == "succeeded"


def test_a_poison_job_that_kills_its_worker_lands_in_the_dlq_and_others_still_run(engine, broker_url, tmp_path):  # type: ignore[no-untyped-def]
    with celery_worker(tmp_path, broker=broker_url, lease=1.5, sweep_interval=0.5):
        (poison,) = send_event("test.poison", {}).run_ids
        healthy = [send_event("test.three", {"i": i}).run_ids[0] for i in range(5)]
        assert _final(engine, poison, timeout=60) == "failed"
        for run_id in healthy:
            assert _final(engine, run_id) == "succeeded"
    assert count_effects(engine, poison, "poison") == 2  # its two attempts, then no more
    with engine.connect() as conn:
        failure = conn.execute(text("SELECT failure FROM job_run_dlq WHERE run_id = :r"), {"r": poison}).scalar()
    assert failure["type"] == "LeaseExpired"


def test_a_run_longer_than_the_visibility_timeout_is_delivered_once(engine, broker_url, tmp_path):  # type: ignore[no-untyped-def]
    """Early acks: the message is acknowledged when the run starts, so Redis never hands it
    out again, however long the run (late acks would see it redelivered every second here)."""
    app = create_app(Settings.from_env())
    with celery_worker(tmp_path, broker=broker_url, app="tests.fixtures.short_visibility_app") as worker:
        (run_id,) = send_event("test.slow", {"sleep": 3}, app=app).run_ids
        assert _final(engine, run_id) == "succeeded"
        time.sleep(2.5)  # two more restore periods: a late redelivery would be logged by now
        received = worker.output().count("] received")  # Celery's INFO line per delivery
    assert received == 1
    assert count_effects(engine, run_id, "b") == 1


# --- task events (Flower) ---------------------------------------------------------


class _EventStream:
    """Celery's event stream, read from the broker as Flower reads it, kept for one worker."""

    def __init__(self, app, hostname: str) -> None:  # type: ignore[no-untyped-def]
        self.app, self.hostname = app, hostname
        self.events: list[dict] = []
        self.error: BaseException | None = None
        self._receiver = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._capture, name="event-capture", daemon=True)

    def __enter__(self) -> "_EventStream":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        if self._receiver is not None:
            self._receiver.should_stop = True  # seen within its 1 s drain timeout
        self._thread.join(timeout=10)

    def _capture(self) -> None:
        try:
            with self.app.connection_for_read() as conn:
                self._receiver = self.app.events.Receiver(conn, handlers={"*": self._on_event})
                if self._stopping.is_set():
                    return
                # wakeup=False: no `heartbeat` broadcast to workers outside this test.
                self._receiver.capture(limit=None, timeout=None, wakeup=False)
        except BaseException as exc:  # noqa: BLE001 — surfaced by the test's waits
            self.error = exc

    def _on_event(self, event: dict) -> None:
        if event.get("hostname") == self.hostname:  # other workers may share the broker
            self.events.append(event)

    def wait(self, predicate, what: str, timeout: float = 15.0) -> dict:  # type: ignore[no-untyped-def]
        def found():  # type: ignore[no-untyped-def]
            if self.error is not None:
                raise AssertionError(f"event capture failed: {self.error!r}")
            return next((e for e in list(self.events) if predicate(e)), None)

        return wait_for(found, timeout=timeout, what=what)

    def of_type(self, prefix: str) -> list[dict]:
        return [e for e in list(self.events) if e["type"].startswith(prefix)]


def test_task_events_are_off_until_flower_enables_them(engine, broker_url, tmp_path):  # type: ignore[no-untyped-def]
    app = create_app(Settings.from_env())
    with celery_worker(tmp_path, broker=broker_url) as worker, _EventStream(app, worker.nodename) as stream:
        # Worker heartbeats (every 2 s) are worker events, on even now: the first one
        # proves the receiver is subscribed before anything is sent.
        stream.wait(lambda e: e["type"] == "worker-heartbeat", "the receiver to hear the worker")
        (quiet,) = send_event("test.three", {}, app=app).run_ids
        assert _final(engine, quiet) == "succeeded"
        # A heartbeat counting the task as processed is sent after task-succeeded would
        # have been (same main process, same connection; buffered task events are
        # flushed first): by then every event of the run is in.
        # (A heartbeat asked for by a remote `heartbeat` command, as Flower or another session's
        # control broadcast sends, carries no counts: not that one.)
        stream.wait(lambda e: e["type"] == "worker-heartbeat" and e.get("processed", 0) >= 1
                    and e.get("active") == 0, "a heartbeat after the run")
        assert stream.of_type("task-") == []

        # What Flower does (its --enable_events, every 5 s), addressed to this worker only.
        app.control.enable_events(destination=[worker.nodename])
        wait_for(lambda: "Events of group {task} enabled by remote." in worker.output(), timeout=15,
                 what="the worker to switch task events on")
        (seen,) = send_event("test.three", {}, app=app).run_ids
        assert _final(engine, seen) == "succeeded"
        received = stream.wait(lambda e: e["type"] == "task-received" and str(seen) in e["args"],
                               f"task-received for run {seen}")
        stream.wait(lambda e: e["type"] == "task-succeeded" and e["uuid"] == received["uuid"],
                    f"task-succeeded for run {seen}")
    assert received["name"] == "motir.test.three-steps"
    task_events = [e["type"] for e in stream.of_type("task-")]
    assert task_events == ["task-received", "task-started", "task-succeeded"]
    assert {e["uuid"] for e in stream.of_type("task-")} == {received["uuid"]}


@pytest.mark.parametrize("worker_app, kept", [("motir_celery", 0), ("tests.fixtures.short_visibility_app", 1)])
def test_the_default_app_keeps_no_copy_of_a_reserved_message_in_redis(engine, broker_url, tmp_path,  # type: ignore[no-untyped-def]
                                                                       worker_app, kept):
    """Our app turns kombu's ack emulation off on Redis: a message the worker has
    reserved (taken off the queue, waiting for a free process) leaves no copy in
    the ``unacked`` hash, which the emulation writes and deletes with two Redis
    round trips per message. An app that sets its own transport options (here the
    short-visibility one) keeps the emulation, and the copy."""
    from tests.fixtures import user_app

    assert "ack_emulation" not in (user_app.app.conf.broker_transport_options or {})  # attach() leaves it
    broker = redis.Redis.from_url(broker_url)
    queue = os.environ["MOTIR_QUEUE"]

    def unacked_here() -> int:
        # kombu's `unacked` hash is one per Redis database, written by every session's workers
        # (pytest -n, other runs): count the entries routed to this session's queue only.
        return sum(1 for raw in broker.hvals("unacked") if queue in json.loads(raw)[1:3])

    assert unacked_here() == 0
    with celery_worker(tmp_path, broker=broker_url, concurrency=1, app=worker_app):
        running, reserved = (send_event("test.slow", {"sleep": 3}).run_ids[0] for _ in range(2))
        wait_for(lambda: run_state(engine, running) == "running", what="the first run to start")
        wait_for(lambda: broker.llen(os.environ["MOTIR_QUEUE"]) == 0, what="the second message to be reserved by the busy worker")
        assert run_state(engine, reserved) == "queued"
        assert unacked_here() == kept
        wait_for(lambda: run_state(engine, reserved) == "succeeded", what="the reserved run", timeout=30)
