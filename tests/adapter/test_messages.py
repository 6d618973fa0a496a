"""A run's message on Redis: the short way (messages.RedisLane) writes what send_task writes."""

from __future__ import annotations

import base64
import json
import logging
import uuid
from datetime import datetime, timezone
from typing import Any, Iterator

import pytest
import redis
from celery import Celery, signals

import tests.fixtures.jobs  # noqa: F401  (test.three, for the worker)
from motir_celery import define_job, send_event
from motir_celery.adapter.celery_app import create_app
from motir_celery.adapter.messages import CeleryHost, RedisLane, engine_of, redis_lane
from motir_celery.core.engine import Engine, Tuning
from motir_celery.core.publish import Publish
from motir_celery.settings import Settings
from tests.conftest import celery_worker, run_state, wait_for


@define_job("test.msg-urgent", event="test.msg-urgent", priority=8, time_limit=30, soft_time_limit=20)
def _urgent(event: Any, step: Any) -> None:
    return None


@define_job("test.msg-low", event="test.msg-low", priority=2)
def _low(event: Any, step: Any) -> None:
    return None


#: The job's own queue, this session's only: concurrent sessions (pytest -n) drain the same Redis.
OWN_QUEUE = f"motir-test-own-queue-{uuid.uuid4().hex[:8]}"


@define_job("test.msg-own-queue", event="test.msg-own-queue", queue=OWN_QUEUE)
def _own_queue(event: Any, step: Any) -> None:
    return None


@pytest.fixture
def app(broker_url: str) -> Celery:
    return create_app(Settings.from_env())


def publisher(app: Celery) -> Publish:
    """How the app's engine publishes a run's message (its host: ``CeleryHost`` on ``app``)."""
    host = engine_of(app).host
    assert isinstance(host, CeleryHost) and host.app is app
    return host.publish


