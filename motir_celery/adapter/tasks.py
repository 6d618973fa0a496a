"""Celery tasks made durable: ``@app.task(durable=True)`` — a team's own task, its runs in Postgres.

A task is durable when its decorator says ``durable=True`` (``@app.task``, ``@shared_task``, or a
``base=`` class's attribute), or when its app sets ``motir_durable_tasks = True``: then every task of
the app but Celery's own (``celery.*``) and the engine's job tasks, unless a task says
``durable=False``. Its name, options, body and call sites stay. ``attach(app)`` adds one annotation
to the app's ``task_annotations`` (Celery's own way to change task classes from configuration,
``DurableTasks``), which gives each durable task class:

* ``apply_async`` (and so ``delay``, signatures, Celery's canvas): the run is written, keyed on the
  task id, and committed (``Engine.enqueue``: one statement) before Celery sends the task's own
  message, unchanged. Arguments the run cannot hold raise ``PayloadError`` here, before anything
  is sent. Arguments and the message's canvas fields are stored as Celery's JSON serializer writes
  them (bytes, datetimes, decimals, UUIDs kept as kombu tags them).
* ``__call__``, in a worker: the message's run is claimed before the body runs and settled after
  (``Engine.execute``: claim, the body, settle — one statement each). A copy of a message whose run
  is running or done runs nothing; a message no producer wrote a run for (``send_task``, a
  ``beat_schedule`` entry, a client without ``attach``) is adopted first.
* ``retry``: Celery's own (``countdown``, ``eta``, ``max_retries``, ``autoretry_for``,
  ``retry_backoff`` ...); the run is queued again by the settle, and the retry message Celery built
  is sent once that settle is committed.
* ``step``: ``self.step.run(step_id, fn, *args)`` inside the body, memoized per run.
* ``update_state``: ``self.update_state(state="PROGRESS", meta={...})`` inside the body is the run's
  progress (``step.progress``: stored with the run in Postgres, fenced by its claim, no WAL flush
  waited for); ``AsyncResult(id).state`` / ``.info`` answer it from there while the attempt runs.

Called directly (``add(1, 2)``) or eagerly (``task_always_eager``, ``apply()``), a durable task is
Celery's: nothing is stored, and ``self.step.run`` just calls its function.

**What stays Celery's.** Celery's tracer calls the body, stores the result in the app's backend,
sends the chain's next link and the callbacks, counts a chord member, calls the errbacks, fires the
signals and the task's ``on_success`` / ``on_failure`` / ``on_retry`` / ``after_return``. The body
sees Celery's ``self.request``; the body's own exception is re-raised to the tracer, so a result
handle raises it as Celery's would.

**Order, and what a crash costs.** Celery sends a task's continuation (the chain's next link, the
callbacks; a chord member's count and a failure's errbacks through the result backend) after its
body. Here whatever a task's message carries of a canvas is sent inside the attempt, before the
settle, so that a worker that dies after the settle has left nothing unsent. One that dies between
the continuation and the settle runs the body again (never its stored steps) and sends the
continuation again: a durable next task has the same task id, so its run runs once; a plain Celery
task runs twice; and a chord member is counted twice by Celery's Redis chord, which then starts its
body before the last member ended.

**A run's message sent again.** A run whose message was lost (a worker killed mid-body with early
acks, a broker restart) is published again by the sweeper as the engine's run message (the run id
its one argument). The body is then called with the stored arguments and the stored canvas fields
are put back on ``self.request``; ``self.request.retries`` is then the attempt number less one
(crashes count), and a retry's changed arguments (``self.retry(args=...)``) are the original ones.

**Revoke.** ``AsyncResult(id).revoke()`` / ``app.control.revoke(id)`` (``DurableControl``) cancels a
queued run in Postgres before Celery broadcasts the revoke; ``terminate=True`` cancels a running one
too, which stops at its next step boundary. A worker that drops a revoked or expired message cancels
its run as well (``task_revoked``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import traceback
import uuid
from datetime import datetime, timezone
from functools import partial
from typing import Any, Callable, Iterable

from celery import Celery, Task, signals
from celery.app.control import Control
from celery.app.task import get_actual_ignore_result
from celery.canvas import group, maybe_signature
from celery.exceptions import Ignore, Reject, Retry
from celery.utils import uuid as celery_uuid
from celery.utils.functional import maybe_list
from kombu.utils import json as kombu_json

from motir_celery.adapter.messages import engine_of
from motir_celery.adapter.protocol import is_run_message
from motir_celery.adapter.worker import engine_thread
from motir_celery.core.engine import Engine
from motir_celery.core.jobs import JOB_ID, CallStep, Job, define_task_job, find_job
from motir_celery.core.retries import RetryPolicy
from motir_celery.errors import (
    LostClaim,
    NonRetriableError,
    PayloadError,
    RateLimited,
    RetryAfterError,
    RetryRequested,
    RunFailed,
)
from motir_celery.store.driver import first
from motir_celery.store.sql import adapter as adapter_sql

__all__ = ["DURABLE", "APP_SETTING", "DurableTasks", "DurableControl", "TaskFailed", "run_id_of", "is_durable",
           "install", "plain", "tagged", "REPLACED"]

log = logging.getLogger("motir_celery.adapter.tasks")

#: The task option that makes a Celery task durable (``@app.task(durable=True)``).
DURABLE = "durable"
#: The app setting that makes every task of an app durable (``app.conf.motir_durable_tasks = True``).
APP_SETTING = "motir_durable_tasks"
#: Runs of a task beyond its ``max_retries`` + 1 that a crash may cost (a lease lost, then run again).
CRASHES = 3
#: The attempt budget standing for ``max_retries=None`` (retry for ever): retries are not bounded
#: by it (``RetryRequested``), only crashes after that many attempts are.
FOREVER = 100_000
#: A run replaced by ``self.replace(sig)`` keeps this key as its result (adapter/backend.py follows it).
REPLACED = "__motir_replaced__"
#: The message header naming the run of a call that reused a task id with other arguments.
RUN_HEADER = "motir_run"
#: The canvas fields of a task's message kept with its run (what a message sent again needs).
_FIELDS = ("callbacks", "errbacks", "chain", "chord", "group", "group_index", "root_id", "parent_id",
           "replaced_task_nesting")
_NAMESPACE = uuid.UUID("4b1b7d55-0c39-4e83-9d1c-6c6e2c8c0f11")


def run_id_of(task_id: Any, nesting: int | None = 0) -> uuid.UUID:
    """The run of Celery task id ``task_id``: the id itself when it is a UUID, else a UUID made from
    it; a replacement (``self.replace``: the same task id, one level deeper) a run of its own."""
    text = str(task_id)
    try:
        base = uuid.UUID(text)
    except ValueError:
        base = uuid.uuid5(_NAMESPACE, text)
    return uuid.uuid5(base, f"replaced:{nesting}") if nesting else base


def plain(value: Any) -> Any:
    """``value`` as Celery's JSON serializer writes it, parsed: bytes, datetimes, decimals and UUIDs
    as kombu's tagged objects; ``PayloadError`` for what it cannot write."""
    try:
        return json.loads(kombu_json.dumps(value))  # type: ignore[no-untyped-call]
    except (TypeError, ValueError, RecursionError) as exc:
        raise PayloadError(f"not serializable by Celery's JSON serializer: {exc}") from None


