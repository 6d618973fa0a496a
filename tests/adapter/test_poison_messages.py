"""Nothing in a message can end a worker (issue 24, item 4): the inbound guard (``adapter/guard.py``).

Real ``celery -A motir_celery worker`` processes on the real brokers:

* the finding's own items (a list as ``headers.task``, a ``timelimit`` of ``"xyz"``)
  are moved to ``<queue>.malformed`` with an ERROR line naming why, the worker
  goes on, and a restart does not find them back on the queue (kombu used to
  restore them at shutdown: a crash on every start);
* a seeded fuzz (``MOTIR_FUZZ_SEED`` reproduces a failure; ``MOTIR_FUZZ_ITEMS``
  sizes it) pushes thousands of generated items — raw bytes, JSON of every
  shape, kombu envelopes with a wrong type in a field, Celery messages with a
  wrong type in a header or the body — between real runs: the worker keeps its
  pid and consumes to the end, every run completes once, and every item is
  accounted for: moved aside, or a well-formed message Celery (or the task)
  handled with an ERROR or WARNING line naming it;
* the same on RabbitMQ, where the finding ended the worker and redelivered the
  message on every restart too;
* in process: ``task_problem`` field by field, and each kombu internal the guard
  leans on (a kombu without it fails these tests).
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import signal
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import amqp  # type: ignore[import-untyped]
import pytest
import redis
from kombu import Connection, Consumer, Exchange, Queue
from kombu.transport import pyamqp as kombu_amqp
from kombu.transport import redis as kombu_redis
from kombu.transport.virtual import Message as VirtualMessage

import tests.fixtures.jobs  # noqa: F401  (test.three-steps, for send_event)
from motir_celery import send_event
from motir_celery.adapter import guard
from motir_celery.adapter.celery_app import create_app
from motir_celery.adapter.guard import MALFORMED_HEADER, MALFORMED_SUFFIX, task_problem
from motir_celery.settings import Settings
from tests.conftest import Worker, celery_worker, count_effects, run_state, wait_for

#: The finding's item, byte for byte (issue 24): protocol 2, ``headers.task`` a list.
FINDING = (b'{"body":"W1sieCJdLHt9LHt9XQ==","content-type":"application/json","content-encoding":"utf-8",'
           b'"headers":{"task":["motir.x"],"id":"1"},"properties":{"delivery_tag":"t","body_encoding":"base64",'
           b'"delivery_info":{"exchange":"","routing_key":"celery"}}}')
#: Its variant: a real task's message with ``headers.timelimit`` = ``"xyz"`` (read by the pool, after the callback).
TIMELIMIT = FINDING.replace(b'{"task":["motir.x"],"id":"1"}',
                            b'{"task":"motir.test.three-steps","id":"2","timelimit":"xyz"}')


@pytest.fixture
def client(broker_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(broker_url)
    yield c
    c.close()


def _succeeded(engine: Any, run_id: object, timeout: float = 30.0) -> None:
    wait_for(lambda: run_state(engine, run_id) == "succeeded", timeout=timeout, what=f"run {run_id} to succeed")


def _stop(worker: Worker) -> int:
    worker.kill(signal.SIGTERM)
    return worker.proc.wait(timeout=30)


def _restored_finding(client: redis.Redis) -> list[bytes]:
    """Copies of FINDING that kombu restored to the list its delivery_info names ('celery')."""
    return [m for m in client.lrange("celery", 0, -1) if b'"task": ["motir.x"]' in m and b'W1sieCJdLHt9LHt9XQ==' in m]


# --- the finding ----------------------------------------------------------------------


def test_the_findings_items_are_moved_aside_the_worker_goes_on_and_a_restart_does_not_find_them_back(
        engine: Any, broker_url: str, queue: str, client: redis.Redis, tmp_path: Path) -> None:
    """Before the guard: Unrecoverable error, exit 1, "Restoring 1 unacknowledged message(s)", on every start."""
    whys = {FINDING: "headers.task is ['motir.x'], not a task name",
            TIMELIMIT: "headers.timelimit is 'xyz', not [hard, soft] in seconds (numbers or null)"}
    try:
        with celery_worker(tmp_path, broker=broker_url, concurrency=1, name="first") as first:
            pid = first.proc.pid
            client.lpush(queue, FINDING, TIMELIMIT)
            (run_id,) = send_event("test.three", {}).run_ids  # behind them on the same list
            _succeeded(engine, run_id)
            assert first.proc.poll() is None and first.proc.pid == pid, first.output()[-3000:]
            assert _stop(first) == 0  # a warm shutdown: kombu restores what is unacknowledged
        log = first.output()
        assert "Unrecoverable error" not in log and "Restoring" not in log
        lines = [ln for ln in log.splitlines() if "a malformed message on queue" in ln]
        assert len(lines) == 2
        for line, (item, why) in zip(lines, whys.items()):
            assert line.split("] ", 1)[1] == (f"a malformed message on queue {queue!r} was moved to the Redis list "
                                              f"'{queue}{MALFORMED_SUFFIX}': {why}; the item: {item[:200]!r}")
            assert "ERROR/MainProcess" in line
        assert client.lrange(queue + MALFORMED_SUFFIX, 0, -1) == [TIMELIMIT, FINDING]  # their own bytes, newest first
        assert client.llen(queue) == 0 and _restored_finding(client) == []
        assert count_effects(engine, run_id) == 3
        with celery_worker(tmp_path, broker=broker_url, concurrency=1, name="second") as second:
            (run_id,) = send_event("test.three", {}).run_ids
            _succeeded(engine, run_id)
            assert _stop(second) == 0
        assert "a malformed message" not in second.output() and "Unrecoverable error" not in second.output()
        assert client.llen(queue + MALFORMED_SUFFIX) == 2
    finally:
        for restored in _restored_finding(client):  # only if the guard failed: kombu put it on 'celery'
            client.lrem("celery", 0, restored)


# --- the fuzz -------------------------------------------------------------------------

#: Values of every JSON type, each wrong for some field (and right for a few: then Celery handles the message).
WRONG: list[Any] = [None, True, False, 0, -1, 7, 3.5, 1e308, "", "xyz", "\ud800", "9" * 40, [], ["x"], [1, [2, [3]]],
                    {}, {"a": {"b": None}}, [[None]]]
HEADER_FIELDS = ["task", "id", "shadow", "root_id", "parent_id", "group", "group_index", "lang", "argsrepr",
                 "kwargsrepr", "origin", "eta", "expires", "retries", "timelimit", "ignore_result",
                 "replaced_task_nesting", "stamped_headers", "stamps", "meth", "x-custom"]
ENVELOPE_FIELDS = ["body", "content-type", "content-encoding", "headers", "properties", "properties.delivery_tag",
                   "properties.body_encoding", "properties.delivery_info", "properties.priority",
                   "properties.correlation_id", "properties.reply_to", "properties.delivery_mode",
                   "properties.delivery_info.exchange", "properties.delivery_info.routing_key", "headers.compression"]
CONTENT_TYPES = ["application/x-python-serialize", "application/x-yaml", "application/x-msgpack", "application/data",
                 "application/text", "text/plain", "", "application/json; charset=utf-8"]
REGISTERED, UNKNOWN = "motir.test.three-steps", "fuzz.unknown-task"


class Fuzz:
    """Seeded items for one queue; each carries a marker (``fz<seed>-<n>x``) to account for it."""

    def __init__(self, seed: int, queue: str) -> None:
        self.rng, self.seed, self.queue, self.n = random.Random(seed), seed, queue, 0
        self.kinds: dict[str, str] = {}  # marker -> the family and the change made

    def _marker(self, kind: str) -> str:
        self.n += 1
        marker = f"fz{self.seed}-{self.n:05d}x"
        self.kinds[marker] = kind
        return marker

    def _value(self, depth: int = 0) -> Any:
        rng = self.rng
        if depth >= 3 or rng.random() < 0.5:
            return rng.choice(WRONG)
        if rng.random() < 0.5:
            return [self._value(depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice(["a", "body", "headers", "properties", "task", "id", "args"]): self._value(depth + 1)
                for _ in range(rng.randrange(4))}

    def message(self, marker: str, task: str) -> tuple[dict[str, Any], list[Any]]:
        """A well-formed Celery message (kombu's Redis envelope) for ``task``, its body apart."""
        headers = {
            "lang": "py", "task": task, "id": marker, "shadow": None, "eta": None, "expires": None, "group": None,
            "group_index": None, "retries": 0, "timelimit": [None, None], "root_id": marker, "parent_id": None,
            "argsrepr": repr([marker]), "kwargsrepr": "{}", "origin": "fuzz", "ignore_result": False,
            "replaced_task_nesting": 0, "stamped_headers": None, "stamps": {}, "x-fuzz": marker,
        }
        body = [[marker], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
        envelope = {
            "body": None, "content-encoding": "utf-8", "content-type": "application/json", "headers": headers,
            "properties": {"correlation_id": marker, "reply_to": "fuzz", "delivery_mode": 2,
                           "delivery_info": {"exchange": "", "routing_key": self.queue}, "priority": 0,
                           "body_encoding": "base64", "delivery_tag": str(uuid.UUID(int=self.rng.getrandbits(128)))},
            "fuzz": marker,  # kombu ignores it; it names the item in the malformed list
        }
        return envelope, body

    @staticmethod
    def _encode(envelope: dict[str, Any], body: Any) -> bytes:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        if "body" in envelope and envelope["body"] is None:  # not set (or deleted) by a change
            envelope = {**envelope, "body": base64.b64encode(raw).decode()}
        return json.dumps(envelope).encode()

    def raw(self) -> bytes:
        rng, marker = self.rng, self._marker("raw bytes")
        kind = rng.randrange(3)
        if kind == 0:
            noise = bytes(rng.getrandbits(8) for _ in range(rng.randrange(200)))
            at = rng.randrange(len(noise) + 1)
            return noise[:at] + marker.encode() + noise[at:]
        if kind == 1:  # a good envelope cut short
            good = self._encode(*self.message(marker, REGISTERED))
            return good[: 1 + int(rng.random() * (len(good) - 2))] + marker.encode()  # (no draw depends on the queue's name)
        return b"\xff\xfe" + marker.encode() + bytes(rng.getrandbits(8) for _ in range(rng.randrange(40)))

    def json_shape(self) -> bytes:
        rng, marker = self.rng, self._marker("JSON shape")
        shapes: list[Any] = [
            marker, [marker, self._value()], {"m": marker, "x": self._value()},
            {"properties": self._value(), "m": marker},
            {"properties": {"delivery_tag": self._value()}, "body": self._value(), "m": marker},
            {"properties": {"delivery_tag": "t"}, "headers": self._value(), "m": marker},
            {"properties": {"delivery_tag": "t"}, "m": marker},
            {"properties": {"delivery_tag": "t", "body_encoding": "base64"}, "body": "@@not base64@@", "m": marker},
        ]
        return json.dumps(rng.choice(shapes)).encode()

    def envelope(self) -> bytes:
        rng = self.rng
        field = rng.choice(ENVELOPE_FIELDS)
        value: Any = rng.choice(WRONG)
        if field == "content-type" and rng.random() < 0.6:
            value = rng.choice(CONTENT_TYPES)
        if field == "headers.compression" and rng.random() < 0.6:
            value = rng.choice(["application/x-gzip", "zlib", "application/x-bz2"])
        if field == "body" and rng.random() < 0.5:  # base64, of bytes that are not JSON
            value = base64.b64encode(rng.randbytes(20)).decode()
        delete = rng.random() < 0.15
        marker = self._marker(f"envelope {'without' if delete else 'with'} {field}{'' if delete else f' = {value!r}'}")
        envelope, body = self.message(marker, rng.choice([REGISTERED, UNKNOWN]))
        envelope = json.loads(json.dumps(envelope))
        if field == "body":
            envelope["body"] = value
            if delete:
                del envelope["body"]
        else:
            *parents, last = field.split(".")
            if field != "headers.compression":
                envelope["body"] = base64.b64encode(json.dumps(body).encode()).decode()
            target = envelope
            for parent in parents:
                target = target[parent]
            if delete:
                target.pop(last, None)
            else:
                target[last] = value
        return self._encode(envelope, body)

    def celery(self) -> bytes:
        rng = self.rng
        where = rng.random()
        value: Any = rng.choice(WRONG)
        if where < 0.6:
            field = rng.choice(HEADER_FIELDS)
            delete = field in ("task", "id") and rng.random() < 0.2
            marker = self._marker(f"headers {'without' if delete else 'with'} {field}{'' if delete else f' = {value!r}'}")
            envelope, body = self.message(marker, rng.choice([REGISTERED, UNKNOWN]))
            if delete:
                del envelope["headers"][field]
            else:
                envelope["headers"][field] = value
            return self._encode(envelope, body)
        change = rng.choice(["args", "kwargs", "embed", "callbacks", "errbacks", "chain", "chord", "shape",
                             "not json", "hybrid", "protocol 1"])
        marker, task = self._marker(f"body with {change} = {value!r}"), rng.choice([REGISTERED, UNKNOWN])
        envelope, body = self.message(marker, task)
        if change in ("args", "kwargs", "embed"):
            body[["args", "kwargs", "embed"].index(change)] = value
        elif change in ("callbacks", "errbacks", "chain", "chord"):
            body[2][change] = value
        elif change == "shape":
            body = rng.choice([value, body[:2], body + [None], {"a": body}])
        elif change == "not json":
            return self._encode(envelope, b"[[" + marker.encode() + b"], {}, {")
        elif change == "hybrid":  # protocol 2 headers, a protocol 1 body with a wrong field
            body = {"args": [marker], "kwargs": {}, rng.choice(["timelimit", "eta", "callbacks", "kwargs"]): value}
        else:  # protocol 1: the task's fields in the body, one of them wrong
            del envelope["headers"]["task"]
            body = {"task": task, "id": marker, "args": [marker], "kwargs": {},
                    rng.choice(["task", "id", "timelimit", "eta", "args"]): value}
        return self._encode(envelope, body)

    def item(self) -> bytes:
        family = self.rng.choices([self.raw, self.json_shape, self.envelope, self.celery], [15, 15, 30, 40])[0]
        return family()


_RECORD = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+: (\w+)/[^\]]+\] ", re.M)


