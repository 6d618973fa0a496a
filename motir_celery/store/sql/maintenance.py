"""Maintenance: the sweeper's statements (expired leases, lost messages, the fleet's sweep slot, the stats rollup's fold), retention's, and the job registry's.

What makes "nothing is lost" true when processes and brokers fail (core/worker/sweeper.py),
and what ``motir purge`` and ``system.daily-retention`` delete (core/retention.py). Any number of sweepers or purges may run:
``FOR UPDATE SKIP LOCKED`` splits the rows. Run by the engine role.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from motir_celery.store.driver import Statement, first, rows
from motir_celery.store.records import DURATION_BOUNDS_MS
from motir_celery.store.sql.worker import DLQ_ROW

if TYPE_CHECKING:
    from motir_celery.store.driver import Conn

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


def reclaim_expired(conn: Conn, *, batch: int = 500) -> list[tuple[uuid.UUID, str, str]]:
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


def republish_due(conn: Conn, *, after_seconds: float, batch: int = 500) -> list[tuple[uuid.UUID, str]]:
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


def take_sweep_slot(conn: Conn, *, worker: str, period_seconds: float) -> bool:
    """Whether this sweeper does this period's sweep: true for the first caller per
    ``period_seconds`` fleet-wide; the others write nothing."""
    return first(conn, TAKE_SWEEP_SLOT, {"worker": worker, "period": period_seconds}) is not None


# --- the stats rollup (core/worker/rollup.py) -------------------------------------------------
#
# A fold adds a set of finished runs to job_stats_rollup: one row per (job, workspace, 5-minute
# bucket of finished_at) for the insights' windows, one per (job, workspace) with bucket NULL for
# all time. ``_FOLD`` is the shared part: it reads a CTE ``finished`` (id, job_id, workspace_id,
# state, attempts, finished_at) — the runs the sweep's fold just marked, or those purge is about
# to delete — and upserts their sums. Rows are upserted in key order, so two folds at once (the
# sweep's and a purge's) wait for each other, never in a cycle. A run's duration (succeeded runs
# only) is its first attempt's start to its finish; it also lands in one histogram bucket
# (width_bucket over DURATION_BOUNDS_MS: bucket i holds [bound i-1, bound i), the last all longer).

#: Days a bucket is kept: "the last week" and a day to spare. The totals are kept for ever.
DETAIL_DAYS = 8
_BOUNDS = "ARRAY[" + ", ".join(str(int(b)) if b == int(b) else str(b) for b in DURATION_BOUNDS_MS) + "]::float8[]"

_FOLD = f"""
    facts AS (
      SELECT f.job_id, f.workspace_id, f.state, f.attempts,
             date_bin('5 minutes', f.finished_at, TIMESTAMPTZ '2000-01-01 00:00:00+00') AS bucket,
             CASE WHEN f.state = 'succeeded' THEN
               CAST(1000 * extract(epoch FROM f.finished_at - (SELECT min(r.started_at) FROM job_run r
                                                               WHERE r.run_id = f.id)) AS float8)   -- ix_job_run_ledger
             END AS ms
      FROM finished f
    ), keyed AS (
      SELECT job_id, workspace_id, bucket, state, attempts, ms FROM facts
      WHERE bucket >= now() - make_interval(days => {DETAIL_DAYS})     -- a run finished long ago: the totals only
      UNION ALL
      SELECT job_id, workspace_id, NULL, state, attempts, ms FROM facts   -- every run: the all-time totals
    ), grouped AS (
      SELECT job_id, workspace_id, bucket,
             count(*) FILTER (WHERE state = 'succeeded') AS succeeded,
             count(*) FILTER (WHERE state = 'failed') AS failed,
             count(*) FILTER (WHERE state = 'cancelled') AS cancelled,
             count(*) FILTER (WHERE attempts > 1) AS retried,
             coalesce(sum(attempts), 0) AS attempts,
             coalesce(sum(ms), 0) AS sum_ms, count(ms) AS samples,
             coalesce(array_agg(width_bucket(ms, {_BOUNDS})) FILTER (WHERE ms IS NOT NULL), '{{}}') AS slots
      FROM keyed GROUP BY job_id, workspace_id, bucket
    ), upserted AS (
      INSERT INTO job_stats_rollup AS t (job_id, workspace_id, bucket, succeeded_count, failed_count,
                                         cancelled_count, retried_count, attempts_count, sum_duration_ms,
                                         duration_samples, duration_buckets)
      SELECT g.job_id, g.workspace_id, g.bucket, g.succeeded, g.failed, g.cancelled, g.retried, g.attempts,
             g.sum_ms, g.samples,
             ARRAY(SELECT count(*) FILTER (WHERE s = i) FROM generate_series(0, {len(DURATION_BOUNDS_MS)}) AS i
                   LEFT JOIN unnest(g.slots) AS s ON true GROUP BY i ORDER BY i)
      FROM grouped g
      ORDER BY g.job_id, g.workspace_id, g.bucket NULLS FIRST       -- one lock order for every fold
      -- uq_job_stats_rollup (NULLS NOT DISTINCT: system runs, and the totals' NULL bucket)
      ON CONFLICT (job_id, workspace_id, bucket) DO UPDATE
      SET succeeded_count = t.succeeded_count + excluded.succeeded_count,
          failed_count = t.failed_count + excluded.failed_count,
          cancelled_count = t.cancelled_count + excluded.cancelled_count,
          retried_count = t.retried_count + excluded.retried_count,
          attempts_count = t.attempts_count + excluded.attempts_count,
          sum_duration_ms = t.sum_duration_ms + excluded.sum_duration_ms,
          duration_samples = t.duration_samples + excluded.duration_samples,
          duration_buckets = ARRAY(SELECT coalesce(a, 0) + coalesce(b, 0)
                                   FROM unnest(t.duration_buckets, excluded.duration_buckets) AS u(a, b)),
          updated_at = now()
      RETURNING 1
    )"""

FOLD_FINISHED = Statement(
    "fold_finished",
    "The stats rollup: fold a batch of finished runs not counted yet, from the watermark, and move the watermark.",
    f"""
    WITH mark AS (SELECT swept_at AS since FROM job_sweep WHERE name = 'stats'),
    batch AS (
      SELECT q.id FROM job_queue q, mark
      -- from the watermark, less a margin: finished_at is its transaction's start, and a run whose
      -- settle committed after a later one was folded is still found (ix_job_queue_finished)
      WHERE q.finished_at >= mark.since - make_interval(secs => %(margin)s)
        AND q.state IN ('succeeded', 'failed', 'cancelled')     -- finished (a resumed run is queued again)
        AND q.folded_at IS DISTINCT FROM q.finished_at          -- not counted yet (this finish)
      ORDER BY q.finished_at
      LIMIT %(batch)s
      FOR UPDATE OF q SKIP LOCKED                               -- a purge deleting it folds it itself
    ), finished AS (
      UPDATE job_queue q SET folded_at = q.finished_at          -- counted: by this statement's upsert
      FROM batch WHERE q.id = batch.id
      RETURNING q.id, q.job_id, q.workspace_id, q.state, q.attempts, q.finished_at
    ),{_FOLD}, moved AS (
      UPDATE job_sweep
      -- a short batch took everything due: up to now; a full one up to its last finish
      SET swept_at = greatest(swept_at, CASE WHEN (SELECT count(*) FROM finished) < %(batch)s THEN now()
                                             ELSE (SELECT max(finished_at) FROM finished) END)
      WHERE name = 'stats'
      RETURNING swept_at
    )
    SELECT (SELECT count(*) FROM finished) AS folded, (SELECT count(*) FROM moved) AS marked
    """,
)


def fold_finished(conn: Conn, *, batch: int, margin_seconds: float) -> int:
    """Fold one batch of finished runs into the rollup; how many (fewer than ``batch``: caught up)."""
    row = first(conn, FOLD_FINISHED, {"batch": batch, "margin": margin_seconds})
    assert row is not None
    return int(row["folded"])


PRUNE_ROLLUP = Statement(
    "prune_rollup",
    "The stats rollup: delete a batch of buckets older than the insights' longest window (the totals stay).",
    f"""
    DELETE FROM job_stats_rollup WHERE id IN (
      SELECT id FROM job_stats_rollup
      WHERE bucket < now() - make_interval(days => {DETAIL_DAYS})   -- ix_job_stats_rollup_bucket; NULL (totals) never
      LIMIT %(batch)s
    )
    RETURNING 1 AS pruned
    """,
)


def prune_rollup(conn: Conn, *, batch: int) -> int:
    return len(rows(conn, PRUNE_ROLLUP, {"batch": batch}))


# --- retention (motir purge, system.daily-retention: core/retention.py) -----------------------
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

def _purge_runs(*, fold: bool) -> str:
    """PURGE_RUNS, and (``fold=False``) the same delete for a schema before 0012 (no rollup, no batches)."""
    columns = ", q.job_id, q.workspace_id, q.state, q.attempts, q.finished_at, q.folded_at" if fold else ""
    counted = f"""
    ), finished AS (
      -- The stats rollup counts what this statement deletes and the sweep has not folded yet
      -- (FOR UPDATE above read the latest folded_at): nothing deleted uncounted, nothing twice.
      SELECT id, job_id, workspace_id, state, attempts, finished_at FROM doomed
      WHERE folded_at IS DISTINCT FROM finished_at
    ),{_FOLD}""" if fold else """
    )"""
    batches = """
        AND NOT EXISTS (SELECT 1 FROM job_batch_item b        -- nor a batch= run (ix_job_batch_item_event)
                        WHERE b.event_id = e.id AND b.run_id NOT IN (SELECT id FROM doomed))""" if fold else ""
    return f"""
    WITH doomed AS (
      SELECT q.id, q.event_id{columns}
      FROM job_queue q
      WHERE {_PURGEABLE_RUN}
      ORDER BY q.finished_at           -- oldest first (ix_job_queue_finished)
      LIMIT %(batch)s
      -- a second purge (or a cancel in flight) takes other rows; so does the sweep's fold: a run it
      -- holds is folded and marked by it, and deleted by a later batch of this purge
      FOR UPDATE SKIP LOCKED{counted}, steps AS (
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
                        WHERE q.event_id = e.id AND q.id NOT IN (SELECT id FROM doomed)){batches}
      -- A fan-out inserting a run for this event holds a KEY SHARE lock on it: skip it (the
      -- sweep of the events pass takes it later). One that commits after our snapshot makes
      -- ON DELETE RESTRICT, checked at the end of this statement, refuse the whole batch.
      FOR UPDATE SKIP LOCKED
    ), events AS (
      DELETE FROM job_event WHERE id IN (SELECT id FROM freed) RETURNING 1
    )
    -- The counts read the snapshot taken before the delete: what went with the runs.
    SELECT (SELECT count(*) FROM deleted) AS runs, (SELECT n FROM steps) AS steps,
           (SELECT n FROM attempts) AS attempts, (SELECT count(*) FROM events) AS events,
           {"(SELECT count(*) FROM finished)" if fold else "0"} AS folded
    """


PURGE_RUNS = Statement(
    "purge_runs",
    "Delete a batch of finished runs past the cutoff (steps, attempts cascade), the events only they needed; fold the uncounted first.",
    _purge_runs(fold=True),
)

def purge_runs(conn: Conn, *, age: float, batch: int) -> dict[str, int]:
    """One batch of ``PURGE_RUNS``: how many runs, steps, attempts and events it deleted, and how many
    of those runs it folded into the stats rollup."""
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


def purge_dlq(conn: Conn, *, age: float, batch: int) -> int:
    """One batch of ``PURGE_DLQ``: how many entries it deleted."""
    return len(rows(conn, PURGE_DLQ, {"age": age, "batch": batch}))


_PURGE_EVENTS = """
    DELETE FROM job_event WHERE id IN (
      SELECT e.id FROM job_event e
      WHERE e.received_at < now() - make_interval(secs => %(age)s)
        -- served by the unique (event_id, job_id) index, event_id leading
        AND NOT EXISTS (SELECT 1 FROM job_queue q WHERE q.event_id = e.id){batches}
      ORDER BY e.received_at
      LIMIT %(batch)s
      -- An event a fan-out is inserting a run for holds a KEY SHARE lock: skip it.
      FOR UPDATE SKIP LOCKED
    )
    RETURNING 1 AS deleted
    """

PURGE_EVENTS = Statement(
    "purge_events",
    "Delete one batch of events received before the cutoff that no run (nor batch) points at.",
    _PURGE_EVENTS.format(batches="""
        AND NOT EXISTS (SELECT 1 FROM job_batch_item b WHERE b.event_id = e.id)   -- nor a batch's (by event_id)"""),
)

