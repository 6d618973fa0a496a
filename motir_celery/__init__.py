"""motir-celery: durable jobs on the Celery you already run; Postgres holds the truth.

Public surface::

    from motir_celery import define_job, send_event, RetryPolicy

    @define_job("orders.fulfil", event="order.paid", retry_policy="transient")
    def fulfil(event, step):
        invoice = step.run("invoice", make_invoice, event.data["order_id"])
        step.run("email", send_receipt, invoice)

    send_event("order.paid", {"order_id": 42, "workspace_id": "acme"})

``celery -A motir_celery worker`` runs the default app, built on first access
from the environment. ``attach(app)`` hosts the engine on your own app instead.
``current_engine()`` is the engine either way (``core/engine.py``).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, Sequence

from motir_celery.core import current as _current
from motir_celery.core.engine import Engine
from motir_celery.core.jobs import CanvasNotSupported, Job, define_job
from motir_celery.core.producer.canvas import CanvasHandle, Signature, chain, chord, group, signature
from motir_celery.core.producer.results import JobFailed, JobRevoked, ResultTimeout, RunHandle, RunNotCommitted
from motir_celery.core.retries import RetryPolicy
from motir_celery.core.runspec import Batch, CancelOn, Debounce, Throttle
from motir_celery.core.worker.invoke import ChildFailed
from motir_celery.errors import (
    ConfigurationError,
    JobDefinitionError,
    LostClaim,
    MotirError,
    NonRetriableError,
    PayloadError,
    RateLimited,
    RetryAfterError,
    RunCancelled,
    StepOutputError,
    UnknownJobError,
    WorkspaceError,
)
from motir_celery.store.db import in_workspace

if TYPE_CHECKING:
    from celery import Celery
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

    from motir_celery.core.operator.dlq import ReplayResult
    from motir_celery.core.operator.resume import ResumeResult
    from motir_celery.core.producer.events import SendResult
    from motir_celery.core.producer.subjects import ActiveRun
    from motir_celery.store.records import AlreadyQueued, Queued

__all__ = [
    "define_job",
    "send_event",
    "send_events",
    "send_event_async",
    "RunHandle",
    "JobFailed",
    "JobRevoked",
    "ResultTimeout",
    "RunNotCommitted",
    "in_workspace",
    "CanvasNotSupported",
    "chain",
    "group",
    "chord",
    "signature",
    "Signature",
    "CanvasHandle",
    "ChildFailed",
    "replay_dlq",
    "resume_dlq",
    "cancel_run",
    "active_for_subject",
    "enqueue_scheduled",
    "attach",
    "current_engine",
    "Engine",
    "Job",
    "RetryPolicy",
    "CancelOn",
    "Throttle",
    "Debounce",
    "Batch",
    "RateLimited",
    "MotirError",
    "ConfigurationError",
    "JobDefinitionError",
    "UnknownJobError",
    "PayloadError",
    "StepOutputError",
    "WorkspaceError",
    "NonRetriableError",
    "RetryAfterError",
    "LostClaim",
    "RunCancelled",
]


def current_engine() -> Engine:
    """The engine ``job.delay()`` and ``send_event()`` go through: the one the last ``attach(app)``
    made current, else the default (its Celery app built from the environment on first use)."""
    return _current.current()


def _engine(app: "Celery | None") -> Engine:
    if app is None:
        return _with_jobs(_current.current())
    from motir_celery.adapter.messages import hosts

    found = hosts(app)
    if found is None:  # an app never attached: host an engine on it now
        attach(app)
        found = hosts(app)
        assert found is not None
    return _with_jobs(found)


def _with_jobs(engine: Engine) -> Engine:
    """``engine``, its Celery app's job modules (``MOTIR_IMPORTS``) imported: a producer fans an
    event out to the jobs it knows, and a replay needs the job's definition."""
    from motir_celery.adapter.celery_app import import_jobs
    from motir_celery.adapter.messages import CeleryHost

    try:
        host = engine.host
    except ConfigurationError:
        return engine  # no broker configured here: the first publish says so, the sweeper publishes
    if isinstance(host, CeleryHost) and not host.jobs_imported:
        import_jobs(host.app)
    return engine


def send_event(
    name: str,
    data: Any,
    *,
    workspace_id: str | None = None,
    idempotency_key: str | None = None,
    session: "Session | None" = None,
    priority: int | None = None,
    app: "Celery | None" = None,
) -> "SendResult":
    """Record an event and start one run per subscribing job (see ``events.send_event``).

    Messages go through ``app``'s engine (default: the current one), after commit.
    """
    return _engine(app).send_event(name, data, workspace_id=workspace_id, idempotency_key=idempotency_key,
                                   session=session, priority=priority)