def _records(log: str) -> Iterator[tuple[str, str]]:
    """(level, text) of each log record (a record runs to the next one: tracebacks, Celery's dumps)."""
    starts = list(_RECORD.finditer(log))
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(log)
        yield match.group(1), log[match.start():end]


_MARKER = re.compile(r"fz\d+-\d+x")
_DROPPED = "dropping message with a malformed run id"  # the task's WARNING (core/runner.py), which names no task id


def _account(log: str, aside: list[bytes], markers: list[str]) -> tuple[set[str], set[str], int]:
    """The markers moved aside (in the malformed list); those handled with an ERROR/WARNING naming them, or
    by the task, which drops a run id that is not one with a WARNING and returns ``skipped``; and how many
    such WARNINGs there are (one per drop)."""
    moved = {m for item in aside for m in _MARKER.findall(item.decode("utf-8", "replace"))}
    handled: set[str] = set()
    drops = 0
    for level, text in _records(log):
        if level in ("WARNING", "ERROR", "CRITICAL") and "a malformed message on queue" not in text:
            handled.update(_MARKER.findall(text))
            drops += _DROPPED in text
        elif level == "INFO" and "succeeded in" in text and "'state': 'skipped', 'detail': 'malformed run id'" in text:
            handled.update(_MARKER.findall(text.split("succeeded in")[0]))  # Task <name>[<id>] succeeded in ...
    wanted = set(markers)
    return moved & wanted, (handled & wanted) - moved, drops


