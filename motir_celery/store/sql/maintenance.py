"""Maintenance: the sweeper's statements (expired leases, lost messages, the fleet's sweep slot) and retention's.

What makes "nothing is lost" true when processes and brokers fail (core/worker/sweeper.py),
and what ``motir purge`` deletes (ops/purge.py). Any number of sweepers or purges may run:
``FOR UPDATE SKIP LOCKED`` splits the rows. Run by the engine role.
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


# --- retention (motir purge: ops/purge.py) ---------------------------------------------------
#
# Each delete takes one batch (``LIMIT %(batch)s``) in the caller's transaction; the caller
# repeats it until a batch comes back short. ``%(age)s`` is the retention period in seconds.

# A run is purgeable when it is finished, finished before the cutoff, and has no open DLQ
# entry (the operator deciding about the entry reads its attempts). Shared by the delete
# and by --dry-run's count.
_PURGEABLE_RUN = """
    q.state IN ('succeeded', 'failed', 'cancelled')                  -- finished: queued and running never go
    AND q.finished_at < now() - make_interval(secs => %(age)s)       -- before the cutoff
    AND NOT EXISTS (SELECT 1 FROM job_run_dlq d                      -- no open DLQ entry holds it
                    WHERE d.run_id = q.id AND d.replayed_at IS NULL AND d.dismissed_at IS NULL)
"""

PURGE_RUNS = Statement(
    "purge_runs",
    "Delete one batch of finished runs past the cutoff (steps and attempts cascade) and the events only they needed.",
    f"""
    WITH doomed AS (
      SELECT q.id, q.event_id FROM job_queue q
      WHERE {_PURGEABLE_RUN}
      ORDER BY q.finished_at           -- oldest first (ix_job_queue_finished)
      LIMIT %(batch)s
      FOR UPDATE SKIP LOCKED          -- a second purge (or a cancel in flight) takes other rows
    ), steps AS (
      SELECT count(*) AS n FROM job_step WHERE run_id IN (SELECT id FROM doomed)
    ), attempts AS (
      SELECT count(*) AS n FROM job_run WHERE run_id IN (SELECT id FROM doomed)
    ), deleted AS (
      -- job_step and job_run cascade; job_run_dlq.run_id / replay_run_id become NULL
      -- (a closed entry stays readable: it copies the job, event and failure).
      DELETE FROM job_queue WHERE id IN (SELECT id FROM doomed) RETURNING 1
    ), freed AS (
      -- The events of these runs that no other run needs. Every part of this statement
      -- reads the snapshot taken before the delete above, so the doomed runs are still
      -- visible here: "no other run" excludes them by id.
      SELECT e.id FROM job_event e
      WHERE e.id IN (SELECT event_id FROM doomed)            -- pk_job_event, one probe each
        AND e.received_at < now() - make_interval(secs => %(age)s)
        AND NOT EXISTS (SELECT 1 FROM job_queue q             -- uq (event_id, job_id), event_id leading
                        WHERE q.event_id = e.id AND q.id NOT IN (SELECT id FROM doomed))
      -- A fan-out inserting a run for this event holds a KEY SHARE lock on it: skip it (the
      -- sweep of the events pass takes it later). One that commits after our snapshot makes
      -- ON DELETE RESTRICT, checked at the end of this statement, refuse the whole batch.
      FOR UPDATE SKIP LOCKED
    ), events AS (
      DELETE FROM job_event WHERE id IN (SELECT id FROM freed) RETURNING 1
    )
    -- The counts read the snapshot taken before the delete: what went with the runs.
    SELECT (SELECT count(*) FROM deleted) AS runs, (SELECT n FROM steps) AS steps,
           (SELECT n FROM attempts) AS attempts, (SELECT count(*) FROM events) AS events
    """,
)


def purge_runs(conn: Connection, *, age: float, batch: int) -> dict[str, int]:
    """One batch of ``PURGE_RUNS``: how many runs, steps, attempts and events it deleted."""
    row = first(conn, PURGE_RUNS, {"age": age, "batch": batch})
    assert row is not None
    return {k: int(v) for k, v in row.items()}


# coalesce(NULL, NULL) is NULL and never < anything: an open entry cannot match.
_CLOSED_DLQ = """
    coalesce(d.replayed_at, d.dismissed_at) < now() - make_interval(secs => %(age)s)
