"""Offboarding: cancel a workspace's pending and running work, export its whole history, erase it — audited.

``cancel_workspace(engine, "ws-a", actor="ops@example", reason="contract ended")`` is one
statement (``operator_sql.CANCEL_WORKSPACE``) in one transaction: every queued run of the
workspace — due, backing off, sleeping (``step.sleep``), waiting (``step.wait_for_event``,
children) — and every running one becomes ``cancelled`` at once, with the actor and the reason on
each row (``cancelled_by``, ``cancel_reason``; the instant is its ``finished_at``). A running run
stops at its next step boundary: its claim token is cleared, so its next step record, lease
renewal or settle is refused. A sleeping or waiting run is never woken; no other workspace's
row is read or written (``workspace_id`` is the statement's first predicate). A parent a
cancelled child woke (the trigger) is published after the commit.

``cancel_subject(engine, "ws-a", ("media_item", "42"), actor=..., reason=...)`` does the same for
the runs of one subject in the workspace (seed 003: "cancel every pending job for this media item"),
one statement on the partial index of open runs that name a subject (``ix_job_queue_subject_open``).

``export_workspace(engine, "ws-a", out)`` then writes every row of the workspace — events, runs,
steps, attempts, DLQ entries, batch items, progress, stream items, stats rollup — to ``out`` as JSON
lines (``{"table": ..., "row": {...}}``, each row as Postgres renders it, never decoded here), and
``erase_workspace(engine, "ws-a", actor=..., reason=...)`` deletes them in one transaction, refusing
while a run of the workspace is queued or running (``WorkspaceActive``: cancel first). It counts the
workspace's rows table by table before and after (``Erased``: each after is 0, or the transaction is
rolled back and ``IncompleteErase`` says which table kept rows), and writes the audit as a system
event, ``motir.workspace.erased`` (no workspace: an operator's row that outlives the tenant), with
who, why and what was deleted; its ``received_at`` is when.

Each acts as the engine role: they are for operators (``motir cancel --workspace``, ``motir export``,
``motir erase``), who decide who may call them; the actor and reason are required and logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from motir_celery.core.operator.dlq import check_actor
from motir_celery.core.shapes import check_subject
from motir_celery.store.sql import operator as operator_sql

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine

__all__ = ["Offboarded", "cancel_workspace", "SubjectCancelled", "cancel_subject", "export_workspace", "erase_workspace", "Erased", "WorkspaceActive",
           "IncompleteErase", "ERASED_EVENT", "MAX_REASON"]

log = logging.getLogger("motir_celery.core.operator.offboard")

#: The longest reason recorded.
MAX_REASON = 500
#: The system event an erase writes as its audit.
ERASED_EVENT = "motir.workspace.erased"


class WorkspaceActive(Exception):
    """An erase refused: the workspace still has queued or running runs (cancel them first)."""


class IncompleteErase(Exception):
    """An erase rolled back: a table still held rows of the workspace after it (a run written meanwhile)."""


@dataclass(frozen=True)
class Offboarded:
    """What one ``cancel_workspace`` call cancelled."""

    workspace_id: str
    job: str | None
    #: Runs cancelled: queued (due, sleeping, waiting) and running.
    cancelled: int
    #: Of them, those that were running (each stops at its next step boundary).
    running: int
    actor: str
    reason: str


def _check_text(what: str, value: object, limit: int) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > limit or not value.isprintable():
        raise ValueError(f"{what} must be printable text of 1 to {limit} characters, got {value!r:.60}")
    return value


def cancel_workspace(engine: Engine, workspace_id: str, *, actor: str, reason: str,
                     job: str | None = None) -> Offboarded:
    """Cancel every queued and running run of ``workspace_id`` (of ``job`` only, when given), recording
    ``actor`` and ``reason`` on each; see the module docstring."""
    check_actor(actor)
    _check_text("the workspace", workspace_id, 200)
    _check_text("the reason (recorded on each cancelled run)", reason, MAX_REASON)
    if job is not None:
        _check_text("the job", job, 200)
    with engine.pool().connect() as conn:
        with conn.begin():
            found = operator_sql.cancel_workspace(conn, workspace_id, job, actor, reason)
        ids = [r["id"] for r in found]
        if ids:
            engine.publish_woken(conn, ids)
    done = Offboarded(workspace_id, job, len(found), sum(1 for r in found if r["was"] == "running"), actor, reason)
    log.warning("workspace %r%s offboarded by %s: %d run(s) cancelled, %d of them running (%s)", workspace_id,
                f" job {job!r}" if job else "", actor, done.cancelled, done.running, reason)
    return done


@dataclass(frozen=True)
class SubjectCancelled:
    """What one ``cancel_subject`` call cancelled."""

    workspace_id: str
    subject_type: str
    subject_id: str
    #: Runs cancelled: queued (due, sleeping, waiting) and running.
    cancelled: int
    #: Of them, those that were running (each stops at its next step boundary).
    running: int
    actor: str
    reason: str


def cancel_subject(engine: Engine, workspace_id: str, subject: object, *, actor: str,
                   reason: str) -> SubjectCancelled:
    """Cancel every queued and running run of ``subject`` (``(type, id)``) in ``workspace_id``, recording
    ``actor`` and ``reason`` on each, as ``cancel_workspace`` does for a workspace: one statement
    (``operator_sql.CANCEL_SUBJECT``) on the partial index of open runs that name a subject."""
    check_actor(actor)
    _check_text("the workspace", workspace_id, 200)
    _check_text("the reason (recorded on each cancelled run)", reason, MAX_REASON)
    kind, ident = check_subject(subject)
    with engine.pool().connect() as conn:
        with conn.begin():
            found = operator_sql.cancel_subject(conn, workspace_id, kind, ident, actor, reason)
        ids = [r["id"] for r in found]
        if ids:
            engine.publish_woken(conn, ids)
    done = SubjectCancelled(workspace_id, kind, ident, len(found), sum(1 for r in found if r["was"] == "running"),
                            actor, reason)
    log.warning("subject %s:%s of workspace %r cancelled by %s: %d run(s), %d of them running (%s)", kind, ident,
                workspace_id, actor, done.cancelled, done.running, reason)
    return done


def export_workspace(engine: Engine, workspace_id: str, out: TextIO) -> dict[str, int]:
    """Write every row of ``workspace_id`` to ``out`` as JSON lines; how many rows of each table."""
    _check_text("the workspace", workspace_id, 200)
    counts = dict.fromkeys(operator_sql.WORKSPACE_TABLES, 0)
    with engine.pool().begin() as conn:   # one statement: one snapshot of the workspace
        found = operator_sql.export_workspace(conn, workspace_id)
    for row in found:
        out.write(f'{{"table": "{row["tbl"]}", "row": {row["row"]}}}\n')
        counts[row["tbl"]] += 1
    log.info("workspace %r exported: %s", workspace_id, counts)
    return counts


@dataclass(frozen=True)
class Erased:
    """What one ``erase_workspace`` call deleted: the workspace's rows per table before, and after (all 0)."""

    workspace_id: str
    before: dict[str, int]
    after: dict[str, int]
    actor: str
    reason: str