def tagged(value: Any) -> Any:
    """What ``plain`` wrote, as Celery's JSON serializer reads it back."""
    return kombu_json.loads(json.dumps(value))  # type: ignore[no-untyped-call]


def is_durable(task: Any) -> bool:
    """Whether task (class or instance) runs durably: its ``durable`` option, else its app's setting."""
    own = getattr(task, DURABLE, None)
    if own is not None:
        return bool(own)
    name = str(getattr(task, "name", "") or "")
    return not name.startswith("celery.") and bool(task.app.conf.get(APP_SETTING, False))


class TaskFailed(NonRetriableError):
    """The body of a durable Celery task raised ``exc``: the run fails now (Celery retries only
    through ``self.retry``), stored as ``exc`` itself — its type, message, traceback and, under
    ``celery``, the fields Celery's result backends rebuild it from."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(f"{type(exc).__name__}: {exc}")
        self.exc = exc

    def __motir_error__(self) -> dict[str, Any]:
        exc = self.exc
        kind = type(exc)
        stored: dict[str, Any] = {
            "type": f"{kind.__module__}.{kind.__qualname__}", "message": str(exc),
            "traceback": "".join(traceback.format_exception(kind, exc, exc.__traceback__)),
        }
        try:
            stored["celery"] = {"exc_type": kind.__qualname__, "exc_module": kind.__module__,
                                "exc_message": plain(list(exc.args))}
        except PayloadError:
            stored["celery"] = {"exc_type": kind.__qualname__, "exc_module": kind.__module__,
                                "exc_message": [str(exc)]}
        return stored


class _Run:
    """One durable execution of a task in this thread: what the job's handler needs from the
    task's ``__call__``, and what the handler leaves for it."""

    def __init__(self, task: Task, body: Callable[..., Any], args: list[Any], kwargs: dict[str, Any],
                 run_id: uuid.UUID, recovered: bool) -> None:
        self.task, self.body, self.args, self.kwargs = task, body, args, kwargs
        self.run_id, self.recovered = run_id, recovered
        self.step: Any = None
        self.result: Any = None
        #: The body's own exception (the run failed with it).
        self.error: BaseException | None = None
        #: Celery's Retry / Ignore / Reject that ended the body: re-raised to the tracer.
        self.ended: BaseException | None = None
        #: Celery's retry message, sent after the settle (``RetryRequested.publish``).
        self.retry_send: Callable[[], Any] | None = None
        #: The body ended by ``self.replace(sig)``: the task's result is its replacement's.
        self.replaced = False
        #: How many times this execution sent each task id (``_call_of``).
        self.sends: dict[str, int] = {}
        #: The message's task id differs from the run's task id (a run message for a task id that is
        #: not a UUID, or a replacement): the result is stored here, under the task's id.
        self.own_result = False


