"""Is a run already active for this subject? (seed 003: "is there already an active job for this
exact subject").

``active_for_subject(engine, ("media_item", "42"), workspace_id="ws-a")`` reads the open runs —
queued (due, backing off, sleeping, waiting) or running — that name the subject in the workspace:
one statement (``reads_sql.ACTIVE_FOR_SUBJECT``) on the partial index of open runs that name a
subject (``ix_job_queue_subject_open``), so its cost is the subject's open runs, never the history.
It reads as the tenant: the app role under row-level security (or, given ``session=``, in the
caller's own transaction and role), the statement naming the workspace too. A read, not a lock:
two producers may both see none; a job that must run once per subject says so with
``singleton_key=`` (the database decides, invariant 1).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from motir_celery.core.producer.streams import reading
from motir_celery.core.shapes import check_subject
from motir_celery.store.db import validate_workspace_id
from motir_celery.store.sql import reads as reads_sql

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from motir_celery.core.engine import Engine

__all__ = ["ActiveRun", "active_for_subject", "MAX_LISTED"]

#: The most open runs of one subject one call returns.
MAX_LISTED = 100


@dataclass(frozen=True)
class ActiveRun:
    """One open run of a subject."""

    run_id: uuid.UUID
    job_id: str
    #: ``queued`` (due, backing off, sleeping or waiting) or ``running``.
    state: str
    run_at: datetime
    #: The event a waiting run waits for (``step.wait_for_event``, a child), else None.
    wait_event: str | None
    created_at: datetime


def active_for_subject(engine: Engine, subject: Any, *, workspace_id: str | None = None, limit: int = 10,
                       session: Session | None = None) -> list[ActiveRun]:
    """The subject's open runs in ``workspace_id`` (None: the system's), oldest first; empty: none."""
    kind, ident = check_subject(subject)
    workspace_id = validate_workspace_id(workspace_id)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= MAX_LISTED:
        raise ValueError(f"limit is an integer from 1 to {MAX_LISTED}, got {limit!r}")
    if session is not None:
        found = reads_sql.active_for_subject(session.connection(), kind, ident, workspace_id, limit)
    else:
        with reading(engine, workspace_id) as conn:
            found = reads_sql.active_for_subject(conn, kind, ident, workspace_id, limit)
    return [ActiveRun(r["id"], r["job_id"], r["state"], r["run_at"], r["wait_event"], r["created_at"])
            for r in found]
