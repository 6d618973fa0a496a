"""Maintenance: the sweeper's statements (expired leases, lost messages, the fleet's sweep slot).

What makes "nothing is lost" true when processes and brokers fail (core/worker/sweeper.py).
Any number of sweepers may run: ``FOR UPDATE SKIP LOCKED`` splits the rows. Run by the
engine role.
"""

from __future__ import annotations

import uuid

from sqlalchemy import Connection

from motir_celery.store.driver import Statement, first, rows
from motir_celery.store.sql.worker import DLQ_ROW

AUDIENCE = "maintenance"
ROLES = ("motir_engine",)

RECLAIM_EXPIRED = Statement(
    "reclaim_expired",
    "Requeue the runs whose lease expired (their worker died or hung), or fail them into the DLQ when out of attempts.",
    """
    WITH expired AS (
      SELECT id FROM job_queue
      WHERE state = 'running'
        AND lease_expires_at < now()           -- the holder stopped renewing: died, hung or partitioned
      ORDER BY lease_expires_at                -- served by ix_job_queue_leases
      LIMIT %(batch)s
      FOR UPDATE SKIP LOCKED                   -- a second sweeper takes other rows, never the same ones
    ), reclaimed AS (
      UPDATE job_queue q
      SET state = CASE WHEN q.attempts >= q.max_attempts THEN 'failed' ELSE 'queued' END,
          finished_at = CASE WHEN q.attempts >= q.max_attempts THEN now() END,
          run_at = now(), dispatched_at = now(),
          claim_token = NULL, claimed_by = NULL, lease_expires_at = NULL
      FROM expired x WHERE q.id = x.id
      RETURNING q.id, q.state, q.workspace_id, q.job_id, q.event_id, q.event_name, q.scheduled_for,
                q.attempts, jsonb_build_object('type', 'LeaseExpired', 'message',
                  'the worker stopped renewing its lease (killed, crashed or hung)') AS failure
    ), ledger AS (
      UPDATE job_run r SET outcome = 'lost', finished_at = now(), error = x.failure
      FROM reclaimed x WHERE r.run_id = x.id AND r.outcome = 'running'
    ), failed AS (
      SELECT * FROM reclaimed WHERE state = 'failed'   -- out of attempts: into the DLQ, same statement
    ), dlq AS ("""
    + DLQ_ROW
    + """
    )
    SELECT id, job_id, state FROM reclaimed
    """,
)


def reclaim_expired(conn: Connection, *, batch: int = 500) -> list[tuple[uuid.UUID, str, str]]:
    """Requeue (or fail into the DLQ) runs whose lease expired; returns (run_id, job_id, new_state)."""
    return [(r["id"], r["job_id"], r["state"]) for r in rows(conn, RECLAIM_EXPIRED, {"batch": batch})]


REPUBLISH_DUE = Statement(
    "republish_due",
    "Due queued runs whose last message is older than republish_after: stamp them and publish each again.",
    """
    WITH lost AS (
      SELECT id FROM job_queue
      WHERE state = 'queued'
        AND dispatched_at < now() - make_interval(secs => %(after)s)  -- its last message is old: probably lost
        AND run_at <= now()                                            -- and it is due
      ORDER BY dispatched_at                                           -- oldest message first; ix_job_queue_stale
      LIMIT %(batch)s                                                  -- a deep backlog is re-sent in slices
      FOR UPDATE SKIP LOCKED
    )
    UPDATE job_queue q SET dispatched_at = now()
    FROM lost WHERE q.id = lost.id
    RETURNING q.id, q.job_id
    """,
)


def republish_due(conn: Connection, *, after_seconds: float, batch: int = 500) -> list[tuple[uuid.UUID, str]]:
    """Runs due whose message is older than ``after_seconds``: publish each again after commit."""
    return [(r["id"], r["job_id"]) for r in rows(conn, REPUBLISH_DUE, {"after": after_seconds, "batch": batch})]


TAKE_SWEEP_SLOT = Statement(
    "take_sweep_slot",
    "Take this period's fleet-wide sweep: true for the first sweeper of the period, nothing written for the rest.",
    """
    UPDATE job_sweep SET swept_at = now(), swept_by = %(worker)s
    WHERE name = 'fleet'
      AND swept_at <= now() - make_interval(secs => %(period)s)  -- nobody took this period yet; a concurrent
                                                                 -- taker re-checks the new row and fails
    RETURNING swept_at
    """,
)


def take_sweep_slot(conn: Connection, *, worker: str, period_seconds: float) -> bool:
    """Whether this sweeper does this period's sweep: true for the first caller per
    ``period_seconds`` fleet-wide; the others write nothing."""
    return first(conn, TAKE_SWEEP_SLOT, {"worker": worker, "period": period_seconds}) is not None