class _Runs(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Run] = []


_runs = _Runs()


def _current(task: Any = None) -> _Run | None:
    stack = _runs.stack
    if not stack or (task is not None and stack[-1].task is not task):
        return None
    return stack[-1]


def _nesting(request: Any) -> int:
    return int(getattr(request, "replaced_task_nesting", 0) or 0)


# --- the task class's methods -------------------------------------------------------------


def _around_call(orig: Callable[..., Any]) -> Callable[..., Any]:
    plain_call = orig is Task.__call__

    def __call__(self: Task, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly or request.is_eager or _current(self) is not None:
            return orig(self, *args, **kwargs)  # Celery's: a direct call, an eager one, the body calling itself
        # The tracer pushed the request already: Task.__call__ would push a direct call's over it.
        body = self.run if plain_call else partial(orig, self)
        return _durably(self, body, list(args), dict(kwargs))

    return __call__


def _around_apply_async(orig: Callable[..., Any]) -> Callable[..., Any]:
    def apply_async(self: Task, args: Any = None, kwargs: Any = None, task_id: Any = None, producer: Any = None,
                    link: Any = None, link_error: Any = None, shadow: Any = None, **options: Any) -> Any:
        app = self.app
        subject = options.pop("subject", None)   # the run's (core/producer/direct.py), not the message's
        send = partial(orig, self, args, kwargs, task_id=task_id, producer=producer, link=link,
                       link_error=link_error, shadow=shadow, **options)
        if app.conf.task_always_eager:
            return send()  # Celery runs it here (apply): nothing is stored
        running = _current()
        if (running is not None and running.task.name == self.name and "retries" in options
                and task_id == running.task.request.id):
            if running.run_id != run_id_of(task_id, _nesting(running.task.request)):  # a second call's run
                options["headers"] = {**(options.get("headers") or {}), RUN_HEADER: str(running.run_id)}
                send = partial(orig, self, args, kwargs, task_id=task_id, producer=producer, link=link,
                               link_error=link_error, shadow=shadow, **options)
            running.retry_send = send  # self.retry's message: sent once the settle is committed
            return self.AsyncResult(task_id)
        if self.typing:
            self.__header__(*(args or ()), **(kwargs or {}))  # Celery's own check: TypeError before writing
        task_id = task_id or celery_uuid()
        nesting = int(options.get("replaced_task_nesting") or 0)
        job = _job_of(self)
        timing = {k: options[k] for k in ("countdown", "eta") if options.get(k) is not None}
        if subject is not None:
            timing["subject"] = subject
        call = _call_of(running, task_id, nesting)
        try:
            stored = plain(list(args or ())), plain(dict(kwargs or {})), plain(
                {**_fields_of(app, task_id, link, link_error, options), "call": str(call)})
            written = engine_of(app).enqueue(job, *stored[:2], {"task_id": str(run_id_of(task_id, nesting)),
                                                                **timing}, stored[2])
            if written.conflict:
                # The task id is another call's already (Celery lets a frozen signature be sent
                # again: a chord applied twice, an errback linked to each member of a group): this
                # call is a run of its own, and its message names it.
                again = uuid.uuid5(run_id_of(task_id, nesting), f"call:{call}")
                engine_of(app).enqueue(job, *stored[:2], {"task_id": str(again), **timing}, stored[2])
                options["headers"] = {**(options.get("headers") or {}), RUN_HEADER: str(again)}
        except PayloadError as exc:
            raise PayloadError(f"task {self.name!r}: {exc}") from None
        return orig(self, args, kwargs, task_id=task_id, producer=producer, link=link, link_error=link_error,
                    shadow=shadow, **options)

    return apply_async


def _call_of(running: _Run | None, task_id: str, nesting: int) -> uuid.UUID:
    """Which call of task id ``task_id`` this send is. Inside a durable execution the same on every
    execution of the run that sends it — the n-th send of that id by that run —, so a run that runs
    again after a crash sends its continuation again as the same call (its run runs once); anywhere
    else a new one: a frozen signature sent again is another call, as Celery runs it again."""
    if running is None:
        return uuid.uuid4()
    seen = running.sends[task_id] = running.sends.get(task_id, 0) + 1
    return uuid.uuid5(running.run_id, f"send:{task_id}:{nesting}:{seen}")


def _second_run(first: uuid.UUID, args: Any, kwargs: Any) -> uuid.UUID:
    """The run of a message, adopted by a worker, that reuses a task id with other arguments: one per
    (task id, arguments)."""
    digest = hashlib.sha256(json.dumps([args, kwargs], sort_keys=True).encode()).hexdigest()[:32]
    return uuid.uuid5(first, f"call:{digest}")


def _around_update_state(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``self.update_state(state=..., meta=...)`` in a durable execution: the run's progress, stored in
    Postgres with the run and fenced by its claim (``step.progress``); the app's result backend gets
    nothing (the runs table is the truth: adapter/backend.py answers it). Anywhere else — a plain task,
    a direct or eager call, another task's id, another thread — Celery's own."""

    def update_state(self: Task, task_id: Any = None, state: Any = None, meta: Any = None, **kwargs: Any) -> Any:
        run = _current(self)
        if run is None or run.step is None or (task_id is not None and task_id != self.request.id):
            return orig(self, task_id, state, meta, **kwargs)
        run.step.progress(plain(meta), state="PROGRESS" if state is None else state)
        return None

    return update_state


def _around_on_replace(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``self.replace(sig)``: Celery's, the run marked replaced (its result is its replacement's:
    the replacement keeps the task id, as a run of its own, one ``replaced_task_nesting`` deeper)."""

    def on_replace(self: Task, sig: Any) -> Any:
        run = _current(self)
        if run is not None:
            run.replaced = True
        return orig(self, sig)

    return on_replace


def _step_of(task: Task) -> Any:
    """``self.step``: the run's step inside a durable execution, else a direct call's."""
    run = _current(task)
    return run.step if run is not None and run.step is not None else CallStep()


def _fields_of(app: Celery, task_id: str, link: Any, link_error: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The message's canvas fields, as its request will show them (``send_task`` fills root and
    parent from the task it is sent from)."""
    parent = app.current_worker_task
    root_id, parent_id = options.get("root_id"), options.get("parent_id")
    if parent is not None and parent.request.id:
        root_id = root_id or parent.request.root_id or parent.request.id
        parent_id = parent_id or parent.request.id
    found = {"id": task_id, "callbacks": maybe_list(link), "errbacks": maybe_list(link_error),
             "chain": options.get("chain"), "chord": options.get("chord"), "group": options.get("group_id"),
             "group_index": options.get("group_index"), "root_id": root_id, "parent_id": parent_id,
             "replaced_task_nesting": options.get("replaced_task_nesting")}
    return {k: v for k, v in found.items() if v is not None}


# --- a worker's execution -----------------------------------------------------------------


def _durably(task: Task, body: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
    """The message's run: claimed (adopted first when no producer wrote it), the body, settled;
    the ending told in Celery's terms (the value, the body's exception, Retry, Ignore)."""
    engine = engine_of(task.app)
    engine_thread().ensure(engine)  # this process's heartbeats (a prefork child's first run starts them)
    request = task.request
    job = _job_of(task)
    recovered = is_run_message(request, job.id, tuple(args), kwargs) and _is_uuid(args[0])
    named = getattr(request, RUN_HEADER, None)  # a second call under a task id (apply_async)
    if recovered:
        run_id = uuid.UUID(args[0])
    elif isinstance(named, str) and _is_uuid(named):
        run_id = uuid.UUID(named)
    else:
        run_id = run_id_of(request.id, _nesting(request))
    run = _Run(task, body, args, kwargs, run_id, recovered)
    worker = f"{request.hostname or 'worker'}/{os.getpid()}"
    _runs.stack.append(run)
    try:
        outcome = engine.execute(run_id, job_id=job.id, worker=worker)
        if outcome.state == "skipped" and not recovered and _adopted(engine, task, job, run):
            outcome = engine.execute(run.run_id, job_id=job.id, worker=worker)  # (another run id on a conflict)
    finally:
        _runs.stack.pop()
    return _ending(engine, run, outcome.state, outcome.detail)


def _is_uuid(text: Any) -> bool:
    try:
        uuid.UUID(str(text))
    except ValueError:
        return False
    return True


def _adopted(engine: Engine, task: Task, job: Job, run: _Run) -> bool:
    """Write the run of a message no producer wrote one for; False: nothing new to execute (the run
    exists already, or the message cannot be stored: then a DLQ entry says why)."""
    request = task.request
    fields = _fields_of(task.app, request.id, request.callbacks, request.errbacks,
                        {"chain": request.chain, "chord": request.chord, "group_id": request.group,
                         "group_index": request.group_index, "root_id": request.root_id,
                         "parent_id": request.parent_id, "replaced_task_nesting": request.replaced_task_nesting})
    shown = {"argsrepr": str(request.argsrepr or run.args)[:1000], "kwargsrepr": str(request.kwargsrepr or run.kwargs)[:1000]}
    try:
        args, kwargs, kept = plain(run.args), plain(run.kwargs), plain(fields)
    except PayloadError:  # refused below, with its reason, into the DLQ
        args, kwargs, kept = run.args, run.kwargs, None
    adopted = engine.adopt(job, args, kwargs, str(run.run_id), task_name=task.name, shown=shown, celery=kept)
    if adopted.conflict and kept is not None:  # the task id was another message's: this one is a run of its own
        run.run_id = _second_run(run.run_id, args, kwargs)
        adopted = engine.adopt(job, args, kwargs, str(run.run_id), task_name=task.name, shown=shown, celery=kept)
    if adopted.reason is not None:
        log.error("a message of durable task %s (id %.100s) cannot be stored as a run: %s; DLQ entry %s",
                  task.name, request.id, adopted.reason[:500], adopted.dlq_id)
        run.error = PayloadError(f"task {task.name!r}: its message cannot be stored as a run: {adopted.reason}")
        return False
    return adopted.run_id is not None and not adopted.deduplicated


def _ending(engine: Engine, run: _Run, state: str, detail: str) -> Any:
    task = run.task
    if state == "succeeded":
        if run.ended is not None:
            raise run.ended  # Ignore: replaced (self.replace), or the body chose to end so
        if run.own_result:
            raise Ignore()  # stored under the task's id already (_succeeded)
        return run.result
    if state == "failed":
        if run.ended is not None:
            raise run.ended  # Reject(requeue=False)
        if run.error is not None:
            raise run.error  # the task's own exception, as Celery raises it
        raise RunFailed(f"run {run.run_id} of task {task.name} failed for good; DLQ entry {detail}")
    if state == "retrying":
        if run.ended is not None:
            raise run.ended  # Celery's Retry: RETRY state, on_retry, the task_retry signal
        raise Retry(f"run {run.run_id} of task {task.name}: queued again {detail}")
    if state == "skipped" and run.error is not None:
        raise run.error  # a message that cannot be stored as a run (its DLQ entry)
    if state in ("skipped", "cancelled", "lost") and _run_state(engine, run.run_id) == "cancelled":
        task.backend.mark_as_revoked(task.request.id, "revoked", request=task.request)
        log.info("run %s of task %s was revoked: not run", run.run_id, task.name)
    else:
        log.info("run %s of task %s: %s%s; nothing more under this message", run.run_id, task.name, state,
                 f" ({detail})" if detail else "")
    raise Ignore()  # a copy of a message already run or running, a run not due yet, a step.sleep ...


def _run_state(engine: Engine, run_id: uuid.UUID) -> str | None:
    with engine.pool().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        row = first(conn, adapter_sql.RUN_META, {"run_id": run_id})
    return None if row is None else str(row["state"])


class TaskBody:
    """The handler of a durable task's job: the task's body, called by the runner between the claim
    and the settle with the run's step (``handler(step, *args, **kwargs)``)."""

    def __init__(self, task: Any) -> None:
        self.task = task
        self.__module__ = __name__
        self.__qualname__ = f"TaskBody[{task.name}]"

    def __call__(self, step: Any, *args: Any, **kwargs: Any) -> Any:
        run = _current()
        if run is None or str(run.run_id) != step.run_id:
            return self._alone(step, args, kwargs)
        run.step = step
        if run.recovered:
            _restore(run, step)
        return _body(run)

    def _alone(self, step: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A run executed outside Celery's tracer (an eager app's engine): the body under a request of
        the run's own."""
        task = self.task.app.tasks[self.task.name]  # the app's instance (annotate is given the class)
        run = _Run(task, task.run, list(args), kwargs, uuid.UUID(step.run_id), True)
        task.push_request(id=step.run_id, args=run.args, kwargs=kwargs, called_directly=False, is_eager=False)
        _runs.stack.append(run)
        try:
            run.step = step
            _restore(run, step)
            return _body(run)
        finally:
            _runs.stack.pop()
            task.pop_request()


def _restore(run: _Run, step: Any) -> None:
    """A run message (the run id its one argument): the stored arguments and canvas fields put back."""
    data = step.event_data if isinstance(step.event_data, dict) else {}
    request = run.task.request
    run.args, run.kwargs = list(tagged(data.get("args") or [])), dict(tagged(data.get("kwargs") or {}))
    fields = tagged(data.get("celery") or {})
    original = fields.get("id")
    if original is not None and original != request.id:
        request.id = original
        run.own_result = True
    for name in _FIELDS:
        setattr(request, name, fields.get(name))
    request.args, request.kwargs = run.args, run.kwargs
    request.retries = max(step.attempt - 1, 0)


def _body(run: _Run) -> Any:
    """The body, and what Celery sends after it, before the settle (the module docstring)."""
    try:
        value = run.body(*run.args, **run.kwargs)
    except Retry as exc:
        run.ended = exc
        send = run.retry_send
        raise RetryRequested(_delay(exc), f"Retry: {exc}",
                             publish=None if send is None else (lambda *_: send())) from exc
    except Reject as exc:
        run.ended = exc
        if exc.requeue:  # the broker delivers the message again
            raise RetryRequested(0.0, f"Reject(requeue=True): {exc}", publish=lambda *_: None) from exc
        raise TaskFailed(exc) from exc
    except Ignore as exc:
        run.ended = exc
        return {REPLACED: True} if run.replaced else None
    except (LostClaim, RetryAfterError, RateLimited):
        raise  # the engine's own endings (a fenced write, a motir retry), as for any job
    except Exception as exc:
        run.error = exc
        _failed(run, exc)
        raise TaskFailed(exc) from exc
    run.result = value
    _succeeded(run, value)
    if get_actual_ignore_result(run.task, run.task.request):
        return None  # ignored, as Celery's backend ignores it: the run keeps its state, no result
    try:
        return plain(value)
    except PayloadError:
        log.warning("run %s of task %s: its result is not JSON (Celery's serializer); the run keeps none",
                    run.run_id, run.task.name)
        return None


def _delay(retry: Retry) -> float:
    when = retry.when
    if isinstance(when, datetime):
        moment = when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)
        return min(max((moment - datetime.now(timezone.utc)).total_seconds(), 0.0), 365 * 86400.0)
    return min(max(float(when or 0.0), 0.0), 365 * 86400.0)


