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
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from motir_celery.core.jobs import CanvasNotSupported, Job, define_job, use_invoker
from motir_celery.core.producer.canvas import CanvasHandle, Signature, chain, chord, group, signature
from motir_celery.core.producer.results import JobFailed, JobRevoked, ResultTimeout, RunHandle, RunNotCommitted
from motir_celery.core.retries import RetryPolicy
from motir_celery.core.runspec import Batch, CancelOn, Debounce, Throttle
from motir_celery.core.worker import canvas as canvas_worker
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
    from motir_celery.core.producer.direct import PublishFor
    from motir_celery.core.producer.events import SendResult
    from motir_celery.core.publish import Publish
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
    "enqueue_scheduled",
    "attach",
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


def _publish(app: "Celery | None" = None):  # type: ignore[no-untyped-def]
    from motir_celery.adapter.celery_app import default_app, publisher

    return publisher(app or default_app())


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

    Messages go through ``app`` (default: the engine's own Celery app), after commit.
    """
    from motir_celery.core.producer import events

    return events.send_event(
        name, data, workspace_id=workspace_id, idempotency_key=idempotency_key, session=session,
        priority=priority, publish=_publish(app),
    )


def send_events(events: Sequence[Any], *, session: "Session | None" = None,
                app: "Celery | None" = None) -> "list[SendResult]":
    """Record N events and all their runs in one statement, publish after commit; one
    ``SendResult`` per event, in order (see ``core/batch.py``). Each item is a
    ``(name, data)`` pair or a mapping with ``name``, ``data`` and optionally
    ``workspace_id``, ``idempotency_key``, ``priority``."""
    from motir_celery.adapter.batch_publish import publish_many
    from motir_celery.adapter.celery_app import default_app
    from motir_celery.core.producer import batch

    return batch.send_events(events, session=session, publish=_publish(app),
                             publish_many=publish_many(app or default_app()))


def replay_dlq(dlq_id: "uuid.UUID | str", *, actor: str, idempotency_key: str | None = None,
               app: "Celery | None" = None) -> "ReplayResult":
    """Replay a dead-lettered run for its job only; audited as ``actor``."""
    from motir_celery.core.operator import dlq

    return dlq.replay_dlq(dlq_id, actor=actor, idempotency_key=idempotency_key, publish=_publish(app))


def resume_dlq(dlq_id: "uuid.UUID | str", *, actor: str, app: "Celery | None" = None) -> "ResumeResult":
    """Queue a dead-lettered run again from its failed step (its stored steps kept, a fresh
    attempt budget); audited as ``actor`` (see ``core/resume.py``)."""
    from motir_celery.core.operator import resume

    return resume.resume_dlq(dlq_id, actor=actor, publish=_publish(app))


def cancel_run(run_id: "uuid.UUID | str", *, app: "Celery | None" = None) -> bool:
    """Cancel a queued or running run; a running one stops at its next step boundary, its
    unfinished children (a canvas's members) are cancelled with it, and a parent waiting
    for it is woken and published at once (through ``app``, default: the engine's app)."""
    from motir_celery.core.operator import dlq

    try:
        publish = _publish(app)
    except ConfigurationError:  # no broker configured here: the parent's message comes from the sweeper
        publish = None
    return dlq.cancel_run(run_id, publish=publish)


def enqueue_scheduled(job_id: str, scheduled_for: Any, *, app: "Celery | None" = None) -> "Queued | AlreadyQueued":
    """Create the run of cron job ``job_id`` for slot ``scheduled_for`` (once, however often called)."""
    from motir_celery.adapter.beat import enqueue_slot

    return enqueue_slot(job_id, scheduled_for, publish=_publish(app))


def attach(app: "Celery") -> "Celery":
    """Host the engine on your own Celery app (each job a task under its Celery name and
    ``motir.<job_id>``, the sweeper, imports, the result backend reading the runs table);
    ``send_event`` and ``replay_dlq`` then publish through it."""
    from motir_celery.adapter.celery_app import attach as _attach
    from motir_celery.adapter.celery_app import use_as_default

    use_as_default(_attach(app))
    return app


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
    from motir_celery.core.producer import aio

    return await aio.send_event_async(
        name, data, workspace_id=workspace_id, idempotency_key=idempotency_key, session=session,
        priority=priority, publish=_publish(app),
    )


def _publish_for(queue: str | None, priority: int | None):  # type: ignore[no-untyped-def]
    from motir_celery.adapter.celery_app import default_app
    from motir_celery.adapter.routing import publisher_for

    return publisher_for(default_app(), queue, priority)


class _DirectRuns:
    """``job.delay()`` / ``apply_async()`` and their async twins (core/direct.py, core/aio.py),
    published through the default app: the one ``attach()`` was given, else ours."""

    def apply_async(self, job: Job, args: Sequence[Any], kwargs: Mapping[str, Any],
                    options: dict[str, Any]) -> RunHandle:
        from motir_celery.core.producer import direct

        publish_for: "PublishFor" = _publish_for
        return direct.apply_async(job, args, kwargs, options, publish_for=publish_for)

    async def apply_async_async(self, job: Job, args: Sequence[Any], kwargs: Mapping[str, Any],
                                options: dict[str, Any]) -> RunHandle:
        from motir_celery.core.producer import aio

        publish_for: "PublishFor" = _publish_for
        return await aio.apply_async_async(job, args, kwargs, options, publish_for=publish_for)

    def apply(self, job: Job, args: Sequence[Any], kwargs: Mapping[str, Any], options: dict[str, Any]) -> RunHandle:
        """``job.apply()``: the run written as ``apply_async`` writes it, and executed here at
        once, through the real runner (core/worker/inline.py), before the handle is returned."""
        from motir_celery.core.producer import direct
        from motir_celery.core.worker.inline import Inline

        inline = Inline()
        return direct.apply_async(job, args, kwargs, options, publish_for=lambda queue, priority: inline)


use_invoker(_DirectRuns())


def _member_route(publish: "Publish", queue: str | None, priority: int | None) -> "Publish":
    """A canvas member with its own queue= / priority=: its message through the default app's router."""
    return _publish_for(queue, priority)  # type: ignore[no-any-return]


canvas_worker.use_route(_member_route)


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
