"""The test kit's statements (motir_celery.testing): what runs are due, a crash's lease, skipped time.

None of these is on a worker's path. The kit runs the real claim, step, settle and
sweeper statements; these only find what to run next, play a dead worker's part, and
move the clock the engine sees by moving every stored instant back instead (so no
statement of production needs a clock of its own).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from motir_celery.store.driver import Statement, first, rows

if TYPE_CHECKING:
    from motir_celery.store.driver import Conn

AUDIENCE = "testing"
ROLES = ("owner", "motir_engine")

DUE_RUNS = Statement(
    "due_runs",
    "The queued runs that are due now, in the order a fleet would take them (priority, then due time).",
    """
    SELECT id, job_id FROM job_queue
    WHERE state = 'queued' AND run_at <= now()   -- claimable now (ix_job_queue_due)
    ORDER BY priority DESC, run_at, created_at
    LIMIT %(limit)s
    """,
)


def due_runs(conn: Conn, limit: int = 1000) -> list[tuple[uuid.UUID, str]]:
    return [(r["id"], r["job_id"]) for r in rows(conn, DUE_RUNS, {"limit": limit})]


EXPIRE_LEASE = Statement(
    "expire_lease",
    "A crashed attempt's lease runs out at once (the sweeper then reclaims the run, as after a worker's death).",
    """
    UPDATE job_queue SET lease_expires_at = now() - interval '1 second'
    WHERE id = %(run_id)s AND (state = 'running') IS TRUE   -- the attempt that died still holds it
    RETURNING id
    """,
)


def expire_lease(conn: Conn, run_id: uuid.UUID) -> bool:
    return first(conn, EXPIRE_LEASE, {"run_id": run_id}) is not None


# Every instant the engine compares with now(), moved back by the same interval: the same
# as now() moving forward. A cron slot (scheduled_for) is a run's identity, not a clock
# reading, and stays; a clock step's window ({"since", "until"}: step.sleep, a wait) moves.
ADVANCE = Statement(
    "advance",
    "Skip time: move every stored instant of the engine's tables back by a number of seconds.",
    """
    WITH d AS (SELECT make_interval(secs => %(seconds)s) AS by),
    queue AS (
      UPDATE job_queue SET run_at = run_at - d.by, dispatched_at = dispatched_at - d.by,
             created_at = created_at - d.by, lease_expires_at = lease_expires_at - d.by,
             finished_at = finished_at - d.by,
             -- flow control's instants (throttle starts, a gathering's start) and the rollup's mark of
             -- a folded finish, which must keep equal to finished_at
             throttle_at = throttle_at - d.by, flow_since = flow_since - d.by, folded_at = folded_at - d.by
      FROM d RETURNING 1
    ), events AS (
      UPDATE job_event SET received_at = received_at - d.by FROM d RETURNING 1
    ), steps AS (
      UPDATE job_step SET started_at = started_at - d.by, completed_at = completed_at - d.by,
             output = CASE WHEN jsonb_typeof(output) = 'object' AND output ?& ARRAY['since', 'until']
                                AND (SELECT count(*) FROM jsonb_object_keys(output)) = 2   -- a clock step's window
                           THEN jsonb_build_object('since', CAST(output->>'since' AS timestamptz) - d.by,
                                                   'until', CAST(output->>'until' AS timestamptz) - d.by)
                           ELSE output END
      FROM d RETURNING 1
    ), attempts AS (
      UPDATE job_run SET started_at = started_at - d.by, finished_at = finished_at - d.by FROM d RETURNING 1
    ), dlq AS (
      UPDATE job_run_dlq SET first_failed_at = first_failed_at - d.by, last_failed_at = last_failed_at - d.by
      FROM d RETURNING 1
    ), sweep AS (
      UPDATE job_sweep SET swept_at = swept_at - d.by FROM d RETURNING 1
    )
    SELECT (SELECT count(*) FROM queue) AS runs
    """,
)


# The stats rollup's buckets move too, in two shifts that never land a bucket on one not moved
# yet (a unique index is checked row by row): far into the past, then back.
SHIFT_BUCKETS = Statement(
    "shift_buckets",
    "Skip time in the stats rollup: move every bucket (not the all-time totals) by a number of seconds.",
    "UPDATE job_stats_rollup SET bucket = bucket + make_interval(secs => %(seconds)s) WHERE bucket IS NOT NULL",
)

#: Far enough that no bucket is there (a thousand years, in seconds).
_APART = 1000 * 366 * 86400.0


def advance(conn: Conn, seconds: float) -> None:
    rows(conn, ADVANCE, {"seconds": seconds})
    rows(conn, SHIFT_BUCKETS, {"seconds": -seconds - _APART})
    rows(conn, SHIFT_BUCKETS, {"seconds": _APART})


STEPS_OF = Statement(
    "steps_of",
    "A run's stored step keys in the order they were stored.",
    "SELECT step_id, attempt, output FROM job_step WHERE run_id = %(run_id)s ORDER BY completed_at, started_at",
)


def steps_of(conn: Conn, run_id: uuid.UUID) -> list[dict[str, Any]]:
    return rows(conn, STEPS_OF, {"run_id": run_id})


RUN_OF = Statement(
    "run_of",
    "A run's state, charged attempts, result and its attempts' outcomes, for the kit's assertions.",
    """
    SELECT q.state, q.attempts, q.result, q.job_id,
           ARRAY(SELECT r.outcome FROM job_run r WHERE r.run_id = q.id ORDER BY r.started_at, r.id) AS outcomes
    FROM job_queue q WHERE q.id = %(run_id)s
    """,
)


def run_of(conn: Conn, run_id: uuid.UUID) -> dict[str, Any] | None:
    return first(conn, RUN_OF, {"run_id": run_id})


DLQ_ENTRIES = Statement(
    "dlq_entries",
    "Every DLQ entry, oldest first (the kit's motir.dlq()).",
    """
    SELECT id, run_id, function_id AS job_id, workspace_id, failure, attempts, replayed_at, dismissed_at, resumed_at
    FROM job_run_dlq ORDER BY first_failed_at, id
    """,
)


def dlq_entries(conn: Conn) -> list[dict[str, Any]]:
    return rows(conn, DLQ_ENTRIES, {})


EMPTY_TABLES = Statement(
    "empty_tables",
    "Start a test from empty tables.",
    "TRUNCATE job_run_dlq, job_step, job_run, job_batch_item, job_queue, job_event, job_stats_rollup, job_quota,"
    " job_admission CASCADE",
)

FREE_SWEEP_SLOT = Statement(
    "free_sweep_slot",
    "Start a test with the fleet's sweep slot free (the next sweep runs).",
    "UPDATE job_sweep SET swept_at = '-infinity', swept_by = NULL",
)


def empty_tables(conn: Conn) -> None:
    rows(conn, EMPTY_TABLES, {})
    rows(conn, FREE_SWEEP_SLOT, {})