def _succeeded(run: _Run, value: Any) -> None:
    """The chain's next link and the callbacks sent, a chord member counted, as Celery's tracer
    would after the body: before the settle here. Cleared from the request, so the tracer does not
    again."""
    task = run.task
    request = task.request
    if request.callbacks or request.chain:
        _dispatch(task, value, request)
        request.callbacks = request.chain = None
    if request.chord or run.own_result:
        task.backend.mark_as_done(request.id, value, request, not get_actual_ignore_result(task, request))
        request.chord = None


def _dispatch(task: Task, value: Any, request: Any) -> None:
    """Celery's tracer's dispatch of the callbacks (several: as one group) and the chain's next link."""
    app = task.app
    parent_id, root_id = request.id, request.root_id or request.id
    priority = (request.delivery_info or {}).get("priority") if app.conf.task_inherit_parent_priority else None
    options = {"parent_id": parent_id, "root_id": root_id, "priority": priority}
    callbacks = [maybe_signature(c, app=app) for c in request.callbacks or ()]
    if len(callbacks) == 1:
        callbacks[0].apply_async((value,), **options)
    elif callbacks:
        for each in (c for c in callbacks if isinstance(c, group)):
            each.apply_async((value,), **options)
        rest = [c for c in callbacks if not isinstance(c, group)]
        if rest:
            group(rest, app=app).apply_async((value,), **options)
    if request.chain:
        chain = list(request.chain)
        maybe_signature(chain[-1], app=app).apply_async((value,), chain=chain[:-1], **options)