def test_a_worker_survives_thousands_of_generated_items_and_runs_every_run_among_them_once(
        engine: Any, broker_url: str, queue: str, client: redis.Redis, tmp_path: Path) -> None:
    seed = int(os.environ.get("MOTIR_FUZZ_SEED", "2024"))
    count = int(os.environ.get("MOTIR_FUZZ_ITEMS", "3000"))
    fuzz, aside, markers, run_ids = Fuzz(seed, queue), [], [], []
    started = time.monotonic()
    pool = os.environ.get("MOTIR_FUZZ_POOL", "prefork")
    with celery_worker(tmp_path, broker=broker_url, concurrency=2, pool=pool) as worker:
        pid = worker.proc.pid

        def drained() -> bool:
            assert worker.proc.poll() is None, f"seed {seed}: the worker ended\n{worker.output()[-4000:]}"
            return client.llen(queue) == 0

        chunk = 250  # the list keeps the newest 1,000: drained between chunks
        for start in range(0, count, chunk):
            pipe = client.pipeline(transaction=False)
            for i in range(start, min(start + chunk, count)):
                pipe.lpush(queue, fuzz.item())
                if i % 40 == 0:
                    pipe.execute()
                    run_ids.extend(send_event("test.three", {"i": i}).run_ids)  # a real run between them
            pipe.execute()
            wait_for(drained, timeout=60, what="the queue to drain")
            aside.extend(_drain(client, queue + MALFORMED_SUFFIX))
        markers = list(fuzz.kinds)
        for run_id in run_ids:
            _succeeded(engine, run_id, timeout=60)

        def accounted() -> bool:
            aside.extend(_drain(client, queue + MALFORMED_SUFFIX))
            moved, handled, _ = _account(worker.output(), aside, markers)
            return len(moved) + len(handled) == len(markers)

        try:
            wait_for(accounted, timeout=20, interval=0.5, what="every item to be moved aside or handled")
        except AssertionError:
            moved, handled, _ = _account(worker.output(), aside, markers)
            lost = [f"{m}: {fuzz.kinds[m]}" for m in markers if m not in moved | handled]
            raise AssertionError(f"seed {seed}: {len(lost)} items vanished silently:\n" + "\n".join(lost[:30])) from None
        (last,) = send_event("test.three", {"last": True}).run_ids  # still consuming at the end
        _succeeded(engine, last)
        assert worker.proc.poll() is None and worker.proc.pid == pid
        assert _stop(worker) == 0
        log = worker.output()
    elapsed = time.monotonic() - started
    assert "Unrecoverable error" not in log and "Restoring" not in log, log[-3000:]
    assert client.llen(queue) == 0  # nothing restored at shutdown
    assert [count_effects(engine, r) for r in run_ids + [last]] == [3] * (len(run_ids) + 1)  # each step once
    moved, handled, drops = _account(log, aside, markers)
    skipped = len(re.findall(r"succeeded in [^\n]*'state': 'skipped', 'detail': 'malformed run id'", log))
    assert drops == skipped  # each run id the task dropped has its WARNING
    guard_lines = sum(1 for level, text in _records(log) if "a malformed message on queue" in text and level == "ERROR")
    assert guard_lines == len(aside) == len(moved), (guard_lines, len(aside), len(moved))
    print(f"\nfuzz seed {seed}: {len(markers)} items, {len(moved)} moved aside, {len(handled)} handled by Celery "
          f"or the task with an ERROR/WARNING line ({drops} run ids dropped by the task), "
          f"{len(run_ids) + 1} runs once each, {elapsed:.1f}s")


