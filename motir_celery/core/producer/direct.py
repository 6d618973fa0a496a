"""Direct runs: ``job.delay(*args, **kwargs)`` and ``job.apply_async(...)``, Celery-shaped.

A direct job (``define_job`` with neither ``event=`` nor ``cron=``) is started
the way a Celery task is. One call writes one event named ``direct.<job_id>``
whose data is ``{"args": [...], "kwargs": {...}}`` and, in the same statement,
its one run (``producer_sql.DIRECT_RUN``): the event log, the DLQ (which copies
the event's data, so a replay re-runs the same arguments), ``motir runs show``
and RLS treat it as any other run; no schema change. The worker calls
``handler(step, *args, **kwargs)``; ``step.run_id`` and ``step.attempt`` carry
what an event job reads from ``event``.

* **Arguments** are checked as event data is (JSON, no NUL or lone surrogate,
  at most ``MOTIR_MAX_PAYLOAD_BYTES``) before anything is written, and come
  back as JSON gives them (a tuple as a list), as with Celery's json serializer.
* **Idempotency.** ``idempotency_key=`` — or Celery's ``task_id=``, the natural
  key of a call site that already passes one — is the event's key, unique per
  ``(name, key)``, so per job: a second call with it writes nothing and returns
  the first call's run with ``deduplicated=True``. A singleton job
  (``singleton_key=``) whose run is active answers the same way.
* **countdown / eta.** The run's ``run_at`` is computed by Postgres in the
  INSERT: ``now() + countdown`` (a duration is bound, never this process's
  clock), or ``eta`` bound as ``timestamptz`` (an absolute instant the caller
  chose; a naive one is taken as UTC, as Celery does with ``enable_utc``). The
  claim refuses the run before it is due. A run due within
  ``MOTIR_REPUBLISH_AFTER`` is published at once with a Celery countdown of
  the database's ``run_at - now()``; a later one gets no message until the
  sweeper publishes it once due (long countdowns are what Redis's visibility
  timeout redelivers in a loop).
* **queue / priority.** ``priority=`` (0-9) is the run's priority, stored on its
  row and sent as the message priority. ``queue=`` routes this call's message;
  a message the sweeper re-publishes (the first one was lost) follows the job's
  own route (``define_job(queue=)`` / ``task_routes``).
* **subject.** ``subject=("media_item", "42")`` names what the run is about (seed 003): a type of
  1-64 of ``A-Za-z0-9_.-`` and an id of 1-255 characters, kept in the arguments' ``"subject"`` and
  on the run's row (``subject_type``, ``subject_id``; migration 0020), so an operator cancels a
  subject's open runs in one statement (``cancel_subject``) and a producer asks whether one is
  already active for it (``active_for_subject``).
* **Publishing** happens after the commit that created the run; with
  ``session=`` (SQLAlchemy), or inside a framework transaction the engine
  joins (``Engine.join_transactions``: Django's ``atomic()``), when that
  transaction commits, and never if it rolls back. The handle of such a run
  refuses ``get()`` until then (``RunNotCommitted``).
* **Run ids.** A ``task_id=`` that is a UUID becomes the run's id (migration 0010),
  so ``AsyncResult(task_id)`` answers for it; any other key leaves the id random.
* **Adoption** (``adopt``): a message in Celery's own protocol for a direct job — an
  old producer, ``send_task``, ``celery call``, a ``beat_schedule`` entry — is turned
  by the worker that receives it into the run ``.delay()`` would have written, keyed
  on its Celery task id (a redelivered or duplicated copy is the same run), through
  the same checks and the same statement; the worker then executes it. Arguments the
  checks refuse become a run failed at once with its DLQ row (``adapter_sql.ADOPT_REFUSED``): the
  refusal is kept where operators look, with its reason.
"""

from __future__ import annotations

import json
import logging
import math
import re
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from motir_celery.core.jobs import CanvasNotSupported, Job
from motir_celery.core.producer.events import MAX_IDEMPOTENCY_KEY, publish_after_commit, validate_event
from motir_celery.core.producer.results import CommitGate, RunHandle
from motir_celery.core.publish import Publish, publish_or_log
from motir_celery.core.shapes import check_subject, event_name
from motir_celery.core.tracing import current_traceparent
from motir_celery.errors import PayloadError, checked_delay
from motir_celery.settings import Settings
from motir_celery.store import records
from motir_celery.store.driver import first
from motir_celery.store.records import RunSpec
from motir_celery.store.sql import adapter as adapter_sql
from motir_celery.store.sql import producer as producer_sql

if TYPE_CHECKING:  # the ORM only for a caller's own Session: a worker never imports it (its memory)
    from sqlalchemy.orm import Session

    from motir_celery.core.engine import Engine
    from motir_celery.store.driver import Conn