def _failed(run: _Run, exc: BaseException) -> None:
    """A failure told to the chord, the rest of the chain and the errbacks, as Celery's tracer would
    after the body: before the settle here."""
    task = run.task
    request = task.request
    if not (request.errbacks or request.chord or request.chain or run.own_result):
        return
    store = not get_actual_ignore_result(task, request) or task.store_errors_even_if_ignored
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    task.backend.mark_as_failure(request.id, exc, text, request=request, store_result=store, call_errbacks=True)
    request.errbacks = request.chord = request.chain = None


# --- registration -------------------------------------------------------------------------


def _job_of(task: Any) -> Job:
    found = find_job(_job_id(task.name))
    if found is None or not found.celery:
        return _define(task)
    return found


def _job_id(name: str) -> str:
    """A task name as a job id: itself when it is one, else its allowed characters and a hash."""
    if JOB_ID.fullmatch(name):
        return name
    kept = re.sub(r"[^A-Za-z0-9_.\-]", "_", name)[:180].lstrip("._-") or "task"
    return f"{kept}-{uuid.uuid5(_NAMESPACE, name).hex[:12]}"


def _define(task: Any) -> Job:
    retries = task.max_retries
    attempts = (FOREVER if retries is None else int(retries)) + 1 + CRASHES
    options = {k: getattr(task, k) for k in ("queue", "time_limit", "soft_time_limit") if getattr(task, k, None)}
    policy = RetryPolicy(max_attempts=attempts, backoff=0.0, factor=1.0, jitter=0.0, name="celery")
    return define_task_job(_job_id(task.name), task.name, TaskBody(task), policy, options)


