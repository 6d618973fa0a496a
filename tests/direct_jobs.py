"""Direct jobs and async handlers for tests/test_direct.py and tests/test_async.py.

Workers import them with ``MOTIR_IMPORTS=tests.jobs,tests.direct_jobs``. A step
body records its execution in ``test.side_effect`` (tests.jobs.record, given
the step: it carries run_id and attempt as an event does).
"""

from __future__ import annotations

import asyncio
from typing import Any

from motir_celery import NonRetriableError, RetryPolicy, define_job
from tests.jobs import record

FAST = RetryPolicy(max_attempts=3, backoff=0.2, factor=1.0, jitter=0.0, name="fast")


def _effect(step: Any, name: str, value: Any) -> Any:
    record(step, name)
    return value


@define_job("test.direct.add", retry_policy=FAST)
def add(step: Any, x: int, y: int, *, scale: int = 1) -> Any:
    total = step.run("add", _effect, step, "add", (x + y) * scale)
    return {"total": total, "run_id": step.run_id, "attempt": step.attempt}


@define_job("test.direct.fail", retry_policy="none")
def fail(step: Any, message: str) -> Any:
    step.run("before", _effect, step, "before", 1)
    raise ValueError(message)


@define_job("test.direct.refuse", retry_policy=FAST)
def refuse(step: Any) -> Any:
    raise NonRetriableError("no such customer")


async def _fetch(step: Any, name: str, value: Any, pause: float = 0.01) -> Any:
    await asyncio.sleep(pause)
    record(step, name)
    return value


@define_job("test.direct.async", retry_policy=FAST)
async def async_handler(step: Any, url: str, fail_first: bool = False) -> Any:
    page = await step.run("fetch", _fetch, step, "fetch", {"url": url, "size": len(url)})
    plain = step.run("plain", _effect, step, "plain", 2)  # a plain step inside an async handler
    a, b = await asyncio.gather(step.run("g", _fetch, step, "g1", 10, 0.05),
                                step.run("g", _fetch, step, "g2", 20, 0.01))
    if fail_first and step.attempt == 1:
        raise RuntimeError("first attempt fails after its steps")
    return {"size": page["size"], "plain": plain, "gathered": [a, b], "attempt": step.attempt}


@define_job("test.async.event", event="test.async-event", retry_policy=FAST)
async def async_event_handler(event: Any, step: Any) -> Any:
    n = await step.run("n", _fetch, event, "n", event.data["n"])
    return {"n": n}


@define_job("test.direct.sync-calls-async", retry_policy=FAST)
def sync_calls_async(step: Any, n: int) -> Any:
    """A plain handler whose step body is a coroutine function: run to its end, no await."""
    return step.run("fetch", _fetch, step, "fetch", n * 2)