def _spy(app: Celery, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    names: list[str] = []
    real = app.send_task

    def spy(name: str, *args: Any, **kwargs: Any) -> Any:
        names.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(app, "send_task", spy)
    return names


@pytest.fixture
def sent(app: Celery, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The task names that went through ``app.send_task`` (the long way)."""
    return _spy(app, monkeypatch)


@pytest.fixture
def broker(broker_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(broker_url)
    yield client
    client.close()


def _drain(broker: redis.Redis, key: str) -> list[dict[str, Any]]:
    """The messages in a kombu Redis list, oldest first (kombu LPUSHes and BRPOPs)."""
    raw = broker.lrange(key, 0, -1)
    broker.delete(key)
    return [json.loads(m) for m in reversed(raw)]


def _shape(message: dict[str, Any], run_id: uuid.UUID) -> dict[str, Any]:
    """A message with what differs per message (ids, delivery tag, the run id, eta) named instead."""
    body = json.loads(base64.b64decode(message["body"]))
    text = json.dumps({**message, "body": body}).replace(str(run_id), "RUN")
    shaped = json.loads(text)
    task_id = shaped["headers"]["id"]
    for where, key in (("headers", "id"), ("headers", "root_id"), ("properties", "correlation_id")):
        assert shaped[where][key] == task_id
        shaped[where][key] = "TASK"
    shaped["properties"]["delivery_tag"] = "TAG"
    if shaped["headers"]["eta"]:
        shaped["headers"]["eta"] = datetime.fromisoformat(shaped["headers"]["eta"])
    return shaped


@pytest.mark.parametrize("job_id, countdown", [
    ("test.three-steps", 0.0),
    ("test.three-steps", 30.0),      # a retry's backoff: an eta header
    ("test.msg-urgent", 0.0),        # the job's priority and time limits
    ("test.msg-own-queue", 0.0),     # the job's own queue
])
def test_a_message_pushed_the_short_way_is_the_message_send_task_writes(
    app: Celery, sent: list[str], broker: redis.Redis, job_id: str, countdown: float,
) -> None:
    publish = publisher(app)
    queue = OWN_QUEUE if job_id == "test.msg-own-queue" else app.conf.task_default_queue
    broker.delete(queue)  # what an earlier test of this session left on the session's queue is not ours
    first, second = uuid.uuid4(), uuid.uuid4()
    publish(first, job_id, countdown)   # the queue's first message here: send_task, which declares it
    publish(second, job_id, countdown)  # then the short way
    assert sent == [f"motir.{job_id}"]
    # Redis inverts priority (0 first): 8 becomes 1, kombu's list of priority step 0 is the queue's own.
    by_send_task, by_lane = _drain(broker, queue)
    long_way, short_way = _shape(by_send_task, first), _shape(by_lane, second)
    if countdown:
        etas = [long_way["headers"].pop("eta"), short_way["headers"].pop("eta")]
        assert abs((etas[1] - etas[0]).total_seconds()) < 5
        assert 20 < (etas[1] - datetime.now(timezone.utc)).total_seconds() <= 30
    assert short_way == long_way
    if job_id == "test.msg-urgent":
        assert short_way["properties"]["priority"] == 1
        assert short_way["headers"]["timelimit"] == [30, 20]


def test_a_priority_past_the_first_step_goes_to_the_same_list_both_ways(
    app: Celery, sent: list[str], broker: redis.Redis,
) -> None:
    publish = publisher(app)
    publish(uuid.uuid4(), "test.msg-low", 0.0)  # priority 2 is Redis priority 7: kombu's list of step 6
    publish(uuid.uuid4(), "test.msg-low", 0.0)
    assert len(sent) == 1
    key = f"{app.conf.task_default_queue}\x06\x166"
    assert [m["properties"]["priority"] for m in _drain(broker, key)] == [7, 7]


def test_a_publish_signal_receiver_sends_every_message_through_send_task(
    app: Celery, sent: list[str], broker: redis.Redis,
) -> None:
    seen: list[str] = []

    def receiver(sender: str, headers: dict[str, Any], **kwargs: Any) -> None:
        seen.append(headers["id"])

    signals.before_task_publish.connect(receiver)
    try:
        publish = publisher(app)
        for _ in range(3):
            publish(uuid.uuid4(), "test.three-steps", 0.0)
    finally:
        signals.before_task_publish.disconnect(receiver)
    assert len(sent) == 3 and len(seen) == 3  # a tracing library's headers are never skipped
    assert len(_drain(broker, app.conf.task_default_queue)) == 3


def test_a_push_redis_refuses_is_sent_through_send_task_and_logged(
    app: Celery, sent: list[str], broker: redis.Redis, caplog: pytest.LogCaptureFixture,
) -> None:
    from motir_celery.adapter import messages

    publish = publisher(app)
    publish(uuid.uuid4(), "test.three-steps", 0.0)
    lane = messages.redis_lane(app)
    assert lane is not None

    def refuse(*args: Any) -> None:
        raise redis.ConnectionError("connection refused")

    lane.client.lpush = refuse  # type: ignore[method-assign]
    run_id = uuid.uuid4()
    with caplog.at_level(logging.WARNING, "motir_celery.adapter.messages"):
        publish(run_id, "test.three-steps", 0.0)
    assert len(sent) == 2
    assert f"pushing run {run_id} to Redis failed" in caplog.text
    bodies = [base64.b64decode(m["body"]) for m in _drain(broker, app.conf.task_default_queue)]
    assert str(run_id).encode() in bodies[1]


@pytest.mark.parametrize("change", [
    {"broker_write_url": "amqp://guest@localhost//"},
    {"broker_write_url": "redis://127.0.0.1:6379/0;redis://127.0.0.1:6380/0"},   # failover
    {"broker_transport_options": {"global_keyprefix": "tenant-a:"}},
    {"broker_transport_options": {"priority_steps": list(range(10))}},
    {"broker_use_ssl": {"ssl_cert_reqs": "required"}},
    {"task_serializer": "pickle"},
    {"task_compression": "gzip"},
])
def test_a_broker_setting_that_changes_how_messages_are_written_rules_the_short_way_out(
    change: dict[str, Any],
) -> None:
    app = Celery("other", set_as_current=False)
    app.conf.broker_write_url = "redis://127.0.0.1:6379/0"
    assert RedisLane.for_app(app) is not None
    app.conf.update(change)
    assert RedisLane.for_app(app) is None


def test_an_engine_with_direct_publish_off_sends_every_message_through_send_task(
    broker_url: str, broker: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Tuning(direct_publish=False)`` (was MOTIR_DIRECT_PUBLISH=0): an app the short way would
    serve has no lane, and every message, not only a queue's first, goes through send_task."""
    app = create_app(engine=Engine(Settings.from_env(), tuning=Tuning(direct_publish=False)))
    assert RedisLane.for_app(app) is not None  # the broker would allow it: the tuning rules it out
    assert redis_lane(app, engine_of(app).tuning.direct_publish) is None
    sent = _spy(app, monkeypatch)
    publish = publisher(app)
    broker.delete(app.conf.task_default_queue)
    for _ in range(3):
        publish(uuid.uuid4(), "test.three-steps", 0.0)
    assert sent == ["motir.test.three-steps"] * 3
    assert len(_drain(broker, app.conf.task_default_queue)) == 3


def test_runs_published_the_short_way_run_on_a_real_worker(
    engine: Any, app: Celery, sent: list[str], tmp_path: Any,
) -> None:
    with celery_worker(tmp_path, broker=app.conf.broker_url):
        run_ids = [send_event("test.three", {"i": i}, app=app).run_ids[0] for i in range(5)]
        for run_id in run_ids:
            wait_for(lambda: run_state(engine, run_id) == "succeeded", what=f"run {run_id}")
    assert sent == ["motir.test.three-steps"]  # the first declared the queue; four went the short way