def send_events(events: Sequence[Any], *, session: "Session | None" = None,
                app: "Celery | None" = None) -> "list[SendResult]":
    """Record N events and all their runs in one statement, publish after commit; one
    ``SendResult`` per event, in order (see ``core/producer/batch.py``). Each item is a
    ``(name, data)`` pair or a mapping with ``name``, ``data`` and optionally
    ``workspace_id``, ``idempotency_key``, ``priority``."""
    return _engine(app).send_events(events, session=session)


def replay_dlq(dlq_id: "uuid.UUID | str", *, actor: str, idempotency_key: str | None = None,
               session: "Session | None" = None, app: "Celery | None" = None) -> "ReplayResult":
    """Replay a dead-lettered run for its job only; audited as ``actor``. With ``session=``
    (SQLAlchemy, a login of the engine role), written in that session's transaction and
    published when it commits, never if it rolls back."""
    return _engine(app).replay_dlq(dlq_id, actor=actor, idempotency_key=idempotency_key, session=session)


def resume_dlq(dlq_id: "uuid.UUID | str", *, actor: str, app: "Celery | None" = None) -> "ResumeResult":
    """Queue a dead-lettered run again from its failed step (its stored steps kept, a fresh
    attempt budget); audited as ``actor`` (see ``core/operator/resume.py``)."""
    return _engine(app).resume_dlq(dlq_id, actor=actor)


def cancel_run(run_id: "uuid.UUID | str", *, app: "Celery | None" = None) -> bool:
    """Cancel a queued or running run; a running one stops at its next step boundary, its
    unfinished children (a canvas's members) are cancelled with it, and a parent waiting
    for it is woken and published at once (through ``app``'s engine, default: the current one;
    with no broker here, by a worker's sweeper)."""
    return _engine(app).cancel_run(run_id)


def active_for_subject(subject: "tuple[str, str]", *, workspace_id: str | None = None, limit: int = 10,
                       session: "Session | None" = None, app: "Celery | None" = None) -> "list[ActiveRun]":
    """The open (queued, sleeping, waiting, running) runs of ``subject`` — ``(type, id)``, as a producer
    named it with ``subject=`` — in ``workspace_id``, oldest first; empty when none is active. Read as
    the tenant, under row-level security (``session=``: in the caller's own transaction)."""
    return _engine(app).active_for_subject(subject, workspace_id=workspace_id, limit=limit, session=session)


def enqueue_scheduled(job_id: str, scheduled_for: Any, *, app: "Celery | None" = None) -> "Queued | AlreadyQueued":
    """Create the run of cron job ``job_id`` for slot ``scheduled_for`` (once, however often called)."""
    from motir_celery.adapter.beat import enqueue_slot

    return enqueue_slot(_engine(app), job_id, scheduled_for)


def attach(app: "Celery") -> "Celery":
    """Host the engine on your own Celery app (each job a task under its Celery name and
    ``motir.<job_id>``, the sweeper, imports, the result backend reading the runs table) and make
    that engine current: ``job.delay()``, ``send_event`` and ``replay_dlq`` then publish through it."""
    from motir_celery.adapter.celery_app import attach as _attach

    return _attach(app)


async def send_event_async(
    name: str,
    data: Any,
    *,
    workspace_id: str | None = None,
    idempotency_key: str | None = None,
    session: "AsyncSession | None" = None,
    priority: int | None = None,
    app: "Celery | None" = None,
) -> "SendResult":
    """``send_event`` for asyncio code: psycopg's async connection, the publish in a
    thread executor; ``session`` is SQLAlchemy's ``AsyncSession`` (see ``core/aio.py``)."""
    return await _engine(app).send_event_async(name, data, workspace_id=workspace_id,
                                               idempotency_key=idempotency_key, session=session, priority=priority)


def _default_engine() -> Engine:
    from motir_celery.adapter.celery_app import default_engine

    return default_engine()


# The one lookup: where no code attached an app, current() builds the default engine.
_current.use_default(_default_engine)


def __getattr__(name: str) -> Any:
    # `celery -A motir_celery` looks up `motir_celery.app`: built on first access only, and made
    # Celery's current app, as an app defined in a project's celery.py is: Flower (and any code
    # that reads `celery.current_app`, `AsyncResult(id)` without app=) then reads the runs table.
    if name in ("app", "celery"):
        from motir_celery.adapter.celery_app import default_app

        app = default_app()
        app.set_current()
        return app
    raise AttributeError(f"module 'motir_celery' has no attribute {name!r}")
