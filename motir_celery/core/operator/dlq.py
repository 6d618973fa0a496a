"""The dead-letter queue: replay and dismiss, audited.

A DLQ row is written in the same statement that marks its run failed
(the settle of its last attempt, or the sweeper's reclaim), so one never exists
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

A canvas (a run of ``system.canvas``: core/worker/canvas.py) is replayed from its failed
link: the new run starts with the records of the links the failed run completed
(``copy_completed_links``), so they do not run again; the failed link runs again as new
member runs (all of a failed group's members). ``resume_dlq`` instead resumes the same
canvas run, only the failed members, each from its own failed step.

``replay_dlq(..., session=)`` replays inside the caller's SQLAlchemy transaction, as
``send_event(session=)`` writes inside it: the stamp, the run and the link commit or roll back
with it, and the run's message is published on its commit (``Engine.publish_after_commit``).
The session must be of a login that may replay (the engine role; checked first,
``operator_sql.MAY_REPLAY``): the app role is refused with ``PermissionError``, nothing written.

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
from typing import TYPE_CHECKING, Literal

from motir_celery.core.jobs import get_job
from motir_celery.core.publish import publish_or_log
from motir_celery.core.shapes import CANVAS_JOB_ID
from motir_celery.store import records
from motir_celery.store.driver import Statement
from motir_celery.store.sql import operator as operator_sql

if TYPE_CHECKING:  # the ORM only for a caller's own Session
    from sqlalchemy.orm import Session

    from motir_celery.core.engine import Engine
    from motir_celery.store.driver import Conn

__all__ = ["ReplayResult", "Caller", "replay_dlq", "dismiss_dlq", "replay_as", "dismiss_as", "cancel_as", "cancel_run",
           "visible", "parse_id", "check_actor"]

log = logging.getLogger("motir_celery.core.operator.dlq")


@dataclass(frozen=True)
class ReplayResult:
    status: Literal["replayed", "already_replayed", "dismissed", "resumed", "deduplicated", "not_found"]
    run_id: uuid.UUID | None = None
    event_id: uuid.UUID | None = None


def replay_dlq(engine: Engine, dlq_id: uuid.UUID | str, *, actor: str,
               idempotency_key: str | None = None, session: Session | None = None) -> ReplayResult:
    """Run the failed job again on its original event data; audited as ``actor``.

    ``idempotency_key`` replaces the original key (the workaround for an
    idempotency-keyed event, whose replay is otherwise deduplicated).

    ``session`` (SQLAlchemy): the stamp, the new run and its link are written in that session's
    transaction — committed or rolled back with it — and the run's message is published when it
    commits, never if it rolls back, as ``send_event(session=)`` does. The session's login must be
    one that may replay (the engine role: ``PermissionError`` otherwise, nothing written).
    """
    check_actor(actor)
    dlq_uuid = uuid.UUID(str(dlq_id))
    if session is not None:
        return _replay_in_session(engine, session, dlq_uuid, actor, idempotency_key)
    with engine.pool().connect() as conn:
        with conn.begin() as tx:
            result, run = _write_replay(engine, conn, dlq_uuid, actor, idempotency_key)
            if result.status == "deduplicated":
                tx.rollback()  # nothing ran: leave the entry open, unstamped
    if run is not None:
        publish_or_log(engine.publish, run.run_id, run.job_id)
    return result


def _replay_in_session(engine: Engine, session: Session, dlq_uuid: uuid.UUID, actor: str,
                       idempotency_key: str | None) -> ReplayResult:
    """``replay_dlq`` in the caller's transaction; a deduplicated replay undoes its stamp (a savepoint)."""
    allowed, login = operator_sql.may_replay(session.connection())
    if not allowed:
        raise PermissionError(
            f"replay_dlq(session=...): the session's login ({login}) may not replay a DLQ entry; use a "
            "session of the engine role (motir_engine), or replay without session= (the engine's own login)")
    savepoint = session.begin_nested()
    try:
        result, run = _write_replay(engine, session.connection(), dlq_uuid, actor, idempotency_key)
    except BaseException:
        savepoint.rollback()
        raise
    if result.status == "deduplicated":
        savepoint.rollback()  # nothing ran: leave the entry open, unstamped
    else:
        savepoint.commit()
    if run is not None:
        engine.publish_after_commit(session, [run])
    return result