__all__ = ["DirectCall", "prepare", "apply_async", "APPLY_ASYNC_OPTIONS", "Adopted", "adopt", "enqueue", "refuse", "MAX_SHOWN",
           "Written", "write", "delayed", "should_publish"]

log = logging.getLogger("motir_celery.core.producer.direct")

#: What apply_async accepts besides args and kwargs (anything else is refused by name).
APPLY_ASYNC_OPTIONS = ("countdown", "eta", "queue", "priority", "task_id", "idempotency_key", "workspace_id",
                       "subject", "session")
#: Celery's canvas internals (what its chain/chord put on a message): refused, pointing at the canvas.
_CANVAS_OPTIONS = ("link", "link_error", "chain", "chord", "group_id")


@dataclass(frozen=True)
class DirectCall:
    """One validated direct call, ready for ``producer_sql.DIRECT_RUN``."""

    job: Job
    name: str
    encoded: str
    workspace_id: str | None
    key: str | None
    countdown: float
    eta: datetime | None
    queue: str | None
    priority: int | None
    spec: RunSpec

    def params(self, settings: Settings) -> dict[str, Any]:
        s = self.spec
        return {"name": self.name, "data": self.encoded, "workspace_id": self.workspace_id, "key": self.key,
                "eta": self.eta, "countdown": self.countdown, "job_id": s.job_id, "max_attempts": s.max_attempts,
                "policy": s.policy, "priority": s.priority, "singleton": s.singleton_key,
                "concurrency": s.concurrency_key, "cancel_key": s.cancel_key,
                "traceparent": current_traceparent(), "after": settings.republish_after}

    def existing_params(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "job_id": self.job.id, "singleton": self.spec.singleton_key,
                "data": self.encoded, "workspace_id": self.workspace_id}


def prepare(job: Job, args: Sequence[Any], kwargs: Mapping[str, Any], options: Mapping[str, Any],
            settings: Settings, *, celery: Mapping[str, Any] | None = None) -> DirectCall:
    """Check one call before anything is written: its options, its arguments, its timing.
    ``celery``: a Celery task's run keeps its message's own fields beside its arguments (what a
    message the engine sends for it again needs: adapter/tasks.py)."""
    from_canvas = [k for k in options if k in _CANVAS_OPTIONS]
    if from_canvas:
        raise CanvasNotSupported(
            f"apply_async() of job {job.id!r}: {', '.join(from_canvas)} belong to a canvas; build it with "
            "job.s() and chain / group / chord (from motir_celery), or pass link= / link_error= to "
            "job.apply_async, which makes the canvas")
    unknown = sorted(set(options) - set(APPLY_ASYNC_OPTIONS))
    if unknown:
        raise TypeError(f"apply_async() of job {job.id!r}: unsupported option(s) {', '.join(unknown)}; "
                        f"supported: args, kwargs, {', '.join(APPLY_ASYNC_OPTIONS)}")
    if isinstance(args, (str, bytes, Mapping)) or not isinstance(args, Sequence):
        raise PayloadError(f"args of job {job.id!r} must be a list or tuple, got {type(args).__name__}")
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise PayloadError(f"kwargs of job {job.id!r} must be a mapping with string keys")
    key, task_id = options.get("idempotency_key"), options.get("task_id")
    if key is not None and task_id is not None and key != task_id:
        raise PayloadError(f"job {job.id!r}: idempotency_key and task_id differ; give one (task_id is the key)")
    key = key if key is not None else task_id
    key = str(key) if isinstance(key, uuid.UUID) else key
    workspace_id = options.get("workspace_id")
    if workspace_id is None and isinstance(kwargs.get("workspace_id"), str):
        workspace_id = kwargs["workspace_id"]  # as send_event takes data["workspace_id"]
    data: dict[str, Any] = {"args": list(args), "kwargs": dict(kwargs)}
    if celery:
        data["celery"] = dict(celery)
    if options.get("subject") is not None:
        try:
            kind, ident = check_subject(options["subject"])
        except ValueError as exc:
            raise PayloadError(f"job {job.id!r}: {exc}") from None
        data["subject"] = {"type": kind, "id": ident}   # migration 0020's writer copies it to the run's row
    name = event_name(job.id)
    try:
        encoded, workspace_id = validate_event(name, data, workspace_id, key, settings.max_payload_bytes)
    except PayloadError as exc:
        raise PayloadError(f"arguments of job {job.id!r}: {exc}") from None
    countdown, eta = options.get("countdown"), options.get("eta")
    if countdown is not None and eta is not None:
        raise ValueError(f"job {job.id!r}: give countdown= or eta=, not both")
    seconds = 0.0 if countdown is None else checked_delay(f"countdown of job {job.id!r}", countdown)
    if eta is not None:
        if not isinstance(eta, datetime):
            raise ValueError(f"eta of job {job.id!r} must be a datetime, got {eta!r:.80}")
        eta = eta if eta.tzinfo is not None else eta.replace(tzinfo=timezone.utc)
    priority = options.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)
                                 or not 0 <= priority <= 9):
        raise PayloadError(f"priority must be an integer from 0 to 9, got {priority!r}")
    queue = options.get("queue")
    if queue is not None and (not isinstance(queue, str) or not queue):
        raise ValueError(f"queue of job {job.id!r} must be a non-empty string, got {queue!r}")
    return DirectCall(job, name, encoded, workspace_id, key, seconds, eta, queue, priority,
                      job.spec(data, workspace_id, priority))


