"""The dead-letter queue: replay and dismiss, audited.

A DLQ row is written in the same statement that marks its run failed
(``statements.settle_failed`` and the sweeper's reclaim), so one never exists
without the other. Replay re-emits the original event **for the failed job
only** — the other subscribers of that event already succeeded and must not
run again — and records who replayed and when.

Replay is itself idempotent: the audit stamp is a conditional ``UPDATE …
WHERE replayed_at IS NULL``, so of two concurrent replays one makes a run and
the other is told ``already_replayed``.

Operator surfaces (the dashboard, on behalf of a signed-in user) act through
``replay_as`` / ``dismiss_as`` / ``cancel_as``: the target is first read under
the app role in the caller's workspace context — row-level security, not this
code, says whether the caller may see it; an invisible row is ``not_found``,
exactly like a missing one — and only then changed through the engine role,
the one role with UPDATE, with the caller's name recorded (``replayed_by``,
``dismissed_by``; a cancel is logged with its actor, as the run row has no
column for it).

An event sent with an idempotency key stays deduplicated after replay: the
re-emitted event carries the same key, conflicts, and nothing runs. The
result says ``deduplicated`` and nothing is stamped; replay again with a new
``idempotency_key=`` to run it (docs/jobs.md, "Dead-letter queue").
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import text

from motir_celery.core.events import write_event
from motir_celery.core.jobs import get_job
from motir_celery.core.publish import Publish, publish_or_log
from motir_celery.settings import Settings, get_settings
from motir_celery.store import statements
from motir_celery.store.db import engine_connection, get_engine, workspace_session

__all__ = ["ReplayResult", "Caller", "replay_dlq", "dismiss_dlq", "replay_as", "dismiss_as", "cancel_as"]

log = logging.getLogger("motir_celery.core.dlq")


@dataclass(frozen=True)
class ReplayResult:
    status: Literal["replayed", "already_replayed", "dismissed", "resumed", "deduplicated", "not_found"]
    run_id: uuid.UUID | None = None
    event_id: uuid.UUID | None = None


_STAMP = text(
    """
    UPDATE job_run_dlq SET replayed_at = now(), replayed_by = :actor
    WHERE id = :id
      AND replayed_at IS NULL      -- a second replay (concurrent or later) stamps nothing
      AND dismissed_at IS NULL     -- a dismissed entry is closed
      AND resumed_at IS NULL       -- so is a resumed one (core/resume.py: its run was queued again)
    RETURNING function_id, event_name, event_data, workspace_id, idempotency_key
    """
)
_STATUS = text("SELECT replayed_at IS NOT NULL AS replayed, replay_run_id, resumed_run_id, "
               "resumed_at IS NOT NULL AS resumed FROM job_run_dlq WHERE id = :id")
_LINK = text("UPDATE job_run_dlq SET replay_run_id = :run_id WHERE id = :id")


def replay_dlq(
    dlq_id: uuid.UUID | str,
    *,
    actor: str,
    idempotency_key: str | None = None,
    publish: Publish | None = None,
    settings: Settings | None = None,
) -> ReplayResult:
    """Run the failed job again on its original event data; audited as ``actor``.

    ``idempotency_key`` replaces the original key (the workaround for an
    idempotency-keyed event, whose replay is otherwise deduplicated).
    """
    _check_actor(actor)
    dlq_uuid = uuid.UUID(str(dlq_id))
    settings = settings or get_settings()
    engine = get_engine(settings=settings)
    with engine.connect() as conn:
        with conn.begin() as tx:
            row = conn.execute(_STAMP, {"id": dlq_uuid, "actor": actor}).one_or_none()
            if row is None:
                status = conn.execute(_STATUS, {"id": dlq_uuid}).one_or_none()
                if status is None:
                    return ReplayResult("not_found")
                if status.replayed:
                    return ReplayResult("already_replayed", status.replay_run_id)
                if status.resumed:
                    return ReplayResult("resumed", status.resumed_run_id)
                return ReplayResult("dismissed")
            job = get_job(row.function_id)
            result = write_event(
                conn,
                row.event_name,
                row.event_data,
                json.dumps(row.event_data),
                row.workspace_id,
                idempotency_key if idempotency_key is not None else row.idempotency_key,
                [job],
            )
            if result.deduplicated:
                tx.rollback()  # nothing ran: leave the entry open, unstamped
                return ReplayResult("deduplicated", event_id=result.event_id)
            (run,) = result.runs
            assert isinstance(run, statements.Queued)
            conn.execute(_LINK, {"id": dlq_uuid, "run_id": run.run_id})
    if publish is not None:
        publish_or_log(publish, run.run_id, run.job_id)
    return ReplayResult("replayed", run.run_id, result.event_id)


def dismiss_dlq(dlq_id: uuid.UUID | str, *, actor: str, settings: Settings | None = None) -> bool:
    """Close an entry without replaying it (purge may then delete it)."""
    _check_actor(actor)
    with get_engine(settings=settings).begin() as conn:
        return (
            conn.execute(
                text(
                    "UPDATE job_run_dlq SET dismissed_at = now(), dismissed_by = :actor "
                    "WHERE id = :id AND replayed_at IS NULL AND dismissed_at IS NULL AND resumed_at IS NULL RETURNING 1"
                ),
                {"id": uuid.UUID(str(dlq_id)), "actor": actor},
            ).scalar()
            is not None
        )


def _check_actor(actor: object) -> None:
    if not isinstance(actor, str) or not actor.strip() or len(actor) > 200 or not actor.isprintable():
        raise ValueError(f"the actor (who is acting, recorded in the audit) must be a printable name "
                         f"of at most 200 characters, got {actor!r:.60}")


# --- on behalf of a caller -----------------------------------------------------------


@dataclass(frozen=True)
class Caller:
    """Who asks, and the workspace context their reads run in (``workspace_session``)."""

    actor: str
    workspace: str | None
    admin: bool = False


def _visible(caller: Caller, table: str, row_id: uuid.UUID, settings: Settings | None) -> bool:
    # The app role's read decides: RLS hides another workspace's row (and system rows from non-admins).
    with workspace_session(caller.workspace, admin=caller.admin, settings=settings) as s:
        return s.execute(text(f"SELECT 1 FROM {table} WHERE id = :id"), {"id": row_id}).scalar() is not None


def _uuid(value: uuid.UUID | str) -> uuid.UUID | None:
    try:
        return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value).strip())
    except ValueError:
        return None


def replay_as(caller: Caller, dlq_id: uuid.UUID | str, *, idempotency_key: str | None = None,
              publish: Publish | None = None, settings: Settings | None = None) -> ReplayResult:
    """``replay_dlq`` of an entry ``caller`` can see; ``not_found`` for one they cannot."""
    _check_actor(caller.actor)
    did = _uuid(dlq_id)
    if did is None or not _visible(caller, "job_run_dlq", did, settings):
        return ReplayResult("not_found")
    result = replay_dlq(did, actor=caller.actor, idempotency_key=idempotency_key, publish=publish, settings=settings)
    log.info("DLQ %s replay by %s (workspace %s%s): %s", did, caller.actor, caller.workspace,
             ", admin" if caller.admin else "", result.status)
    return result


def dismiss_as(caller: Caller, dlq_id: uuid.UUID | str, *,
               settings: Settings | None = None) -> Literal["dismissed", "closed", "not_found"]:
    """``dismiss_dlq`` of an entry ``caller`` can see: dismissed, already closed, or not found."""
    _check_actor(caller.actor)
    did = _uuid(dlq_id)
    if did is None or not _visible(caller, "job_run_dlq", did, settings):
        return "not_found"
    done = dismiss_dlq(did, actor=caller.actor, settings=settings)
    log.info("DLQ %s dismiss by %s: %s", did, caller.actor, "dismissed" if done else "already closed")
    return "dismissed" if done else "closed"


def cancel_as(caller: Caller, run_id: uuid.UUID | str, *,
              settings: Settings | None = None) -> Literal["cancelled", "finished", "not_found"]:
    """Cancel a run ``caller`` can see (queued or running); logged with the actor."""
    _check_actor(caller.actor)
    rid = _uuid(run_id)
    if rid is None or not _visible(caller, "job_queue", rid, settings):
        return "not_found"
    with engine_connection(settings) as conn:
        done = statements.cancel(conn, rid)
    log.info("run %s cancel by %s (workspace %s%s): %s", rid, caller.actor, caller.workspace,
             ", admin" if caller.admin else "", "cancelled" if done else "already finished")
    return "cancelled" if done else "finished"