def _drain(client: redis.Redis, key: str) -> list[bytes]:
    """Everything in a list, emptied in the same transaction (the worker keeps pushing)."""
    pipe = client.pipeline(transaction=True)
    pipe.lrange(key, 0, -1)
    pipe.delete(key)
    items, _ = pipe.execute()
    return list(items)


# --- RabbitMQ -------------------------------------------------------------------------


@pytest.fixture
def amqp_queue(amqp_url: str, broker_url: str) -> Iterator[str]:
    """The session's queue on RabbitMQ (the worker declares it); its malformed queue deleted after."""
    name = os.environ["MOTIR_QUEUE"]
    yield name
    with Connection(amqp_url) as conn:
        channel = conn.channel()
        channel.queue_delete(name + MALFORMED_SUFFIX)
        channel.queue_delete(name, if_empty=False)  # the next worker declares it again


def _amqp_publish(amqp_url: str, queue: str, messages: list[tuple[bytes, dict[str, Any], str | None, str | None]]) -> None:
    """(body, headers, content type, content encoding), published as they are to the queue's own binding."""
    with Connection(amqp_url) as conn:
        channel = conn.default_channel
        for body, headers, content_type, encoding in messages:
            channel.basic_publish(amqp.Message(body, application_headers=headers, content_type=content_type,
                                               content_encoding=encoding, delivery_mode=2),
                                  exchange="", routing_key=queue)


def _amqp_aside(amqp_url: str, queue: str) -> list[tuple[dict[str, Any], bytes]]:
    """The (headers, body) of every message moved to ``<queue>.malformed``, taken off it."""
    taken = []
    with Connection(amqp_url) as conn:
        channel = conn.default_channel
        while (message := channel.basic_get(queue + MALFORMED_SUFFIX, no_ack=True)) is not None:
            taken.append((dict(message.headers), message.body))
    return taken


