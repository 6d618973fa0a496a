"""Jobs the test workers import (MOTIR_IMPORTS=tests.jobs).

Every step body records its execution in ``test.side_effect`` through a
connection of its own, committed at once, so a body that ran and was then
interrupted still counts: the tests count real executions, not stored results.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg

from motir_celery import NonRetriableError, RetryPolicy, define_job

FAST = RetryPolicy(max_attempts=3, backoff=0.2, factor=1.0, jitter=0.0, name="fast")


def _dsn() -> str:
    url = os.environ["MOTIR_DATABASE_URL"]
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def record(event: Any, step_name: str, attempt: int | None = None) -> None:
    with psycopg.connect(_dsn(), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO test.side_effect (run_id, step, attempt, pid) VALUES (%s, %s, %s, %s)",
            (event.run_id, step_name, attempt or event.attempt, os.getpid()),
        )


def recorded(key: str, step_name: str) -> bool:
    with psycopg.connect(_dsn(), autocommit=True) as conn:
        return conn.execute(
            "SELECT 1 FROM test.side_effect WHERE run_id = %s AND step = %s", (key, step_name)
        ).fetchone() is not None


def _effect(event: Any, name: str, value: Any, sleep: float = 0.0) -> Any:
    record(event, name)
    if sleep:
        time.sleep(sleep)
    return value


@define_job("test.three-steps", event="test.three", retry_policy=FAST)
def three_steps(event: Any, step: Any) -> Any:
    a = step.run("a", _effect, event, "a", {"n": 1})
    b = step.run("b", _effect, event, "b", {"n": a["n"] + 1})
    c = step.run("c", _effect, event, "c", {"n": b["n"] + 1})
    return {"total": a["n"] + b["n"] + c["n"]}


@define_job("test.mixed-bodies", event="test.mixed-bodies", retry_policy=FAST)
def mixed_bodies(event: Any, step: Any) -> Any:
    """Fast steps around a slow one: records held, sent by the flusher, stored on their own."""
    a = step.run("fast-1", lambda: 1)
    b = step.run("slow", _effect, event, "slow", a + 1, 0.02)
    c = step.run("fast-2", lambda: b + 1)
    return step.run("fast-3", lambda: c + 1)


@define_job("test.fail-after-two", event="test.flaky", retry_policy=FAST)
def fail_after_two(event: Any, step: Any) -> Any:
    step.run("a", _effect, event, "a", 1)
    step.run("b", _effect, event, "b", 2)
    if step.attempt == 1:
        raise RuntimeError("first attempt fails after step b")
    step.run("c", _effect, event, "c", 3)
    return "ok"


@define_job("test.slow", event="test.slow", retry_policy=FAST)
def slow(event: Any, step: Any) -> Any:
    step.run("a", _effect, event, "a", "a")
    step.run("b", _effect, event, "b", "b", float(event.data.get("sleep", 0)))
    step.run("c", _effect, event, "c", "c")
    return "done"


@define_job("test.doomed", event="test.doomed", retry_policy=RetryPolicy(max_attempts=2, backoff=0.1, jitter=0))
def doomed(event: Any, step: Any) -> Any:
    step.run("a", _effect, event, "a", 1)
    raise RuntimeError("always fails")


@define_job("test.refuses", event="test.refuses", retry_policy=FAST)
def refuses(event: Any, step: Any) -> Any:
    raise NonRetriableError("bad input, retrying will not help")


# Two subscribers of one event: one succeeds, one fails until a switch is set.
@define_job("test.mixed-ok", event="test.mixed", retry_policy="none")
def mixed_ok(event: Any, step: Any) -> Any:
    step.run("ok", _effect, event, "ok", True)
    return "ok"


@define_job("test.mixed-fail", event="test.mixed", retry_policy="none")
def mixed_fail(event: Any, step: Any) -> Any:
    step.run("try", _effect, event, "try", True)
    if not recorded(event.data["switch"], "fixed"):
        raise RuntimeError("the dependency is broken")
    return "fixed"


@define_job("test.poison", event="test.poison", retry_policy=RetryPolicy(max_attempts=2, backoff=0, jitter=0))
def poison(event: Any, step: Any) -> Any:
    """Kills the worker process that runs it, every time."""
    import signal

    record(event, "poison")
    os.kill(os.getpid(), signal.SIGKILL)


# --- durable primitives (tests/test_primitives.py) -------------------------------

from motir_celery import CancelOn, RateLimited  # noqa: E402


def _interval(event: Any, name: str, sleep: float) -> str:
    """Record start and end of a body with the database clock, to measure overlap."""
    with psycopg.connect(_dsn(), autocommit=True) as conn:
        conn.execute("INSERT INTO test.side_effect (run_id, step, pid, at) VALUES (%s, %s, %s, clock_timestamp())",
                     (event.run_id, f"{name}:start", os.getpid()))
        time.sleep(sleep)
        conn.execute("INSERT INTO test.side_effect (run_id, step, pid, at) VALUES (%s, %s, %s, clock_timestamp())",
                     (event.run_id, f"{name}:end", os.getpid()))
    return name


@define_job("test.sleeper", event="test.sleep", retry_policy=FAST)
def sleeper(event: Any, step: Any) -> Any:
    step.run("before", _effect, event, "before", 1)
    step.sleep("nap", float(event.data["sleep"]))
    step.run("after", _effect, event, "after", 2)
    return "rested"


@define_job("test.emitter", event="test.emit", retry_policy=FAST)
def emitter(event: Any, step: Any) -> Any:
    sent = step.send_event("notify", "test.emitted", {"from": event.run_id})
    if step.attempt == 1:
        raise RuntimeError("fail after sending, so the retry replays the send")
    return sent


@define_job("test.waiter", event="test.order", retry_policy=FAST)
def waiter(event: Any, step: Any) -> Any:
    step.run("placed", _effect, event, "placed", 1)
    paid = step.wait_for_event("paid", event="test.paid", match="data.order_id",
                               timeout=float(event.data.get("timeout", 60)))
    step.run("done", _effect, event, "done", 2)
    return paid


@define_job("test.cancel-on", event="test.order.placed", retry_policy=FAST,
            cancel_on=[CancelOn(event="test.order.cancelled", match="data.order_id")])
def cancel_on_job(event: Any, step: Any) -> Any:
    step.run("a", _effect, event, "a", 1)
    step.sleep("wait-a-while", 30)
    step.run("b", _effect, event, "b", 2)


@define_job("test.limited", event="test.limited", retry_policy=FAST, concurrency=(2, "data.tenant"))
def limited(event: Any, step: Any) -> Any:
    return step.run("work", _interval, event, "work", float(event.data.get("sleep", 0.5)))


@define_job("test.singleton", event="test.singleton", retry_policy=FAST, singleton_key="data.customer")
def singleton(event: Any, step: Any) -> Any:
    step.run("work", _effect, event, "work", 1, float(event.data.get("sleep", 0)))


@define_job("test.throttled", event="test.throttled", retry_policy=RetryPolicy(max_attempts=1, name="once"))
def throttled(event: Any, step: Any) -> Any:
    record(event, "try")
    with psycopg.connect(_dsn(), autocommit=True) as conn:
        tries = conn.execute("SELECT count(*) FROM test.side_effect WHERE run_id = %s AND step = 'try'",
                             (event.run_id,)).fetchone()[0]
    if tries <= 2:
        raise RateLimited(0.2)
    return tries


@define_job("test.prio-worker", event="test.prio-worker", retry_policy=FAST, concurrency=(1, None))
def prio_worker(event: Any, step: Any) -> Any:
    """One at a time (limit 1): the order the runs execute in is the priority order."""
    return step.run("work", _interval, event, f"prio-{event.data['label']}", float(event.data.get("sleep", 0.2)))


# --- heartbeats a GIL-holding body cannot starve (tests/test_heartbeats.py) ---------

import math  # noqa: E402
import re  # noqa: E402

#: Backtracks in C along every way of writing n as 1s and 2s (Fibonacci(n) of them: each
#: character more is x1.6), never releasing the GIL; a finer step than (a+)+$'s x2.
_GIL_PATTERN = re.compile(r"(a|aa)+$")


def _hold_the_gil(step: Any, seconds: float) -> dict[str, float]:
    """Hold the GIL for ``seconds`` at least in one C call, sized by the fastest of three
    short ones first. Timed in this thread's CPU time: the wall clock would count the
    other threads that run between the calls, and a call's CPU time is a lower bound of
    how long it held the GIL. Returns that bound."""
    record(step, "gil")
    probe, took = 26, float("inf")
    for _ in range(3):
        started = time.thread_time()
        _GIL_PATTERN.match("a" * probe + "b")
        took = min(took, max(time.thread_time() - started, 1e-3))
    n = probe + max(0, math.ceil(math.log(seconds / took, (1 + 5 ** 0.5) / 2)))
    started = time.thread_time()
    _GIL_PATTERN.match("a" * n + "b")
    return {"n": n, "held": time.thread_time() - started}


@define_job("test.gil-hog", retry_policy=FAST)
def gil_hog(step: Any, seconds: float) -> Any:
    step.run("before", _effect, step, "before", 1)
    held = step.run("gil", _hold_the_gil, step, seconds)
    step.run("after", _effect, step, "after", 2)
    return held


@define_job("test.beside", retry_policy=FAST)
def beside(step: Any, sleep: float) -> Any:
    """Three steps that sleep (the GIL released): a run in flight beside a GIL-holding one."""
    for name in ("a", "b", "c"):
        step.run(name, _effect, step, name, name, sleep)
    return "done"


@define_job("test.long-first", retry_policy=FAST)
def long_first(step: Any, seconds: float) -> Any:
    """One step, long on the first attempt only: a run whose process a test kills."""
    step.run("long", _effect, step, "long", 1, seconds if step.attempt == 1 else 0.0)
    return "done"


def _until_lost(step: Any, timeout: float) -> str:
    """Runs until this attempt has been reclaimed (its job_run row says 'lost'), ``timeout`` at most."""
    record(step, "long")
    deadline = time.monotonic() + timeout
    with psycopg.connect(_dsn(), autocommit=True) as conn:
        while time.monotonic() < deadline:
            if conn.execute("SELECT 1 FROM job_run WHERE run_id = %s AND attempt = %s AND outcome = 'lost'",
                            (step.run_id, step.attempt)).fetchone():
                return "lost"
            time.sleep(0.1)
    return "still held"


@define_job("test.time-limited", retry_policy=FAST, time_limit=1)
def time_limited(step: Any, timeout: float) -> Any:
    """A step that runs until its attempt is reclaimed, in a job with a time limit of 1 s."""
    return step.run("long", _until_lost, step, timeout)


@define_job("test.until-lost", retry_policy=FAST)
def until_lost(step: Any, timeout: float) -> Any:
    """``time_limited`` without a time limit."""
    return step.run("long", _until_lost, step, timeout)


@define_job("test.until-released", retry_policy=FAST)
def until_released(step: Any, timeout: float) -> Any:
    """A step that runs until the test records a 'release' for its run, ``timeout`` at most."""
    def body() -> bool:
        record(step, "long")
        deadline = time.monotonic() + timeout
        while not recorded(step.run_id, "release"):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    return step.run("long", body)


def _wait_for_release(step: Any, key: str, timeout: float) -> bool:
    """Until the test records a 'release' under ``key`` (one connection, polled), ``timeout`` at most."""
    record(step, "b")
    deadline = time.monotonic() + timeout
    with psycopg.connect(_dsn(), autocommit=True) as conn:
        while not conn.execute("SELECT 1 FROM test.side_effect WHERE run_id = %s AND step = 'release'",
                               (key,)).fetchone():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
    return True


@define_job("test.beside-until", retry_policy=FAST)
def beside_until(step: Any, sleep: float, key: str) -> Any:
    """``beside`` whose step b lasts until the test releases ``key``: in flight for as long as the test needs."""
    step.run("a", _effect, step, "a", "a", sleep)
    step.run("b", _wait_for_release, step, key, 120.0)
    step.run("c", _effect, step, "c", "c", sleep)
    return "done"
