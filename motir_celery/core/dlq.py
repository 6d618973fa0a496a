"""The dead-letter queue: replay and dismiss, audited.

A DLQ row is written in the same statement that marks its run failed
(``statements.settle_failed`` and the sweeper's reclaim), so one never exists
without the other. Replay re-emits the original event **for the failed job
only** — the other subscribers of that event already succeeded and must not
run again — and records who replayed and when.

Replay is itself idempotent: the audit stamp is a conditional ``UPDATE …
WHERE replayed_at IS NULL``, so of two concurrent replays one makes a run and
the other is told ``already_replayed``.

An event sent with an idempotency key stays deduplicated after replay: the
re-emitted event carries the same key, conflicts, and nothing runs. The
result says ``deduplicated`` and nothing is stamped; replay again with a new
``idempotency_key=`` to run it (docs/jobs.md, "Dead-letter queue").
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import text

from motir_celery.store import statements
from motir_celery.store.db import get_engine
from motir_celery.core.events import write_event
from motir_celery.core.jobs import get_job
from motir_celery.core.publish import Publish, publish_or_log
from motir_celery.settings import Settings, get_settings

__all__ = ["ReplayResult", "replay_dlq", "dismiss_dlq"]


@dataclass(frozen=True)
class ReplayResult:
    status: Literal["replayed", "already_replayed", "dismissed", "deduplicated", "not_found"]
    run_id: uuid.UUID | None = None
    event_id: uuid.UUID | None = None


_STAMP = text(
    """
    UPDATE job_run_dlq SET replayed_at = now(), replayed_by = :actor
    WHERE id = :id
      AND replayed_at IS NULL      -- a second replay (concurrent or later) stamps nothing
      AND dismissed_at IS NULL     -- a dismissed entry is closed
    RETURNING function_id, event_name, event_data, workspace_id, idempotency_key
    """
)
_STATUS = text("SELECT replayed_at IS NOT NULL AS replayed, replay_run_id FROM job_run_dlq WHERE id = :id")
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
    if not isinstance(actor, str) or not actor.strip():
        raise ValueError("replay_dlq needs a non-empty actor (who is replaying)")
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
    with get_engine(settings=settings).begin() as conn:
        return (
            conn.execute(
                text(
                    "UPDATE job_run_dlq SET dismissed_at = now(), dismissed_by = :actor "
                    "WHERE id = :id AND replayed_at IS NULL AND dismissed_at IS NULL RETURNING 1"
                ),
                {"id": uuid.UUID(str(dlq_id)), "actor": actor},
            ).scalar()
            is not None
        )
