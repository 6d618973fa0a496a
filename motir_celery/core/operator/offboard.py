"""Offboarding: cancel every pending and running run of a workspace (or of one job in it), audited.

``cancel_workspace(engine, "ws-a", actor="ops@example", reason="contract ended")`` is one
statement (``operator_sql.CANCEL_WORKSPACE``) in one transaction: every queued run of the
workspace — due, backing off, sleeping (``step.sleep``), waiting (``step.wait_for_event``,
children) — and every running one becomes ``cancelled`` at once, with the actor and the reason on
each row (``cancelled_by``, ``cancel_reason``; the instant is its ``finished_at``). A running run
stops at its next step boundary: its claim token is cleared, so its next step record, lease
renewal or settle is refused. A sleeping or waiting run is never woken; no other workspace's
row is read or written (``workspace_id`` is the statement's first predicate). A parent a
cancelled child woke (the trigger) is published after the commit.

It acts as the engine role: it is for operators (``motir cancel --workspace``), who decide who
may call it; the actor and reason are required and logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from motir_celery.core.operator.dlq import check_actor
from motir_celery.store.sql import operator as operator_sql

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine

__all__ = ["Offboarded", "cancel_workspace", "MAX_REASON"]

log = logging.getLogger("motir_celery.core.operator.offboard")

#: The longest reason recorded.
MAX_REASON = 500


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