@dataclass(frozen=True)
class Written:
    """What DIRECT_RUN did: the run (new, or the existing one it stands for) and when it is due."""

    run_id: uuid.UUID | None
    deduplicated: bool
    due_in: float = 0.0
    #: A refused call's key had been used with other arguments (the existing run is another call's).
    conflict: bool = False


def interpret(call: DirectCall, row: Mapping[str, Any] | None) -> Written | None:
    """DIRECT_RUN's row as a Written; None when it was refused (look the existing run up)."""
    if row is None or row["run_id"] is None:
        return None
    due_in = float(row["due_in"] or 0.0)
    return Written(row["run_id"], False, due_in if math.isfinite(due_in) else 0.0)


def existing(call: DirectCall, row: Mapping[str, Any] | None) -> Written:
    """The refused call's existing run (None when row-level security hides it)."""
    conflict = row is None or row.get("same") is False
    if conflict and not call.job.celery:  # (a Celery task id used twice is a second call: adapter/tasks.py)
        log.warning("idempotency key %r of job %r was already used with other arguments or another workspace: "
                    "nothing was written, the first run stands", call.key, call.job.id)
    return Written(row["run_id"] if row else None, True, conflict=conflict)


def write(conn: Conn, call: DirectCall, settings: Settings) -> Written:
    """The event and its run, in ``conn``'s transaction (in autocommit: one statement, committed)."""
    written = interpret(call, first(conn, producer_sql.DIRECT_RUN, call.params(settings)))
    if written is not None:
        return written
    return existing(call, first(conn, producer_sql.DIRECT_RUN_EXISTING, call.existing_params()))


def delayed(publish: Publish, due_in: float) -> Publish:
    """``publish`` with the run's countdown (the database's run_at - now()) on its message."""
    if due_in <= 0:
        return publish

    def later(run_id: uuid.UUID, job_id: str, countdown: float = 0.0) -> None:
        publish(run_id, job_id, max(countdown, due_in))

    return later


def should_publish(written: Written, settings: Settings) -> bool:
    """A new run due within republish_after gets its message now; a later one, from the sweeper."""
    return written.run_id is not None and not written.deduplicated and written.due_in <= settings.republish_after


def _committed(gate: CommitGate, publish: Publish | None, run: records.Queued) -> None:
    """The framework's transaction committed: the handle may wait now, the message goes out."""
    gate.set()
    if publish is not None:
        publish_or_log(publish, run.run_id, run.job_id)


def handle(engine: Engine, call: DirectCall, written: Written, committed: CommitGate | None = None) -> RunHandle:
    return RunHandle(written.run_id, call.job.id, deduplicated=written.deduplicated, workspace_id=call.workspace_id,
                     engine=engine, committed=committed)


def _gate_on(session: Session, written: Written, job_id: str) -> CommitGate | None:
    """A gate set when ``session``'s transaction commits (None: nothing new was written)."""
    if written.run_id is None or written.deduplicated:
        return None
    gate = CommitGate()

    def opened(run_id: uuid.UUID, job: str, countdown: float = 0.0) -> None:
        gate.set()

    publish_after_commit(session, [records.Queued(written.run_id, job_id)], opened)
    return gate