class DurableTasks:
    """The annotation ``attach`` puts first in ``task_annotations``: a durable task class gets its
    durable methods (the module docstring), on top of what the app's own annotations give it.
    (Celery applies the first annotation that matches a task, so this one applies theirs too.)"""

    def __init__(self, theirs: Iterable[Any]) -> None:
        self.theirs = list(theirs)

    def annotate(self, task: Any) -> dict[str, Any] | None:
        if not is_durable(task):
            return None
        _define(task)
        found = next(filter(None, (a.annotate(task) for a in self.theirs if hasattr(a, "annotate"))), None)
        return {**(found or {}), **METHODS}

    def annotate_any(self) -> None:
        return None


#: What a durable task class is given (``Task.annotate``: ``@name`` wraps the method).
METHODS: dict[str, Any] = {
    "@__call__": _around_call,
    "@apply_async": _around_apply_async,
    "@on_replace": _around_on_replace,
    "@update_state": _around_update_state,
    "step": property(_step_of, doc="The run's step: ``self.step.run(step_id, fn, *args)`` (memoized)."),
}


class DurableControl(Control):
    """Celery's ``app.control`` on an attached app: ``revoke`` cancels durable runs first."""

    def revoke(self, task_id: Any, destination: Any = None, terminate: bool = False, signal: Any = "SIGTERM",
               **kwargs: Any) -> Any:
        revoke_runs(engine_of(self.app), maybe_list(task_id) or [], terminate)
        return super().revoke(task_id, destination=destination, terminate=terminate, signal=signal, **kwargs)