def erase_workspace(engine: Engine, workspace_id: str, *, actor: str, reason: str) -> Erased:
    """Delete every row of ``workspace_id`` (see the module docstring); audited as a system event."""
    check_actor(actor)
    _check_text("the workspace", workspace_id, 200)
    _check_text("the reason (recorded in the audit)", reason, MAX_REASON)
    with engine.pool().begin() as conn:
        active = operator_sql.workspace_active(conn, workspace_id)
        if active:
            raise WorkspaceActive(f"workspace {workspace_id!r} has {active} queued or running run(s): cancel them "
                                  "first (motir cancel --workspace)")
        before = operator_sql.workspace_rows(conn, workspace_id)
        operator_sql.erase_workspace(conn, workspace_id)
        after = operator_sql.workspace_rows(conn, workspace_id)
        kept = {t: n for t, n in after.items() if n}
        if kept:
            raise IncompleteErase(f"workspace {workspace_id!r}: rows left after the erase, rolled back: {kept}")
    engine.send_event(ERASED_EVENT, {"erased_workspace": workspace_id, "actor": actor, "reason": reason,
                                     "rows": before})
    log.warning("workspace %r erased by %s (%s): %s", workspace_id, actor, reason, before)
    return Erased(workspace_id, before, after, actor, reason)
