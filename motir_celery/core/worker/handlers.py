"""Coroutine steps, for ``async def`` handlers (the runner runs those with
``asyncio.run`` on the worker's thread: a fresh loop per attempt).

* ``await step.run(step_id, fn, ...)`` with a coroutine function ``fn`` is
  memoized exactly as a plain step: a stored result is returned without running
  ``fn``, a new one is committed before the awaitable completes. Pass the
  coroutine function itself (``step.run("x", fetch, url)``), not a lambda. In a
  plain handler, where no loop runs, such a step runs with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Awaitable, Callable, Mapping, Protocol, Sequence

from motir_celery.core.tracing import step_span

__all__ = ["coroutine_step", "is_coroutine_function"]


def is_coroutine_function(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


class _Steps(Protocol):
    """What a coroutine step needs of ``steps.Step`` (no import: steps imports this module)."""

    @property
    def records(self) -> Mapping[str, Any]: ...

    def ensure_held(self, key: str) -> None: ...

    def encode(self, key: str, value: Any) -> str: ...

    def record(self, key: str, encoded: str, elapsed: float) -> Any: ...


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
    """``Step.run`` for an ``async def`` body: memo, fence check, body, committed record."""
    if key in step.records:
        return step.records[key]
    step.ensure_held(key)
    with step_span(key):
        started = time.monotonic()
        value = await fn(*args, **kwargs)
        encoded = step.encode(key, value)
    return step.record(key, encoded, time.monotonic() - started)