def purge_events(conn: Conn, *, age: float, batch: int) -> int:
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


def purge_counts(conn: Conn, *, age: float) -> dict[str, int]:
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


def purge_kept(conn: Conn, *, age: float) -> int:
    row = first(conn, PURGE_KEPT, {"age": age})
    assert row is not None
    return int(row["n"])


# --- the job registry (core/worker/registry.py; migration 0020) ------------------------------

REGISTER_JOBS = Statement(
    "register_jobs",
    "A worker's jobs at its start-up, written into the fleet's registry the checked functions check job ids against.",
    """
    INSERT INTO job_registry AS r (job_id, kind, events, registered_by)
    SELECT j.job_id, j.kind, j.events, %(worker)s
    FROM jsonb_to_recordset(CAST(%(jobs)s AS jsonb)) AS j(job_id text, kind text, events text[])
    ORDER BY j.job_id                      -- one order for every worker: two start-ups never deadlock
    -- A job already there (another worker, an earlier start) takes this worker's definition:
    -- the registry is the union of the fleet's jobs, each as it was last started.
    ON CONFLICT (job_id) DO UPDATE
      SET kind = EXCLUDED.kind, events = EXCLUDED.events, registered_at = now(),
          registered_by = EXCLUDED.registered_by
    RETURNING r.job_id
    """,
)


def register_jobs(conn: Conn, jobs_json: str, worker: str) -> int:
    """Write ``jobs_json`` (``[{job_id, kind, events}]``) into the registry; how many rows it wrote."""
    return len(rows(conn, REGISTER_JOBS, {"jobs": jobs_json, "worker": worker}))
