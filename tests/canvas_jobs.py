"""Direct jobs for the canvas tests (issue 27): MOTIR_IMPORTS=tests.jobs,tests.canvas_jobs.

Each body's side effect is one ``step.run`` that records its execution in ``test.side_effect``
(tests/jobs.py's ``record``, given the step: it carries run_id and attempt), so a test counts
real executions: a side effect recorded twice is a link that ran twice.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from motir_celery import NonRetriableError, RetryPolicy, define_job
from tests.jobs import record

FAST = RetryPolicy(max_attempts=3, backoff=0.2, factor=1.0, jitter=0.0, name="fast")
#: For the kill -9 tests: every kill of a member's worker charges it an attempt.
KILLABLE = RetryPolicy(max_attempts=8, backoff=0.2, factor=1.0, jitter=0.0, name="killable")


def _effect(step: Any, name: str, value: Any) -> Any:
    record(step, name)
    return value


@define_job("canvas.add", retry_policy=FAST)
def add(step: Any, x: int, y: int = 0) -> int:
    return step.run("add", _effect, step, "add", x + y)  # type: ignore[no-any-return]


@define_job("canvas.mul", retry_policy=FAST)
def mul(step: Any, x: int, y: int) -> int:
    return step.run("mul", _effect, step, "mul", x * y)  # type: ignore[no-any-return]


@define_job("canvas.tsum", retry_policy=FAST)
def tsum(step: Any, xs: list[int], offset: int = 0) -> int:
    return step.run("tsum", _effect, step, "tsum", sum(xs) + offset)  # type: ignore[no-any-return]


@define_job("canvas.echo", retry_policy=FAST)
def echo(step: Any, *args: Any, **kwargs: Any) -> Any:
    return step.run("echo", _effect, step, "echo", {"args": list(args), "kwargs": kwargs})


@define_job("canvas.refuse", retry_policy=FAST)
def refuse(step: Any, x: Any = None, message: str = "refused") -> Any:
    step.run("refuse", _effect, step, "refuse", 1)
    raise NonRetriableError(f"{message} ({x})")


@define_job("canvas.boom", retry_policy=RetryPolicy(max_attempts=2, backoff=0.1, factor=1.0, jitter=0.0,
                                                    name="twice"))
def boom(step: Any, x: Any = None) -> Any:
    """Fails with a ValueError every attempt (two): lands in the DLQ with the ValueError."""
    step.run(f"try-{step.attempt}", _effect, step, "boom", 1)
    raise ValueError(f"boom {x}")


@define_job("canvas.flaky", retry_policy=FAST)
def flaky(step: Any, x: int, failures: int = 1) -> int:
    """Fails its first ``failures`` attempts, then returns x: retried by its own policy."""
    step.run(f"try-{step.attempt}", _effect, step, "flaky", 1)
    if step.attempt <= failures:
        raise RuntimeError(f"flaky attempt {step.attempt}")
    return x


@define_job("canvas.fixable", retry_policy=RetryPolicy(max_attempts=1, name="once"))
def fixable(step: Any, x: int, flag: str) -> int:
    """Fails until the file ``flag`` exists (the test "deploys the fix" by creating it)."""
    step.run("before", _effect, step, "fixable.before", 1)
    if not Path(flag).exists():
        raise RuntimeError(f"not fixed yet ({x})")
    return step.run("after", _effect, step, "fixable.after", x)  # type: ignore[no-any-return]


@define_job("canvas.errback", retry_policy=FAST)
def errback(step: Any, failed_id: str, tag: str = "") -> str:
    return step.run("errback", _effect, step, f"errback{tag}", failed_id)  # type: ignore[no-any-return]


@define_job("canvas.slow", retry_policy=KILLABLE)
def slow(step: Any, x: Any, marker: str = "", seconds: float = 0.0) -> Any:
    """A link a test kills its worker in: ``marker`` names a file it creates while it runs
    (the test waits for it and then kills the worker), then sleeps, then records its effect.
    The record runs once the kill is over (the file is removed by the test)."""
    if marker:
        _hold(step, marker)  # held here until the test has killed this worker and removed the file
    if seconds:
        time.sleep(seconds)
    return step.run("slow", _effect, step, "slow", x + 1 if isinstance(x, int) else x)


@define_job("canvas.big_add", retry_policy=KILLABLE)
def big_add(step: Any, x: int, y: int) -> int:
    """A trivial member (no step: the smallest run there is), for the chords of 10,000."""
    return x + y


@define_job("canvas.big_sum", retry_policy=KILLABLE)
def big_sum(step: Any, xs: list[int]) -> dict[str, int]:
    return step.run("sum", _effect, step, "big_sum", {"n": len(xs), "sum": sum(xs)})  # type: ignore[no-any-return]


@define_job("canvas.nap", retry_policy=FAST)
def nap(step: Any, x: Any) -> Any:
    step.sleep("nap", 3600)
    return x


def _hold(step: Any, marker: str) -> None:
    """While the file ``marker`` exists, wait (the test kills this worker meanwhile); say so in ``<marker>.<pid>.running``."""
    Path(marker).with_suffix(f".{os.getpid()}.running").write_text(str(step.run_id))
    deadline = time.monotonic() + 60
    while Path(marker).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


@define_job("canvas.fragile", retry_policy=RetryPolicy(max_attempts=1, name="once"))
def fragile(step: Any, x: Any, marker: str) -> Any:
    """One attempt only: a worker killed in it leaves it to the sweeper, which fails it into the DLQ."""
    _hold(step, marker)
    return x


@define_job("canvas.big", retry_policy=FAST)
def big(step: Any, n: int) -> str:
    """A result of ``n`` characters (no step: only the run's result holds it)."""
    return "x" * n