def revoke_runs(engine: Engine, task_ids: Iterable[Any], terminate: bool) -> int:
    """Cancel the runs of ``task_ids``: queued ones; with ``terminate`` running ones too."""
    done = 0
    with engine.pool().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for task_id in task_ids:
            row = first(conn, adapter_sql.REVOKE, {"run_id": run_id_of(task_id), "terminate": bool(terminate)})
            done += int(bool(row and row["revoked"]))
    return done


def _on_revoked(sender: Any = None, request: Any = None, terminated: bool = False, expired: bool = False,
                **_: Any) -> None:
    """A worker dropped a revoked or expired message of a durable task: its run is cancelled too."""
    if sender is None or request is None or not is_durable(sender):
        return
    try:
        # terminate=True stops a running run too; a plain revoke (or an expiry) only a queued one.
        revoke_runs(engine_of(sender.app), [getattr(request, "id", None) or request.task_id], bool(terminated))
    except Exception as exc:  # noqa: BLE001 — the message is dropped all the same; the claim refuses it later
        log.warning("could not cancel the run of revoked task %s: %s", getattr(request, "id", "?"), exc)


def install(app: Celery) -> None:
    """Make ``app``'s durable tasks durable (``attach``): the annotation, the revoke, the worker's hook."""
    theirs = app.conf.task_annotations
    from celery.app.annotations import prepare

    app.conf.task_annotations = [DurableTasks(prepare(theirs)), *maybe_list(theirs or [])]
    app.__dict__.pop("annotations", None)  # Celery's cached reading of the setting
    if app.finalized:  # tasks bound already: annotated now
        for task in app.tasks.values():
            if is_durable(task):
                _define(task)
                for key, value in METHODS.items():
                    if key.startswith("@"):
                        type(task).add_around(key[1:], value)
                    else:
                        setattr(type(task), key, value)
    if app.control_cls == "celery.app.control:Control":
        app.control_cls = f"{__name__}:DurableControl"
        app.__dict__.pop("control", None)
    signals.task_revoked.connect(_on_revoked, weak=False, dispatch_uid="motir_celery.adapter.tasks.revoked")
