"""``define_job`` and the job registry.

Like Celery's ``shared_task``, ``define_job`` works at import time without an
app: it records the job in a process-wide registry, and whichever Celery app
hosts the engine (ours, or the user's through ``attach``) turns every
registered job into a task named ``motir.<job_id>`` — now, or as soon as the
app is attached. Mistakes (a duplicate id, both triggers, an unknown retry
policy) are errors here, at definition time.

A job with neither ``event=`` nor ``cron=`` is a *direct* job: started the way
a Celery task is, ``job.delay(*args, **kwargs)`` / ``job.apply_async(...)``, and
called as ``handler(step, *args, **kwargs)``. Those calls are written by
``core/direct.py`` (and ``core/aio.py``), which sit above this module: the
package's face wires them in (``use_invoker``), as the adapter hands the core
its ``Publish`` callable, so no import points up.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, NoReturn, Protocol, Sequence

from motir_celery.core.producer.results import RunHandle
from motir_celery.core.retries import RetryPolicy, resolve_policy
from motir_celery.core.runspec import RunOptions, run_options, run_spec
from motir_celery.errors import JobDefinitionError, MotirError, UnknownJobError
from motir_celery.store.records import RunSpec

__all__ = ["Job", "define_job", "get_job", "find_job", "all_jobs", "subscribers", "cancelled_by", "on_job_defined", "task_name",
           "CanvasNotSupported", "Invoker", "use_invoker"]

JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}$")


class Handler(Protocol):
    def __call__(self, event: Any, step: Any) -> Any: ...


@dataclass(frozen=True)
class Job:
    id: str
    handler: Callable[..., Any]
    events: tuple[str, ...] = ()
    cron: str | None = None
    timezone: str = "UTC"
    retry_policy: RetryPolicy = field(default_factory=lambda: resolve_policy("transient"))
    #: Extra options for later features and for the Celery task (queue, priority...).
    options: dict[str, Any] = field(default_factory=dict)
    #: priority, singleton_key, concurrency and cancel_on, validated (runspec.py).
    run_options: RunOptions = field(default_factory=RunOptions)

    @property
    def task_name(self) -> str:
        return task_name(self.id)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # handler(event, step), or a direct job's handler(step, *args, **kwargs), called inline.
        return self.handler(*args, **kwargs)

    def spec(self, data: Any, workspace_id: str | None, priority: int | None = None) -> RunSpec:
        """What a new run of this job carries, computed from its triggering event's data."""
        return run_spec(self.id, self.retry_policy, self.run_options, data, workspace_id, priority)

    @property
    def direct(self) -> bool:
        """Neither ``event=`` nor ``cron=``: started by ``delay()`` / ``apply_async()``."""
        return not self.events and self.cron is None

    # --- Celery-shaped calls (core/direct.py; docs/migrating.md) -------------

    def delay(self, *args: Any, **kwargs: Any) -> RunHandle:
        """One durable run of this direct job with these arguments; its result handle."""
        return _invoker_for(self).apply_async(self, args, kwargs, {})

    def apply_async(self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
                    **options: Any) -> RunHandle:
        """``delay`` with options: ``countdown=``, ``eta=``, ``queue=``, ``priority=``,
        ``task_id=`` / ``idempotency_key=``, ``workspace_id=``, ``session=``."""
        return _invoker_for(self).apply_async(self, args or (), kwargs or {}, options)

    async def delay_async(self, *args: Any, **kwargs: Any) -> RunHandle:
        """``delay`` for asyncio code (psycopg's async connection; never blocks the loop)."""
        return await _invoker_for(self).apply_async_async(self, args, kwargs, {})

    async def apply_async_async(self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
                                **options: Any) -> RunHandle:
        """``apply_async`` for asyncio code; ``session=`` takes an ``AsyncSession``."""
        return await _invoker_for(self).apply_async_async(self, args or (), kwargs or {}, options)

    def s(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise CanvasNotSupported(_CANVAS.format(job=self.id, what="s"))

    def si(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise CanvasNotSupported(_CANVAS.format(job=self.id, what="si"))

    def signature(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise CanvasNotSupported(_CANVAS.format(job=self.id, what="signature"))

    subtask = signature

    def map(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise CanvasNotSupported(_CANVAS.format(job=self.id, what="map"))

    starmap = chunks = map


def task_name(job_id: str) -> str:
    return f"motir.{job_id}"


class CanvasNotSupported(MotirError, TypeError):
    """``job.s()`` & co.: durable jobs are not Celery canvas members (docs/migrating.md)."""


_CANVAS = (
    "job {job!r}.{what}(): durable jobs do not take part in Celery's canvas (chain, group, chord): "
    "the links between them would live in Celery's result backend, outside Postgres, and a crash "
    "between two links would lose the rest. Compose durably instead: call the pieces as steps of one "
    "job (step.run('a', a) then step.run('b', b, a_result) is a chain; several steps then one that "
    "uses their results is a group + chord), or start the next job from a step "
    "(step.send_event(step_id, name, data), or step.run(step_id, lambda: other.delay(...).task_id))."
)


class Invoker(Protocol):
    """What writes a direct run (core/direct.py, core/aio.py), wired in by the package's face."""

    def apply_async(self, job: Job, args: Sequence[Any], kwargs: Mapping[str, Any],
                    options: dict[str, Any]) -> RunHandle: ...

    async def apply_async_async(self, job: Job, args: Sequence[Any], kwargs: Mapping[str, Any],
                                options: dict[str, Any]) -> RunHandle: ...


_invoker: Invoker | None = None


def use_invoker(invoker: Invoker) -> None:
    """Write direct runs through ``invoker`` (``motir_celery/__init__.py`` calls this)."""
    global _invoker
    _invoker = invoker


def _invoker_for(job: Job) -> Invoker:
    if not job.direct:
        trigger = (f"its event {job.events[0]!r} (send_event({job.events[0]!r}, data))" if job.events
                   else f"its cron {job.cron!r} (celery beat)")
        raise JobDefinitionError(f"job {job.id!r} is started by {trigger}, not by .delay() / .apply_async(): "
                                 "only a job defined with neither event= nor cron= is (a direct job)")
    if _invoker is None:  # only if motir_celery/__init__.py was never imported, which Python does not allow
        raise JobDefinitionError("direct runs are not wired in: import motir_celery")
    return _invoker


#: define_job options that are the Celery task's own (celery_app registers them,
#: messages sends them with every message).
TASK_OPTIONS = ("queue", "time_limit", "soft_time_limit")


_registry: dict[str, Job] = {}
_listeners: list[Callable[[Job], None]] = []
_lock = threading.RLock()


def define_job(
    id: str,
    *,
    event: str | Iterable[str] | None = None,
    cron: str | None = None,
    timezone: str | None = None,
    retry_policy: str | RetryPolicy = "transient",
    **options: Any,
) -> Callable[[Callable[..., Any]], Job]:
    """Register ``handler(event, step)`` as job ``id``.

    ``event`` names the event(s) that start a run; ``cron`` schedules one
    instead (see docs/jobs.md, "Scheduled jobs"); with neither, the job is
    direct: ``job.delay(*args, **kwargs)`` starts a run of
    ``handler(step, *args, **kwargs)`` (docs/migrating.md). ``retry_policy`` is
    ``"transient"`` (default), ``"idempotent"``, ``"none"`` or a ``RetryPolicy``.
    Durable-flow options (docs/jobs.md): ``priority=0..9``, ``singleton_key=``,
    ``concurrency=(limit, key)``, ``cancel_on=[CancelOn(...)]``; cron jobs also
    take ``catchup=`` and ``overlap=``.
    """
    if not isinstance(id, str) or not JOB_ID.fullmatch(id):  # fullmatch: `$` also matches before a final newline
        raise JobDefinitionError(
            f"job id {id!r} must be 1-200 characters of letters, digits, '.', '_' or '-'"
        )
    events = (event,) if isinstance(event, str) else tuple(event or ())
    for name in events:
        if not isinstance(name, str) or not name:
            raise JobDefinitionError(f"job {id!r}: event names must be non-empty strings, got {name!r}")
    if events and cron is not None:
        raise JobDefinitionError(f"job {id!r}: pass event=... or cron=..., not both")
    policy = resolve_policy(retry_policy)
    zone = "UTC"
    from motir_celery.core.schedule import parse_cron, schedule_options

    # catchup= / overlap= are validated here, at definition time, like the cron itself.
    schedule_options(id, options, cron=cron is not None)
    shaped = run_options(id, options)
    if cron is not None:
        cron, zone = parse_cron(cron, timezone, job_id=id)

    def decorate(handler: Callable[..., Any]) -> Job:
        if not callable(handler):
            raise JobDefinitionError(f"job {id!r}: the handler must be callable")
        job = Job(id=id, handler=handler, events=events, cron=cron, timezone=zone,
                  retry_policy=policy, options=options, run_options=shaped)
        with _lock:
            existing = _registry.get(id)
            if existing is not None and _origin(existing.handler) != _origin(handler):
                raise JobDefinitionError(
                    f"job id {id!r} is already defined by {_origin(existing.handler)}"
                )
            # Same function re-imported (e.g. a module imported under two names
            # by a test runner): keep one definition, not an error.
            _registry[id] = job
            listeners = list(_listeners)
        for listener in listeners:
            listener(job)
        return job

    return decorate


def _origin(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


def find_job(job_id: str) -> Job | None:
    """The job registered as ``job_id`` in this process, or None."""
    return _registry.get(job_id)


def get_job(job_id: str) -> Job:
    try:
        return _registry[job_id]
    except KeyError:
        raise UnknownJobError(
            f"job {job_id!r} is not defined in this process; is its module in MOTIR_IMPORTS?"
        ) from None


def all_jobs() -> list[Job]:
    with _lock:
        return sorted(_registry.values(), key=lambda j: j.id)


def subscribers(event_name: str) -> list[Job]:
    with _lock:
        return [j for j in sorted(_registry.values(), key=lambda j: j.id) if event_name in j.events]


def cancelled_by(event_name: str) -> list[Job]:
    """Jobs with a cancel_on rule for ``event_name`` (send_event asks on every event)."""
    with _lock:
        return [j for j in _registry.values() if any(r.event == event_name for r in j.run_options.cancel_on)]


def on_job_defined(listener: Callable[[Job], None]) -> None:
    """Call ``listener`` for every job defined so far and every job defined later."""
    with _lock:
        _listeners.append(listener)
        jobs = list(_registry.values())
    for job in jobs:
        listener(job)