def _write_replay(engine: Engine, conn: Conn, dlq_uuid: uuid.UUID, actor: str,
                  idempotency_key: str | None) -> tuple[ReplayResult, records.Queued | None]:
    """The replay's rows in ``conn``'s transaction, not committed: the result and the run to publish
    once it is (None: nothing to publish). A ``deduplicated`` result's stamp is the caller's to undo."""
    row = operator_sql.replay_stamp(conn, dlq_uuid, actor)
    if row is None:
        status = operator_sql.entry_status(conn, dlq_uuid)
        if status is None:
            return ReplayResult("not_found"), None
        if status["replayed"]:
            return ReplayResult("already_replayed", status["replay_run_id"]), None
        if status["resumed"]:
            return ReplayResult("resumed", status["resumed_run_id"]), None
        return ReplayResult("dismissed"), None
    job = get_job(row["function_id"])
    result = engine.write_event(
        conn,
        row["event_name"],
        row["event_data"],
        json.dumps(row["event_data"]),
        row["workspace_id"],
        idempotency_key if idempotency_key is not None else row["idempotency_key"],
        [job],
    )
    if result.deduplicated:
        return ReplayResult("deduplicated", event_id=result.event_id), None
    (run,) = result.runs
    assert isinstance(run, records.Queued)
    operator_sql.replay_link(conn, dlq_uuid, run.run_id)
    if job.id == CANVAS_JOB_ID and row["run_id"] is not None:
        # A canvas is replayed from its failed link: the links its failed run completed
        # are the new run's records too, so only the failed link runs again (as a new member).
        operator_sql.copy_completed_links(conn, row["run_id"], run.run_id)
    return ReplayResult("replayed", run.run_id, result.event_id), run


def dismiss_dlq(engine: Engine, dlq_id: uuid.UUID | str, *, actor: str) -> bool:
    """Close an entry without replaying it (purge may then delete it)."""
    check_actor(actor)
    with engine.pool().begin() as conn:
        return operator_sql.dismiss(conn, uuid.UUID(str(dlq_id)), actor)


def check_actor(actor: object) -> None:
    """The actor recorded in the audit: a printable name of at most 200 characters."""
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


def visible(engine: Engine, caller: Caller, statement: Statement, row_id: uuid.UUID) -> bool:
    """Whether ``caller`` sees the row (``operator_sql.RUN_VISIBLE`` / ``DLQ_VISIBLE``): the app
    role's read decides: RLS hides another workspace's row (and system rows from non-admins)."""
    with engine.session(caller.workspace, admin=caller.admin) as s:
        return operator_sql.visible(s.connection(), statement, row_id)


def parse_id(value: uuid.UUID | str) -> uuid.UUID | None:
    """A run or entry id as typed by an operator (surrounding blanks allowed), or None."""
    try:
        return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value).strip())
    except ValueError:
        return None


def replay_as(engine: Engine, caller: Caller, dlq_id: uuid.UUID | str, *,
              idempotency_key: str | None = None) -> ReplayResult:
    """``replay_dlq`` of an entry ``caller`` can see; ``not_found`` for one they cannot."""
    check_actor(caller.actor)
    did = parse_id(dlq_id)
    if did is None or not visible(engine, caller, operator_sql.DLQ_VISIBLE, did):
        return ReplayResult("not_found")
    result = replay_dlq(engine, did, actor=caller.actor, idempotency_key=idempotency_key)
    log.info("DLQ %s replay by %s (workspace %s%s): %s", did, caller.actor, caller.workspace,
             ", admin" if caller.admin else "", result.status)
    return result


def dismiss_as(engine: Engine, caller: Caller,
               dlq_id: uuid.UUID | str) -> Literal["dismissed", "closed", "not_found"]:
    """``dismiss_dlq`` of an entry ``caller`` can see: dismissed, already closed, or not found."""
    check_actor(caller.actor)
    did = parse_id(dlq_id)
    if did is None or not visible(engine, caller, operator_sql.DLQ_VISIBLE, did):
        return "not_found"
    done = dismiss_dlq(engine, did, actor=caller.actor)
    log.info("DLQ %s dismiss by %s: %s", did, caller.actor, "dismissed" if done else "already closed")
    return "dismissed" if done else "closed"


def cancel_run(engine: Engine, run_id: uuid.UUID | str) -> bool:
    """Cancel a queued or running run (a running one stops at its next step boundary; its
    unfinished children are cancelled with it). If it was a child, the parent its settle woke
    is published after the commit (``invoke.publish_woken``), not a sweep later."""
    rid = uuid.UUID(str(run_id))
    with engine.pool().connect() as conn:
        with conn.begin():
            done = operator_sql.cancel(conn, rid)
        if done:
            engine.publish_woken(conn, [rid])
    return done


def cancel_as(engine: Engine, caller: Caller,
              run_id: uuid.UUID | str) -> Literal["cancelled", "finished", "not_found"]:
    """Cancel a run ``caller`` can see (queued or running); logged with the actor."""
    check_actor(caller.actor)
    rid = parse_id(run_id)
    if rid is None or not visible(engine, caller, operator_sql.RUN_VISIBLE, rid):
        return "not_found"
    done = cancel_run(engine, rid)
    log.info("run %s cancel by %s (workspace %s%s): %s", rid, caller.actor, caller.workspace,
             ", admin" if caller.admin else "", "cancelled" if done else "already finished")
    return "cancelled" if done else "finished"