"""

PURGE_DLQ = Statement(
    "purge_dlq",
    "Delete one batch of DLQ entries replayed or dismissed before the cutoff (an open entry never goes).",
    f"""
    DELETE FROM job_run_dlq WHERE id IN (
      SELECT d.id FROM job_run_dlq d WHERE {_CLOSED_DLQ}
      LIMIT %(batch)s FOR UPDATE SKIP LOCKED      -- a second purge takes other rows
    )
    RETURNING 1 AS deleted
    """,
)


def purge_dlq(conn: Connection, *, age: float, batch: int) -> int:
    """One batch of ``PURGE_DLQ``: how many entries it deleted."""
    return len(rows(conn, PURGE_DLQ, {"age": age, "batch": batch}))


PURGE_EVENTS = Statement(
    "purge_events",
    "Delete one batch of events received before the cutoff that no run points at.",
    """
    DELETE FROM job_event WHERE id IN (
      SELECT e.id FROM job_event e
      WHERE e.received_at < now() - make_interval(secs => %(age)s)
        -- served by the unique (event_id, job_id) index, event_id leading
        AND NOT EXISTS (SELECT 1 FROM job_queue q WHERE q.event_id = e.id)
      ORDER BY e.received_at
      LIMIT %(batch)s
      -- An event a fan-out is inserting a run for holds a KEY SHARE lock: skip it.
      FOR UPDATE SKIP LOCKED
    )
    RETURNING 1 AS deleted
    """,
)


def purge_events(conn: Connection, *, age: float, batch: int) -> int:
    """One batch of ``PURGE_EVENTS``: how many events it deleted."""
    return len(rows(conn, PURGE_EVENTS, {"age": age, "batch": batch}))


PURGE_COUNTS = Statement(
    "purge_counts",
    "What a purge with this cutoff would delete: runs, steps, attempts, closed DLQ entries, events (--dry-run).",
    f"""
    SELECT
      (SELECT count(*) FROM job_queue q WHERE {_PURGEABLE_RUN}) AS runs,
      (SELECT count(*) FROM job_step s JOIN job_queue q ON q.id = s.run_id WHERE {_PURGEABLE_RUN}) AS steps,
      (SELECT count(*) FROM job_run r JOIN job_queue q ON q.id = r.run_id WHERE {_PURGEABLE_RUN}) AS attempts,
      (SELECT count(*) FROM job_run_dlq d WHERE {_CLOSED_DLQ}) AS dlq_entries,
      -- events whose every run would be purged too
      (SELECT count(*) FROM job_event e
        WHERE e.received_at < now() - make_interval(secs => %(age)s)
          AND NOT EXISTS (SELECT 1 FROM job_queue q WHERE q.event_id = e.id AND NOT ({_PURGEABLE_RUN})))
        AS events
    """,
)


def purge_counts(conn: Connection, *, age: float) -> dict[str, int]:
    """``PURGE_COUNTS``: what a purge with this cutoff would delete, by kind."""
    row = first(conn, PURGE_COUNTS, {"age": age})
    assert row is not None
    return {k: int(v) for k, v in row.items()}


PURGE_KEPT = Statement(
    "purge_kept",
    "How many failed runs past the cutoff a purge keeps because their DLQ entry is still open.",
    """
    SELECT count(*) AS n FROM job_queue q
    WHERE q.state = 'failed' AND q.finished_at < now() - make_interval(secs => %(age)s)   -- past the cutoff
      AND EXISTS (SELECT 1 FROM job_run_dlq d                                            -- and held by an
                  WHERE d.run_id = q.id AND d.replayed_at IS NULL AND d.dismissed_at IS NULL)   -- open entry
    """,
)


def purge_kept(conn: Connection, *, age: float) -> int:
    row = first(conn, PURGE_KEPT, {"age": age})
    assert row is not None
    return int(row["n"])