def apply_async(engine: Engine, job: Job, args: Sequence[Any], kwargs: Mapping[str, Any],
                options: Mapping[str, Any]) -> RunHandle:
    """Write one direct run of ``job`` and publish it after commit; its result handle."""
    settings = engine.settings
    session: Session | None = options.get("session")
    call = prepare(job, args, kwargs, {k: v for k, v in options.items() if k != "session"}, settings)
    publish = engine.routed(call.queue, call.priority)
    if session is not None:
        written = write(session.connection(), call, settings)
        gate = _gate_on(session, written, job.id)
        if should_publish(written, settings):
            run = records.Queued(written.run_id, job.id)  # type: ignore[arg-type]
            publish_after_commit(session, [run], delayed(publish, written.due_in))
        return handle(engine, call, written, gate)
    joined = engine.joined(call.workspace_id)  # a framework's transaction (contrib/django), if any
    if joined is not None:
        with joined as (conn, on_commit):
            written = write(conn, call, settings)
            gate = CommitGate() if written.run_id is not None and not written.deduplicated else None
            late = delayed(publish, written.due_in) if should_publish(written, settings) else None
            if gate is not None:
                run = records.Queued(written.run_id, job.id)  # type: ignore[arg-type]
                on_commit(lambda: _committed(gate, late, run))  # one callback: the handle, then the message
        return handle(engine, call, written, gate)
    with engine.pool().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        written = write(conn, call, settings)
    if should_publish(written, settings):
        publish_or_log(publish, written.run_id, job.id, max(written.due_in, 0.0))  # type: ignore[arg-type]
    return handle(engine, call, written)


# --- adoption: a message in Celery's own protocol, turned into a run by the worker -------

#: Characters of a refused message's arguments kept (as text) in its DLQ entry.
MAX_SHOWN = 1000
_UUID_TEXT = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


@dataclass(frozen=True)
class Adopted:
    """What a worker made of one message in Celery's protocol: the run to execute (new, or the
    one an earlier copy of the message made), or the DLQ entry of a refusal and its reason."""

    run_id: uuid.UUID | None
    deduplicated: bool = False
    dlq_id: uuid.UUID | None = None
    reason: str | None = None
    #: The task id had been used with other arguments: the run found is another message's.
    conflict: bool = False


def adopt(engine: Engine, job: Job, args: Any, kwargs: Any, task_id: str, *, task_name: str,
          shown: Mapping[str, str], celery: Mapping[str, Any] | None = None) -> Adopted:
    """Store the message ``task_id`` (``args``, ``kwargs``) of direct job ``job`` as its run, as
    ``job.apply_async(args, kwargs, task_id=task_id)`` would, committed before this returns; a
    copy of a message adopted already is that run (``deduplicated``). Arguments ``.delay()``
    would refuse are refused here too (``refuse``); ``shown`` (``argsrepr``/``kwargsrepr`` text)
    is what its DLQ entry keeps of them."""
    settings = engine.settings
    try:
        call = prepare(job, args, kwargs, {"task_id": task_id}, settings, celery=celery)
    except Exception as exc:  # noqa: BLE001 — whatever the checks (or a key function) refuse: not adoptable
        return refuse(engine, job, task_id, task_name, shown, exc)
    with engine.pool().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        written = write(conn, call, settings)
    return Adopted(written.run_id, written.deduplicated, conflict=written.conflict)


def enqueue(engine: Engine, job: Job, args: Sequence[Any], kwargs: Mapping[str, Any], options: Mapping[str, Any],
            celery: Mapping[str, Any]) -> Written:
    """A Celery task's run, written by its producer before Celery sends the task's message
    (adapter/tasks.py): ``prepare``'s checks (a refusal is raised to the caller), then the run,
    committed, keyed on ``options["task_id"]``, due after ``countdown`` / at ``eta``. A key used
    already is that run (``deduplicated``). No message: Celery sends the task's own."""
    call = prepare(job, args, kwargs, options, engine.settings, celery=celery)
    with engine.pool().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        return write(conn, call, engine.settings)


def refuse(engine: Engine, job: Job, task_id: str, task_name: str, shown: Mapping[str, str],
           exc: BaseException) -> Adopted:
    """A message that cannot be adopted, kept as a run failed at once with its DLQ row
    (``adapter_sql.ADOPT_REFUSED``); a copy of one refused already writes nothing."""
    reason = str(exc)[:MAX_SHOWN]
    good_key = isinstance(task_id, str) and 0 < len(task_id) <= MAX_IDEMPOTENCY_KEY and task_id.isprintable()
    key = task_id if good_key else None
    data = {"refused": reason, "task": task_name, "task_id": str(task_id)[:MAX_SHOWN],
            **{k: str(v)[:MAX_SHOWN] for k, v in shown.items()}}
    failure = {"type": f"{type(exc).__module__}.{type(exc).__qualname__}", "message": reason, "traceback": ""}
    params = {"name": event_name(job.id), "data": json.dumps(data), "key": key, "job_id": job.id,
              "run_id": task_id if key is not None and _UUID_TEXT.fullmatch(task_id) else None,
              "policy": job.retry_policy.name, "failure": json.dumps(failure)}
    with engine.pool().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        row = first(conn, adapter_sql.ADOPT_REFUSED, params)
    if row is None:  # this message's key was refused (or used) before: nothing more to keep
        return Adopted(None, deduplicated=True, reason=reason)
    return Adopted(row["run_id"], dlq_id=row["dlq_id"], reason=reason)
