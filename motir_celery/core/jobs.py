"""``define_job``, the job registry, and the names a job's Celery task answers to.

Like Celery's ``shared_task``, ``define_job`` works at import time without an
app: it records the job in a process-wide registry, and whichever Celery app
hosts the engine (ours, or the user's through ``attach``) turns every
registered job into a Celery task — now, or as soon as the app is attached.
Mistakes (a duplicate id, a task name two jobs claim, both triggers, an unknown
retry policy) are errors here, at definition time.

**Task names.** A job's task is named ``name=`` when given; else a *direct* job
(the kind that replaces a Celery task) takes the name Celery gives the same
function, ``module.function`` (``demoapp.tasks.add``), so routes,
``beat_schedule`` entries, ``send_task`` calls and Flower filters written for the
Celery task keep meaning it; an event or cron job (never a Celery task) keeps
``motir.<job_id>``, as does a direct job whose function Celery could not name
stably (a lambda, a nested function, ``__main__``). Every job also answers to
``motir.<job_id>`` (an alias: messages of earlier releases, and the names users
wrote before). The engine publishes under ``Job.task_name``. The job id stays the
key in Postgres.

A job with neither ``event=`` nor ``cron=`` is a *direct* job: started the way
a Celery task is, ``job.delay(*args, **kwargs)`` / ``job.apply_async(...)``, and
called as ``handler(step, *args, **kwargs)`` (``bind=False``: ``handler(*args,
**kwargs)``, a Celery task body unchanged). Those calls, and the signatures of the
canvas, go through the current engine (``core/current.py``), as a Celery ``shared_task``
goes through the current app. Calling the job object runs the body here, at once, as
calling a Celery task does (``Job.__call__``, ``CallStep``).
"""

from __future__ import annotations

import asyncio
import inspect
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, NoReturn, Protocol, Sequence, runtime_checkable

from motir_celery.core.current import current
from motir_celery.core.retries import RetryPolicy, resolve_policy
from motir_celery.core.runspec import RunOptions, check_trigger, run_options, run_spec
from motir_celery.core.shapes import check_audit
from motir_celery.errors import JobDefinitionError, MotirError, UnknownJobError
from motir_celery.store.records import RunSpec

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine
    from motir_celery.core.producer.results import RunHandle

__all__ = ["Job", "define_job", "define_task_job", "get_job", "find_job", "all_jobs", "subscribers",
           "cancelled_by", "on_job_defined", "task_name", "alias_name", "celery_name", "job_for_task", "CanvasNotSupported", "CallStep",
           "DirectCallUnsupported", "StepLike"]

JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}$")
#: A Celery task name given as ``name=``: printable, no blank, at most 200 characters.
TASK_NAME = re.compile(r"^[^\s]{1,200}$")
#: The prefix of every job's alias, ``motir.<job_id>`` (the only name before the cut-over release).
ALIAS_PREFIX = "motir."


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
    #: The Celery task name (``name=``, or Celery's ``module.function`` for a direct job); None: ``motir.<id>``.
    name: str | None = None
    #: A direct job's handler takes the step first (``handler(step, *args)``, where a bound task had
    #: ``self``); False: the call's own arguments only, as an unbound Celery task's body.
    bind: bool = True
    #: The job stands for a Celery task made durable (``@app.task(durable=True)``,
    #: adapter/tasks.py): the task is the app's own, registered by Celery; its runs are that
    #: task's messages.
    celery: bool = False

    @property
    def task_name(self) -> str:
        """The name of this job's Celery task: what the engine publishes under."""
        return self.name or alias_name(self.id)

    @property
    def task_names(self) -> tuple[str, ...]:
        """Every name this job's task answers to: its task name, then its alias ``motir.<job_id>``."""
        alias = alias_name(self.id)
        return (self.task_name,) if self.task_name == alias else (self.task_name, alias)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body here and now, as calling a Celery task does (``Task.__call__``): a direct
        job's ``add(1, 2)`` is ``handler(CallStep(), 1, 2)`` — nothing is stored, nothing is
        retried, each ``step.run`` just calls its function — what a unit test of the body wants.
        ``job.apply(...)`` runs it through the engine instead (a stored run). An event job is
        called as its handler is, ``job(event, step)``; so is a direct job given a step first."""
        if not self.direct or not self.bind or (args and isinstance(args[0], StepLike)):
            return self.handler(*args, **kwargs)
        return self.handler(CallStep(), *args, **kwargs)

    def spec(self, data: Any, workspace_id: str | None, priority: int | None = None) -> RunSpec:
        """What a new run of this job carries, computed from its triggering event's data."""
        return run_spec(self.id, self.retry_policy, self.run_options, data, workspace_id, priority)

    @property
    def direct(self) -> bool:
        """Neither ``event=`` nor ``cron=``: started by ``delay()`` / ``apply_async()``."""
        return not self.events and self.cron is None

    # --- Celery-shaped calls (core/direct.py; docs/tasks-to-jobs.md) -------------

    def delay(self, *args: Any, **kwargs: Any) -> RunHandle:
        """One durable run of this direct job with these arguments; its result handle."""
        return _engine_for(self).apply_async(self, args, kwargs, {})

    def apply_async(self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
                    **options: Any) -> RunHandle:
        """``delay`` with options: ``countdown=``, ``eta=``, ``queue=``, ``priority=``,
        ``task_id=`` / ``idempotency_key=``, ``workspace_id=``, ``session=``; ``link=`` /
        ``link_error=`` make it a canvas (core/producer/canvas.py)."""
        if _callbacks(options):
            canvas: RunHandle = _canvas_for(self).signature(self, args or (), kwargs or {}, {}, False).apply_async(
                **options)
            return canvas
        return _engine_for(self).apply_async(self, args or (), kwargs or {}, _without_callbacks(options))

    async def delay_async(self, *args: Any, **kwargs: Any) -> RunHandle:
        """``delay`` for asyncio code (psycopg's async connection; never blocks the loop)."""
        return await _engine_for(self).apply_async_async(self, args, kwargs, {})

    async def apply_async_async(self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
                                **options: Any) -> RunHandle:
        """``apply_async`` for asyncio code; ``session=`` takes an ``AsyncSession``."""
        return await _engine_for(self).apply_async_async(self, args or (), kwargs or {}, options)

    def apply(self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
              **options: Any) -> RunHandle:
        """Run one durable run of this job now, in this process, through the engine — a stored run,
        its claim, stored steps, its settle (core/worker/inline.py) — before returning its handle,
        whose ``.get()`` then answers at once. Celery's ``Task.apply``; the options are
        ``apply_async``'s. A retry's backoff is waited out as for any run: the attempt after it
        is left queued for a worker."""
        if _callbacks(options):
            ran: RunHandle = _canvas_for(self).signature(self, args or (), kwargs or {}, {}, False).apply(**options)
            return ran
        return _engine_for(self).apply(self, args or (), kwargs or {}, _without_callbacks(options))

    def delay_on_commit(self, *args: Any, **kwargs: Any) -> RunHandle:
        """Celery's Django helper (5.4+): here ``delay``, which inside ``transaction.atomic()``
        (contrib.django) already writes the run in Django's transaction and publishes it on
        commit — an outbox: a rollback leaves nothing, a crash after the commit loses nothing
        (Celery's version publishes from ``on_commit`` and loses the task if the process dies
        between the two). Returns the run's handle (Celery's returns None)."""
        return self.delay(*args, **kwargs)

    def apply_async_on_commit(self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
                              **options: Any) -> RunHandle:
        """``apply_async`` for the same reason ``delay_on_commit`` is ``delay``."""
        return self.apply_async(args, kwargs, **options)

    # --- Celery's canvas (core/producer/canvas.py; docs/jobs.md "Canvas") -------------

    def s(self, *args: Any, **kwargs: Any) -> Any:
        """A signature of this direct job with (partial) arguments: a canvas member."""
        return _canvas_for(self).signature(self, args, kwargs, {}, False)

    def si(self, *args: Any, **kwargs: Any) -> Any:
        """An immutable signature: in a chain it ignores the previous result."""
        return _canvas_for(self).signature(self, args, kwargs, {}, True)

    def signature(self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
                  **options: Any) -> Any:
        """Celery's ``Task.signature(args, kwargs, **options)`` (``immutable=`` too)."""
        immutable = bool(options.pop("immutable", False))
        return _canvas_for(self).signature(self, args or (), kwargs or {}, options, immutable)

    subtask = signature

    def map(self, items: Iterable[Any]) -> Any:
        """``[job(item) for item in items]`` as a group: one member run per item."""
        return _canvas_for(self).xmap(self, items)

    def starmap(self, items: Iterable[Sequence[Any]]) -> Any:
        """``[job(*item) for item in items]`` as a group: one member run per item."""
        return _canvas_for(self).xstarmap(self, items)

    def chunks(self, items: Iterable[Sequence[Any]], n: int) -> Any:
        """The starmap in chunks of ``n``: a group of groups, its result a list per chunk."""
        return _canvas_for(self).chunks(self, items, n)


