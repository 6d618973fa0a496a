"""Jobs for tests/test_hot_path.py (workers: MOTIR_IMPORTS=tests.jobs,tests.hot_path_jobs).

Each job has a fast first step, ``fast``, whose every real execution is recorded
in ``test.side_effect`` (tests.jobs.record: its own connection, committed at once),
followed by whatever an adversarial handler does to the step after it or to the
settle: an exception Postgres cannot store, a value it cannot encode, a step id
too long to index, a delay it cannot turn into an interval, a body that holds
the GIL. The tests count the fast step's executions across all attempts: a
stored step never runs again, whatever comes after it (issue 16).

The executions are counted in a file ledger, not in ``test.side_effect``: a
fresh database connection per body takes milliseconds, which makes a "fast"
step slow, and an engine may treat a slow step's record differently (the one
at 37a0e59 stored it at once, and held only the records of bodies under 2 ms).
An appended line is in the kernel once ``write`` returns, so a body that ran
and whose process then died still counts. The worker's environment names the
file (``HOT_PATH_LEDGER``).
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

from motir_celery import RateLimited, RetryAfterError, RetryPolicy, define_job

#: The retry policy that applies to an ordinary handler error here: three
#: attempts like ``transient``, with a backoff short enough for a test.
THREE = RetryPolicy(max_attempts=3, backoff=0.2, factor=1.0, jitter=0.0, name="three-quick")
TWO = RetryPolicy(max_attempts=2, backoff=0.2, factor=1.0, jitter=0.0, name="two-quick")

#: A string that is not UTF-8: a lone surrogate, as os.fsdecode makes of a Latin-1 file name.
LONE_SURROGATE = os.fsdecode(b"caf\xe9")

#: A 10 KB step id that does not compress (a repeated character would compress
#: under the index's row limit and be stored): Postgres refuses to index it.
LONG_STEP_ID = "".join(hashlib.sha256(str(i).encode()).hexdigest() for i in range(160))[:10_000]


class BadNews(Exception):
    """An ordinary exception of the user's own type (its name is what the DLQ must show)."""


def record(event: Any, name: str) -> None:
    """One line per real execution of a body: run id, step, attempt, pid."""
    line = f"{event.run_id} {name} {event.attempt} {os.getpid()}\n".encode()
    fd = os.open(os.environ["HOT_PATH_LEDGER"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # one short write with O_APPEND: whole lines, whoever else appends
    finally:
        os.close(fd)


def _effect(event: Any, name: str, value: Any) -> Any:
    record(event, name)
    return value


def _fast(event: Any, step: Any) -> Any:
    return step.run("fast", _effect, event, "fast", {"fast": True})


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


@define_job("hot.nul-message", event="hot.nul-message", retry_policy=THREE)
def nul_message(event: Any, step: Any) -> Any:
    _fast(event, step)
    raise BadNews("bad\x00news")


@define_job("hot.surrogate-step", event="hot.surrogate-step", retry_policy=THREE)
def surrogate_step(event: Any, step: Any) -> Any:
    _fast(event, step)
    return step.run("surrogate", _effect, event, "surrogate", {"name": LONE_SURROGATE})


@define_job("hot.surrogate-result", event="hot.surrogate-result", retry_policy=THREE)
def surrogate_result(event: Any, step: Any) -> Any:
    _fast(event, step)
    return {"name": LONE_SURROGATE}


@define_job("hot.long-step-id", event="hot.long-step-id", retry_policy=THREE)
def long_step_id(event: Any, step: Any) -> Any:
    _fast(event, step)
    return step.run(LONG_STEP_ID, _effect, event, "long-id", 1)


@define_job("hot.nan-delay", event="hot.nan-delay", retry_policy=THREE)
def nan_delay(event: Any, step: Any) -> Any:
    _fast(event, step)
    raise RetryAfterError(float("nan"))


@define_job("hot.huge-delay", event="hot.huge-delay", retry_policy=THREE)
def huge_delay(event: Any, step: Any) -> Any:
    _fast(event, step)
    raise RetryAfterError(1e15)


@define_job("hot.infinite-rate-limit", event="hot.infinite-rate-limit", retry_policy=THREE)
def infinite_rate_limit(event: Any, step: Any) -> Any:
    _fast(event, step)
    raise RateLimited(float("inf"))


@define_job("hot.deep-result", event="hot.deep-result", retry_policy=THREE)
def deep_result(event: Any, step: Any) -> Any:
    _fast(event, step)
    return step.run("deep", _effect, event, "deep", _nested(2_000))


@define_job("hot.huge-message", event="hot.huge-message", retry_policy=TWO)
def huge_message(event: Any, step: Any) -> Any:
    _fast(event, step)
    raise BadNews("x" * 10_000_000)


def _catastrophic(event: Any, n: int) -> bool:
    """A regex that backtracks 2**n ways in C without ever releasing the GIL."""
    record(event, "gil")
    return re.match(r"(a+)+$", "a" * n + "b") is not None


@define_job("hot.gil", event="hot.gil", retry_policy=TWO)
def gil(event: Any, step: Any) -> Any:
    step.run("fast", _effect, event, "fast", 1)
    step.run("gil", _catastrophic, event, int(event.data["n"]))
    return "done"


@define_job("hot.pair", event="hot.pair", retry_policy=THREE)
def pair(event: Any, step: Any) -> Any:
    one = step.run("one", _effect, event, "one", 1)
    two = step.run("two", _effect, event, "two", one + 1)
    return two
