"""How the runner calls a handler, and coroutine steps.

* An event or cron job: ``handler(event, step)``.
* A direct job (``job.delay(*args, **kwargs)``): ``handler(step, *args, **kwargs)``,
  the arguments read back from the run's event data (``core/direct.py``).
* An ``async def`` handler: its coroutine runs to completion with
  ``asyncio.run`` on the worker's own thread — a fresh event loop per attempt,
  closed after it; the user manages no loop. (A thread that already runs a loop
  cannot do this: asyncio refuses, and the attempt fails saying so.)
* ``await step.run(step_id, fn, ...)`` with a coroutine function ``fn``: the
  step is memoized exactly as a plain one — a stored result is returned without
  running ``fn``, a new one is committed before the awaitable completes — and
  its record is written on the attempt's connection from the handler's loop
  (one short statement; the loop belongs to this run alone). Steps gathered
  concurrently (``asyncio.gather``) get their ids in call order, as plain steps do.
  Pass the coroutine function itself: ``step.run("x", fetch, url)``, not
  ``lambda: fetch(url)`` (a lambda is a plain function; its coroutine would be
  its result, which is not JSON). In a plain (sync) handler, where no loop
  runs, ``step.run`` with a coroutine function runs it with ``asyncio.run`` and
  returns its result, so async client code can be used from sync handlers too.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Awaitable, Callable, Mapping, Protocol, Sequence

from motir_celery.core.direct import arguments
from motir_celery.core.jobs import Job
from motir_celery.core.tracing import step_span

__all__ = ["call_handler", "coroutine_step", "is_coroutine_function"]


def call_handler(job: Job, event: Any, step: Any) -> Any:
    """The handler's return value, an ``async def`` handler's awaited on a loop of its own."""
    if job.direct:
        args, kwargs = arguments(event.data)
        result = job.handler(step, *args, **kwargs)
    else:
        result = job.handler(event, step)
    if inspect.iscoroutine(result):
        result = asyncio.run(result)
    return result


def is_coroutine_function(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


class _Steps(Protocol):
    """What a coroutine step needs of ``steps.StepRun`` (no import: steps imports this module)."""

    _memo: dict[str, Any]

    def _still_held(self, key: str) -> None: ...

    def _encode(self, key: str, value: Any) -> str: ...

    def _store(self, key: str, encoded: str, elapsed: float) -> Any: ...


def coroutine_step(step: _Steps, key: str, fn: Callable[..., Awaitable[Any]], args: Sequence[Any],
                   kwargs: Mapping[str, Any]) -> Any:
    """An awaitable of the step inside a running loop (an ``async def`` handler); in a plain
    handler, where no loop runs, the step's result, its coroutine run here with ``asyncio.run``."""
    body = _coroutine_step(step, key, fn, args, kwargs)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(body)
    return body


async def _coroutine_step(step: _Steps, key: str, fn: Callable[..., Awaitable[Any]], args: Sequence[Any],
                          kwargs: Mapping[str, Any]) -> Any:
    """``StepRun.run`` for an ``async def`` body: memo, fence check, body, committed record."""
    if key in step._memo:
        return step._memo[key]
    step._still_held(key)
    with step_span(key):
        started = time.monotonic()
        value = await fn(*args, **kwargs)
        encoded = step._encode(key, value)
    return step._store(key, encoded, time.monotonic() - started)