def alias_name(job_id: str) -> str:
    """``motir.<job_id>``: the name every job's task answers to (the only one before the cut-over)."""
    return f"{ALIAS_PREFIX}{job_id}"


def task_name(job_id: str) -> str:
    """The task name the engine publishes a run of ``job_id`` under: the job's own
    (``Job.task_name``) when it is defined in this process, else its alias."""
    job = _registry.get(job_id)
    return job.task_name if job is not None else alias_name(job_id)


def celery_name(fn: Callable[..., Any]) -> str | None:
    """The name Celery's default ``gen_task_name`` gives ``fn`` — ``module.function`` — when that
    name is stable across processes: a module-level function of an importable module (not a
    lambda, a nested function or ``__main__``, which Celery names after the app instead)."""
    module, name, qualname = (getattr(fn, attr, None) for attr in ("__module__", "__name__", "__qualname__"))
    if not isinstance(module, str) or not isinstance(name, str) or module == "__main__" or qualname != name:
        return None
    return f"{module}.{name}" if name.isidentifier() else None


@runtime_checkable
class StepLike(Protocol):
    """What a handler's step offers every caller: a worker's ``Step``, a ``CallStep``."""

    @property
    def run_id(self) -> str | None: ...

    @property
    def attempt(self) -> int: ...

    def run(self, step_id: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...


class DirectCallUnsupported(MotirError, TypeError):
    """A step operation that needs a stored run, inside a direct call (``job(...)``)."""


class _NoStream:
    """``CallStep.stream(name)``: ``write`` / ``write_many`` keep nothing."""

    def write(self, item: Any) -> None:
        return None

    def write_many(self, items: Any) -> None:
        return None


class CallStep:
    """The step of a direct call (``job(1, 2)``): ``run`` just calls its function; nothing is
    stored, so nothing is memoized or retried. ``run_id`` is None (Celery's ``request.id`` in
    a direct call), ``attempt`` 1. What needs a stored run — ``sleep``, ``send_event``,
    ``wait_for_event``, ``invoke``, ``gather`` — raises ``DirectCallUnsupported``: use
    ``job.apply(...)``, which runs the body through the engine. ``progress``, ``audit`` and
    ``stream(name).write`` keep nothing (advisory, and there is no run to keep them with)."""

    run_id: str | None = None
    attempt: int = 1

    def run(self, step_id: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        if inspect.iscoroutine(result):
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no loop: run it to its end, as a worker's step does
                return asyncio.run(result)
            return result  # inside an async handler: awaited there
        return result

    def progress(self, meta: Any = None, *, state: str = "PROGRESS") -> None:
        """Nothing to report to: a direct call stores nothing (progress is advisory)."""

    def audit(self, *, provider_key: str | None = None, model_version: str | None = None) -> None:
        """Checked as a worker's ``step.audit`` checks them (``AuditValueError``), then kept nowhere:
        a direct call stores nothing."""
        for column, value in (("provider_key", provider_key), ("model_version", model_version)):
            if value is not None:
                check_audit(column, value)

    def stream(self, name: str) -> _NoStream:
        """A stream whose items go nowhere: a direct call stores nothing."""
        return _NoStream()

    def _needs_a_run(self, what: str) -> NoReturn:
        raise DirectCallUnsupported(
            f"step.{what}() in a direct call of a job (job(...)): the body runs inline with nothing stored, "
            "and this needs a stored run; run it through the engine with job.apply(...) (or .delay())")

    def sleep(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._needs_a_run("sleep")

    def sleep_until(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._needs_a_run("sleep_until")

    def send_event(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._needs_a_run("send_event")

    def wait_for_event(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._needs_a_run("wait_for_event")

    def invoke(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._needs_a_run("invoke")

    def gather(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._needs_a_run("gather")


class CanvasNotSupported(MotirError, TypeError):
    """A canvas this engine cannot make durable: an event or cron job in it, a plain Celery task
    mixed with durable jobs, Celery's own group()/chord() holding durable signatures (the message
    names which, and what to do instead: docs/jobs.md "Canvas")."""


def _canvas_for(job: Job) -> Engine:
    if not job.direct:
        trigger = "an event job" if job.events else "a cron job"
        raise CanvasNotSupported(f"job {job.id!r} is {trigger}: only direct jobs (started by .delay(), "
                                 "defined with neither event= nor cron=) take part in a canvas")
    return current()


def _callbacks(options: Mapping[str, Any]) -> bool:
    return options.get("link") is not None or options.get("link_error") is not None


def _without_callbacks(options: dict[str, Any]) -> dict[str, Any]:
    """``link=None`` / ``link_error=None`` (Celery's defaults, passed through by wrappers) mean none."""
    return {k: v for k, v in options.items() if not (k in ("link", "link_error") and v is None)}


def _engine_for(job: Job) -> Engine:
    if not job.direct:
        trigger = (f"its event {job.events[0]!r} (send_event({job.events[0]!r}, data))" if job.events
                   else f"its cron {job.cron!r} (celery beat)")
        raise JobDefinitionError(f"job {job.id!r} is started by {trigger}, not by .delay() / .apply_async(): "
                                 "only a job defined with neither event= nor cron= is (a direct job)")
    return current()


#: define_job options that are the Celery task's own (celery_app registers them,
#: messages sends them with every message).
TASK_OPTIONS = ("queue", "time_limit", "soft_time_limit")


_registry: dict[str, Job] = {}
#: Task name -> job id, for every job's task name (a name two jobs claim is refused).
_names: dict[str, str] = {}
_listeners: list[Callable[[Job], bool]] = []
_lock = threading.RLock()
#: Event name -> its subscribing jobs (by id), and -> the jobs a cancel_on rule of it cancels: what
#: every send_event asks, kept by each definition (_index_events, under _lock), so a send costs the
#: same with 5 jobs defined as with 500.
_subscribers: dict[str, tuple[Job, ...]] = {}
_cancelled_by: dict[str, tuple[Job, ...]] = {}


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
    ``handler(step, *args, **kwargs)`` (docs/tasks-to-jobs.md). ``retry_policy`` is
    ``"transient"`` (default), ``"idempotent"``, ``"none"`` or a ``RetryPolicy``.
    Durable-flow options (docs/jobs.md): ``priority=0..9``, ``singleton_key=``,
    ``concurrency=(limit, key)``, ``cancel_on=[CancelOn(...)]``, ``throttle=(limit, period[, key])``,
    ``debounce=(period[, key[, max_wait]])`` and ``batch=(max_size, timeout[, key])`` (event jobs:
    the handler gets the list of events); cron jobs also
    take ``catchup=`` and ``overlap=``. Celery's own: ``name=`` (the task name; see the
    module docstring for its default), ``bind=`` (a direct job's handler takes the step
    first, the default; ``bind=False``: only the call's arguments), ``queue=``,
    ``time_limit=``, ``soft_time_limit=``.
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
    name, bind = options.pop("name", None), options.pop("bind", True)
    if name is not None and (not isinstance(name, str) or not TASK_NAME.fullmatch(name) or not name.isprintable()):
        raise JobDefinitionError(f"job {id!r}: name= (the Celery task name) must be 1-200 printable characters "
                                 f"without blanks, got {name!r:.80}")
    if name is not None and name.startswith(ALIAS_PREFIX) and name != alias_name(id):
        raise JobDefinitionError(f"job {id!r}: task names starting {ALIAS_PREFIX!r} are the jobs' aliases "
                                 f"(motir.<job_id>); {name!r} would be job {name[len(ALIAS_PREFIX):]!r}'s")
    if not isinstance(bind, bool):
        raise JobDefinitionError(f"job {id!r}: bind= must be True or False, got {bind!r}")
    if not bind and (events or cron is not None):
        raise JobDefinitionError(f"job {id!r}: bind=False is for direct jobs; an event or cron job's handler "
                                 "is handler(event, step)")
    zone = "UTC"
    from motir_celery.core.schedule import parse_cron, schedule_options

    # catchup= / overlap= are validated here, at definition time, like the cron itself.
    schedule_options(id, options, cron=cron is not None)
    shaped = run_options(id, options)
    check_trigger(id, shaped, event_job=bool(events))  # debounce= / batch= gather events
    if cron is not None:
        cron, zone = parse_cron(cron, timezone, job_id=id)

    def decorate(handler: Callable[..., Any]) -> Job:
        if not callable(handler):
            raise JobDefinitionError(f"job {id!r}: the handler must be callable")
        direct = not events and cron is None
        job = Job(id=id, handler=handler, events=events, cron=cron, timezone=zone,
                  retry_policy=policy, options=options, run_options=shaped,
                  name=name if name is not None else (celery_name(handler) if direct else None), bind=bind)
        return _add(job, "given as name=" if name is not None else "the name Celery gives its function")

    return decorate


def define_task_job(id: str, name: str, handler: Callable[..., Any], retry_policy: RetryPolicy,
                    options: Mapping[str, Any]) -> Job:
    """Register the job of Celery task ``name`` made durable (adapter/tasks.py): a direct job whose
    runs are that task's messages, whose ``handler(step, *args, **kwargs)`` runs the task's body."""
    if not JOB_ID.fullmatch(id):
        raise JobDefinitionError(f"job id {id!r} must be 1-200 characters of letters, digits, '.', '_' or '-'")
    job = Job(id=id, handler=handler, retry_policy=retry_policy, options=dict(options), name=name, celery=True)
    return _add(job, "a Celery task's name")


def _add(job: Job, named: str) -> Job:
    """Put ``job`` in the registry (its id's earlier definition from the same function replaced)
    and tell the listeners."""
    with _lock:
        existing = _registry.get(job.id)
        if existing is not None and _origin(existing.handler) != _origin(job.handler):
            raise JobDefinitionError(f"job id {job.id!r} is already defined by {_origin(existing.handler)}")
        owner = _names.get(job.task_name)
        if owner is not None and owner != job.id:
            raise JobDefinitionError(
                f"job {job.id!r}: its task name {job.task_name!r} is already job {owner!r}'s ({named}); "
                "give one of them a name= of its own")
        # Same function re-imported (e.g. a module imported under two names
        # by a test runner): keep one definition, not an error.
        if existing is not None:
            _names.pop(existing.task_name, None)
        _registry[job.id] = job
        _names[job.task_name] = job.id
        _index_events(job, existing)
        listeners = list(_listeners)
    for listener in listeners:
        if not listener(job):
            _forget(listener)
    return job


def _index_events(job: Job, existing: Job | None) -> None:
    """Put ``job`` in the event indexes in place of ``existing`` (its id's previous definition, if
    any); the caller holds _lock. Each entry is replaced whole, in job-id order, so a reader without
    the lock sees the old one or the new one; a definition costs its own events, not the registry's."""
    for index, events_of in ((_subscribers, _events), (_cancelled_by, _cancel_events)):
        names = events_of(job)
        for name in events_of(existing) if existing is not None else ():
            if name in names:
                continue  # replaced below, never left without the job in between
            kept = tuple(j for j in index.get(name, ()) if j.id != job.id)
            if kept:
                index[name] = kept
            else:
                index.pop(name, None)
        for name in names:
            others = [j for j in index.get(name, ()) if j.id != job.id]
            index[name] = tuple(sorted([*others, job], key=lambda j: j.id))


def _events(job: Job) -> tuple[str, ...]:
    return job.events


def _cancel_events(job: Job) -> tuple[str, ...]:
    """The events a cancel_on rule of ``job`` listens to, each once."""
    return tuple(dict.fromkeys(r.event for r in job.run_options.cancel_on))


def _origin(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


def find_job(job_id: str) -> Job | None:
    """The job registered as ``job_id`` in this process, or None."""
    return _registry.get(job_id)


def job_for_task(name: str) -> Job | None:
    """The job whose Celery task answers to ``name`` (its task name or its alias), or None."""
    job_id = _names.get(name)
    if job_id is None and name.startswith(ALIAS_PREFIX):
        job_id = name[len(ALIAS_PREFIX):]
    return _registry.get(job_id) if job_id is not None else None


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
    """The jobs ``event_name`` starts a run of, by id."""
    return list(_subscribers.get(event_name, ()))


def cancelled_by(event_name: str) -> list[Job]:
    """Jobs with a cancel_on rule for ``event_name`` (send_event asks on every event), by id."""
    return list(_cancelled_by.get(event_name, ()))


def on_job_defined(listener: Callable[[Job], bool]) -> None:
    """Call ``listener`` for every job defined so far and every job defined later, until it
    returns False (what it registered jobs with is gone: it is forgotten)."""
    with _lock:
        _listeners.append(listener)
        jobs = list(_registry.values())
    for job in jobs:
        if not listener(job):
            _forget(listener)
            return


def _forget(listener: Callable[[Job], bool]) -> None:
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)