def test_on_rabbitmq_the_findings_message_is_moved_aside_and_not_redelivered_on_restart(
        engine: Any, amqp_url: str, amqp_queue: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the guard: Unrecoverable error, exit 1, and RabbitMQ redelivered it to every restart."""
    monkeypatch.setenv("CELERY_BROKER_URL", amqp_url)
    app = create_app(Settings.from_env())
    assert app.conf.broker_transport == guard.GUARDED_AMQP_TRANSPORT
    finding = (b'[["x"], {}, {}]', {"task": ["motir.x"], "id": "1"}, "application/json", "utf-8")
    timelimit = (b'[["x"], {}, {}]', {"task": "motir.test.three-steps", "id": "2", "timelimit": "xyz"},
                 "application/json", "utf-8")
    with celery_worker(tmp_path, broker=amqp_url, concurrency=1, name="first") as first:
        _amqp_publish(amqp_url, amqp_queue, [finding, timelimit])
        (run_id,) = send_event("test.three", {}, app=app).run_ids
        _succeeded(engine, run_id)
        assert first.proc.poll() is None, first.output()[-3000:]
        assert _stop(first) == 0
    with celery_worker(tmp_path, broker=amqp_url, concurrency=1, name="second") as second:
        (run_id,) = send_event("test.three", {}, app=app).run_ids
        _succeeded(engine, run_id)
        assert _stop(second) == 0
    log = first.output()
    assert "Unrecoverable error" not in log
    lines = [ln for ln in log.splitlines() if "a malformed message on queue" in ln]
    assert len(lines) == 2 and all(f"moved to the RabbitMQ queue '{amqp_queue}{MALFORMED_SUFFIX}'" in ln for ln in lines)
    assert "a malformed message" not in second.output()  # not redelivered
    aside = _amqp_aside(amqp_url, amqp_queue)
    assert [(h["task"], h[MALFORMED_HEADER]) for h, _ in aside] == [
        (["motir.x"], "headers.task is ['motir.x'], not a task name"),
        ("motir.test.three-steps", "headers.timelimit is 'xyz', not [hard, soft] in seconds (numbers or null)"),
    ]


def _amqp_items(fuzz: Fuzz, count: int) -> list[tuple[bytes, dict[str, Any], str | None, str | None]]:
    """AMQP carries headers as a typed table: what the fuzz varies there is the headers and the body."""
    items = []
    rng = fuzz.rng
    for _ in range(count):
        envelope = json.loads(fuzz.celery() if rng.random() < 0.7 else fuzz.envelope())
        marker = envelope.get("fuzz") or _MARKER.findall(json.dumps(envelope))[0]
        try:
            body = base64.b64decode(envelope.get("body") or "", validate=True)
        except (ValueError, TypeError):
            body = json.dumps(envelope.get("body")).encode()
        headers = envelope.get("headers")
        headers = dict(headers) if isinstance(headers, dict) else {"x-headers": headers}
        headers["x-fuzz"] = marker
        content_type = envelope.get("content-type")
        items.append((body, headers, content_type if isinstance(content_type, str) else "application/json", "utf-8"))
    for _ in range(count // 10):  # bodies that are not messages
        raw = fuzz.raw() if rng.random() < 0.5 else fuzz.json_shape()
        (marker,) = _MARKER.findall(raw.decode("utf-8", "replace"))[:1] or ["?"]
        items.append((raw, {"x-fuzz": marker}, "application/json", "utf-8"))
    rng.shuffle(items)
    return [(b, json.loads(json.dumps(h).replace("\\ud800", "?")), t, e) for b, h, t, e in items]


def test_on_rabbitmq_a_worker_survives_generated_messages_and_runs_the_runs_among_them(
        engine: Any, amqp_url: str, amqp_queue: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seed = int(os.environ.get("MOTIR_FUZZ_SEED", "2024"))
    fuzz = Fuzz(seed, amqp_queue)
    items = _amqp_items(fuzz, int(os.environ.get("MOTIR_FUZZ_AMQP_ITEMS", "500")))
    monkeypatch.setenv("CELERY_BROKER_URL", amqp_url)
    app = create_app(Settings.from_env())
    markers = [h["x-fuzz"] for _, h, _, _ in items]
    with celery_worker(tmp_path, broker=amqp_url, concurrency=2) as worker:
        pid, run_ids, aside = worker.proc.pid, [], []
        for start in range(0, len(items), 50):
            _amqp_publish(amqp_url, amqp_queue, items[start:start + 50])
            run_ids.extend(send_event("test.three", {"i": start}, app=app).run_ids)
        for run_id in run_ids:
            _succeeded(engine, run_id, timeout=60)

        def accounted() -> bool:
            aside.extend(_amqp_aside(amqp_url, amqp_queue))
            moved, handled, _ = _account(worker.output(), [repr(a).encode() for a in aside], markers)
            return len(moved) + len(handled) == len(set(markers))

        try:
            wait_for(accounted, timeout=30, interval=0.5, what="every message to be moved aside or handled")
        except AssertionError:
            moved, handled, _ = _account(worker.output(), [repr(a).encode() for a in aside], markers)
            lost = [f"{m}: {fuzz.kinds.get(m)}" for m in markers if m not in moved | handled]
            raise AssertionError(f"seed {seed}: {len(lost)} messages vanished silently:\n" + "\n".join(lost[:30])) from None
        assert worker.proc.poll() is None and worker.proc.pid == pid
        assert _stop(worker) == 0
        log = worker.output()
    assert "Unrecoverable error" not in log
    assert [count_effects(engine, r) for r in run_ids] == [3] * len(run_ids)
    assert all(h.get(MALFORMED_HEADER) for h, _ in aside)  # each names why
    print(f"\namqp fuzz seed {seed}: {len(items)} messages, {len(aside)} moved aside, {len(run_ids)} runs once each")


# --- in process: what the guard checks ------------------------------------------------

ACCEPT = {"application/json"}


def _celery_message(protocol: int = 2, **options: Any) -> Any:
    """A kombu message as Celery's own producer builds it (``create_task_message``)."""
    from celery import Celery
    from kombu.message import Message

    app = Celery("poison", set_as_current=False)
    app.conf.task_protocol = protocol
    built = app.amqp.create_task_message(str(uuid.uuid4()), "motir.test.three-steps", [str(uuid.uuid4())], {},
                                         time_limit=30, soft_time_limit=20, **options)
    body = json.dumps(built.body).encode()
    return Message(body=body, content_type="application/json", content_encoding="utf-8", headers=built.headers,
                   properties={**built.properties, "delivery_info": {"exchange": "", "routing_key": "q"}},
                   delivery_info={"exchange": "", "routing_key": "q"}, delivery_tag="t")


def _message(headers: dict[str, Any] | None = None, body: Any = None, *, raw: bytes | None = None,
             content_type: str = "application/json", **changes: Any) -> Any:
    from kombu.message import Message

    message = _celery_message()
    if headers is not None:
        message.headers = {**message.headers, **headers}
        for name in [k for k, v in headers.items() if v is _GONE]:
            del message.headers[name]
    if body is not None or raw is not None:
        message = Message(body=raw if raw is not None else json.dumps(body).encode(), content_type=content_type,
                          content_encoding="utf-8", headers=message.headers, properties=message.properties,
                          delivery_info=message.delivery_info, delivery_tag="t")
    for name, value in changes.items():
        setattr(message, name, value)
    return message


_GONE = object()


@pytest.mark.parametrize("protocol", [1, 2])
def test_a_message_celery_builds_has_no_problem(protocol: int) -> None:
    assert task_problem(_celery_message(protocol), ACCEPT) is None
    assert task_problem(_celery_message(protocol, countdown=30, expires=60, retries=2), ACCEPT) is None


@pytest.mark.parametrize("field, value, why", [
    ("task", ["motir.x"], "headers.task is ['motir.x'], not a task name"),
    ("task", "", "headers.task is '', not a task name"),
    ("task", _GONE, None),  # then the body is protocol 2's list: a message that names no task
    ("id", 1, "headers.id is 1, not a task id (a string)"),
    ("id", _GONE, "headers has no 'id'"),
    ("timelimit", "xyz", "headers.timelimit is 'xyz', not [hard, soft]"),
    ("timelimit", ["a", None], "headers.timelimit is ['a', None]"),
    ("timelimit", [1, 2, 3], "headers.timelimit is [1, 2, 3]"),
    ("timelimit", [-1, None], "headers.timelimit is [-1, None]"),
    ("eta", "not a time", "headers.eta is 'not a time', not an ISO 8601 time or null"),
    ("eta", 1700000000, "headers.eta is 1700000000"),
    ("eta", "", "headers.eta is ''"),  # Celery's Request parses it to None, then fails on None's tzinfo
    ("expires", ["2030-01-01"], "headers.expires is ['2030-01-01']"),
    ("retries", "3", "headers.retries is '3', not a count or null"),
    ("retries", True, "headers.retries is True"),
    ("root_id", {}, "headers.root_id is {}"),
    ("parent_id", 5, "headers.parent_id is 5"),
    ("group", [], "headers.group is []"),
    ("group_index", "0", "headers.group_index is '0'"),
    ("shadow", 1, "headers.shadow is 1"),
    ("argsrepr", [], "headers.argsrepr is []"),
    ("kwargsrepr", {}, "headers.kwargsrepr is {}"),
    ("origin", 0, "headers.origin is 0"),
    ("lang", 0, "headers.lang is 0"),
    ("ignore_result", "no", "headers.ignore_result is 'no'"),
    ("replaced_task_nesting", "1", "headers.replaced_task_nesting is '1'"),
    ("stamped_headers", "abc", "headers.stamped_headers is 'abc'"),
    ("stamps", [], "headers.stamps is []"),
])
def test_a_header_of_the_wrong_type_is_named(field: str, value: Any, why: str | None) -> None:
    problem = task_problem(_message({field: value}), ACCEPT)
    assert problem is not None
    assert problem.startswith(why or "it names no task"), problem


@pytest.mark.parametrize("body, why", [
    ({"a": 1}, "its body is {'a': 1}, not [args, kwargs, embed]"),
    ([["x"], {}], "its body is [['x'], {}], not [args, kwargs, embed]"),
    (7, "its body is 7, not [args, kwargs, embed]"),
    (["x", {}, {}], "the body's args is 'x', not a list"),
    ([[], [], {}], "the body's kwargs is [], not an object"),
    ([[], {}, []], "the body's embed is [], not an object"),
    ([[], {}, {"callbacks": "x"}], "embed.callbacks is 'x', not a list of signatures or null"),
    ([[], {}, {"errbacks": [1]}], "embed.errbacks is [1]"),
    ([[], {}, {"chain": {}}], "embed.chain is {}"),
    ([[], {}, {"chord": []}], "embed.chord is []"),
    ({"args": [], "timelimit": "xyz"}, "body.timelimit is 'xyz'"),  # hybrid: a protocol 1 body under protocol 2 headers
    ({"args": "x"}, "the body's args is 'x', not a list"),
])
def test_a_body_of_the_wrong_shape_is_named(body: Any, why: str) -> None:
    problem = task_problem(_message(body=body), ACCEPT)
    assert problem is not None and problem.startswith(why), problem


def test_a_body_that_does_not_decode_or_is_not_accepted_is_named() -> None:
    assert str(task_problem(_message(raw=b"[[1], {}, {"), ACCEPT)).startswith(
        "its body does not decode as 'application/json': DecodeError(")
    pickled = _message(raw=b"\x80\x04K\x01.", content_type="application/x-python-serialize")
    assert task_problem(pickled, ACCEPT) == (
        "its content type 'application/x-python-serialize' is not accepted here (application/json)")
    assert pickled._decoded_cache is None  # refused before anything decoded it
    raw = _message(raw=b"[[], {}, {}]", content_type="application/data")  # kombu hands a "trusted" type over undecoded
    assert task_problem(raw, ACCEPT) == "its body is '[[], {}, {}]', not [args, kwargs, embed]"
    failed = _message()
    failed.errors = [(ValueError, ValueError("bad gzip"), None)]
    assert task_problem(failed, ACCEPT) == "its body could not be decompressed: ValueError('bad gzip')"


def test_properties_of_the_wrong_type_are_named() -> None:
    assert task_problem(_message(content_encoding=5), ACCEPT) == "its content encoding is 5, not a string"
    message = _message()
    message.content_type = ["x"]
    assert task_problem(message, ACCEPT) == "its content type is ['x'], not a string"
    message = _message()
    message.properties = {**message.properties, "correlation_id": ["x"]}
    assert task_problem(message, ACCEPT) == "properties.correlation_id is ['x'], not a string or null"
    message = _message()
    message.properties = {**message.properties, "priority": "high"}
    assert task_problem(message, ACCEPT) == "properties.priority is 'high', not a number or null"
    assert task_problem(_message(delivery_info=["x"]), ACCEPT) == (
        "its properties.delivery_info is ['x'], not an object")


def test_protocol_1_is_checked_in_the_body() -> None:
    message = _celery_message(protocol=1)
    assert "task" not in message.headers
    good = json.loads(message.body)
    assert task_problem(_message({"task": _GONE}, {**good, "timelimit": "xyz"}), ACCEPT) == (
        "body.timelimit is 'xyz', not [hard, soft] in seconds (numbers or null)")
    assert task_problem(_message({"task": _GONE}, {**good, "args": {}}), ACCEPT) == "the body's args is {}, not a list"
    assert task_problem(_message({"task": _GONE}, {"a": 1}), ACCEPT) == (
        "it names no task (no headers.task, and its body is not a protocol 1 task)")


def test_a_decoded_body_is_decoded_once() -> None:
    """The guard decodes under the consumer's accept and kombu memoizes it: Celery reads the same object."""
    message = _message()
    assert task_problem(message, ACCEPT) is None
    assert message.accept == ACCEPT and message.payload is message._decoded_cache is not None


# --- in process: the kombu internals the guard leans on -------------------------------


def test_the_kombu_internals_the_guard_overrides_are_there() -> None:
    """Renamed or gone, the guard's override is never called (and the worker dies of a bad item again)."""
    import inspect

    assert callable(kombu_redis.Channel._brpop_read) and callable(kombu_redis.Channel._create_client)
    assert "asynchronous" in inspect.signature(kombu_redis.Channel._create_client).parameters
    assert list(inspect.signature(kombu_redis.Channel.basic_consume).parameters)[:2] == ["self", "queue"]
    assert "callback" in inspect.signature(kombu_amqp.Channel.basic_consume).parameters
    assert kombu_amqp.Connection.Channel is kombu_amqp.Channel and kombu_amqp.Transport.Connection is kombu_amqp.Connection
    assert kombu_redis.Channel.Message is VirtualMessage


class _Seen:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.messages = fail, []  # type: list[Any]

    def __call__(self, message: Any) -> None:
        self.messages.append(message)
        if self.fail:
            raise TypeError("unhashable type: 'list'")  # what Celery's on_task_received raised
        message.ack()


def _drain_until(conn: Connection, done: Any, timeout: float = 10.0) -> None:
    """Deliver what arrives until ``done()`` (the guard raising here fails the test, as it would end a worker)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out delivering"
        try:
            conn.drain_events(timeout=0.2)
        except TimeoutError:
            pass


@pytest.mark.parametrize("ack_emulation", [False, True], ids=["create_app's", "kombu's default"])
def test_on_redis_a_bad_item_or_a_failing_consumer_is_moved_aside_and_acknowledged(
        broker_url: str, client: redis.Redis, ack_emulation: bool) -> None:
    name = f"poison-{uuid.uuid4().hex[:8]}"
    unacked = f"{name}-unacked"
    options = {"ack_emulation": ack_emulation, "unacked_key": unacked, "unacked_index_key": unacked + "-index"}
    fuzz = Fuzz(7, name)
    good = fuzz._encode(*fuzz.message("fz7-00001x", REGISTERED))
    try:
        with Connection(broker_url, transport=guard.GuardedRedisTransport, transport_options=options) as conn:
            channel = conn.channel()
            queue = Queue(name, Exchange(name, "direct"), routing_key=name)
            seen = _Seen()
            with Consumer(channel, [queue], on_message=seen, accept=["json"]):
                envelope, _ = fuzz.message("fz7-00002x", REGISTERED)
                undecodable = fuzz._encode(envelope, b"[[")  # base64 of a body that is not JSON
                client.lpush(name, b"not json", FINDING, undecodable)
                client.lpush(name, good)
                _drain_until(conn, lambda: seen.messages and client.llen(name + MALFORMED_SUFFIX) == 3)
            assert [m.headers["id"] for m in seen.messages] == ["fz7-00001x"]  # only the good one reached it
            failing = _Seen(fail=True)
            with Consumer(channel, [queue], on_message=failing, accept=["json"]):
                client.lpush(name, good)
                _drain_until(conn, lambda: client.llen(name + MALFORMED_SUFFIX) == 4)
            assert len(failing.messages) == 1 and failing.messages[0].acknowledged
            assert set(channel.qos._delivered) <= channel.qos._dirty  # nothing unacknowledged to restore
        aside = client.lrange(name + MALFORMED_SUFFIX, 0, -1)
        assert len(aside) == 4 and aside[0] == good and aside[2] == FINDING  # newest first
        assert client.hlen(unacked) == 0 and client.zcard(unacked + "-index") == 0  # nothing left to restore
    finally:
        client.delete(name, name + MALFORMED_SUFFIX, unacked, unacked + "-index")


def test_on_redis_the_reason_is_logged_for_each_way_an_item_fails(
        broker_url: str, client: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    name = f"poison-{uuid.uuid4().hex[:8]}"
    items = {
        b"\xff\xfe": "it is not UTF-8 text",
        b"{not json": "it is not JSON (",
        b"[1, 2]": "it is JSON but not an object (list)",
        b'{"properties": {}}': "it is not a kombu envelope: it has no properties.delivery_tag",
        b'{"properties": [1]}': "it is not a kombu envelope: its properties are [1], not an object",
        b'{"properties": {"delivery_tag": "t"}, "headers": "x"}':
            "it is not a kombu envelope: its headers are 'x', not an object",
        b'{"properties": {"delivery_tag": ["t"]}}': "it is not a kombu envelope: TypeError(\"unhashable type: 'list'\")",
        b'{"properties": {"delivery_tag": "t", "body_encoding": "base64"}, "body": "abc"}':
            "it is not a kombu envelope: Error(",
        FINDING: "headers.task is ['motir.x'], not a task name",
    }
    try:
        with Connection(broker_url, transport=guard.GuardedRedisTransport,
                        transport_options={"ack_emulation": False}) as conn:
            with Consumer(conn.channel(), [Queue(name, Exchange(name, "direct"), routing_key=name)],
                          on_message=_Seen(), accept=["json"]), caplog.at_level("ERROR", guard.log.name):
                for item in items:
                    client.lpush(name, item)
                _drain_until(conn, lambda: len([r for r in caplog.records if r.name == guard.log.name]) == len(items))
        lines = [r.getMessage() for r in caplog.records if r.name == guard.log.name]
        assert len(lines) == len(items)
        for line, why in zip(lines, items.values()):
            assert f"a malformed message on queue {name!r} was moved to the Redis list '{name}.malformed': {why}" in line
    finally:
        client.delete(name, name + MALFORMED_SUFFIX)


def test_on_rabbitmq_a_bad_message_or_a_failing_consumer_is_moved_aside_and_acknowledged(
        amqp_url: str, caplog: pytest.LogCaptureFixture) -> None:
    name = f"poison-{uuid.uuid4().hex[:8]}"

    def refused() -> int:
        return len([r for r in caplog.records if r.name == guard.log.name])

    caplog.set_level("ERROR", guard.log.name)
    try:
        with Connection(amqp_url, transport=guard.GuardedAMQPTransport) as conn:
            channel = conn.channel()
            queue = Queue(name, Exchange(name, "direct"), routing_key=name, auto_delete=False)
            queue(channel).declare()
            _amqp_publish(amqp_url, name, [(b'[["x"], {}, {}]', {"task": ["motir.x"], "id": "1"}, "application/json", "utf-8"),
                                           (b"\x80\x04K\x01.", {"task": "t", "id": "2"}, "application/x-python-serialize", "binary")])
            seen = _Seen()
            with Consumer(channel, [queue], on_message=seen, accept=["json"]):
                _drain_until(conn, lambda: refused() == 2)
            assert seen.messages == []
            _amqp_publish(amqp_url, name, [(b'[["x"], {}, {}]', {"task": "t", "id": "3"}, "application/json", "utf-8")])
            failing = _Seen(fail=True)
            with Consumer(channel, [queue], on_message=failing, accept=["json"]):
                _drain_until(conn, lambda: refused() == 3)
            assert len(failing.messages) == 1 and failing.messages[0].acknowledged
        aside = _amqp_aside(amqp_url, name)
        assert sorted(h[MALFORMED_HEADER] for h, _ in aside) == [
            "Celery failed on it: TypeError(\"unhashable type: 'list'\")",
            "headers.task is ['motir.x'], not a task name",
            "its content type 'application/x-python-serialize' is not accepted here (application/json)",
        ]
        with Connection(amqp_url) as conn:
            assert conn.default_channel.queue_declare(name, passive=True).message_count == 0  # acknowledged
    finally:
        with Connection(amqp_url) as conn:
            conn.default_channel.queue_delete(name)
            conn.default_channel.queue_delete(name + MALFORMED_SUFFIX)


@pytest.mark.parametrize("url, transport", [
    ("redis://127.0.0.1:6379/0", guard.GUARDED_REDIS_TRANSPORT),
    ("amqp://guest:guest@127.0.0.1:5672//", guard.GUARDED_AMQP_TRANSPORT),
    ("pyamqp://guest:guest@127.0.0.1:5672//", guard.GUARDED_AMQP_TRANSPORT),
    ("rediss://127.0.0.1:6380/0", None),  # a transport would replace the scheme, and kombu's TLS default with it
    ("amqps://guest:guest@127.0.0.1:5671//", None),
])
def test_create_app_reads_through_the_guard_on_redis_and_rabbitmq(
        url: str, transport: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    from kombu.utils.imports import symbol_by_name

    monkeypatch.setenv("CELERY_BROKER_URL", url)
    assert create_app(Settings.from_env()).conf.broker_transport == transport
    # the path docs/operations.md gave attached apps before the guard had a module of its own
    assert symbol_by_name("motir_celery.adapter.messages:GuardedRedisTransport") is guard.GuardedRedisTransport
