"""Admission: who goes next (core/admission.py) — the gate before a run's message leaves, the
dispatcher's choice of the next held run, and the quotas an operator writes.

A run is *in flight* when it is ``queued`` with a message sent (``dispatched_at <= now()``) or
``running``; it is *held* when admission kept its message back (``queued``,
``dispatched_at = 'infinity'``). Sleepers (a future ``dispatched_at``) are neither until due.

Every decision runs in a transaction that first takes the admission lock (``lock_admission``):
the gate and the choice count what is in flight, then write, and two of them at once would both
count the same free slot. The lock is its own statement because a statement's snapshot is taken
when it starts: a count in the statement that took the lock would not see the commit of the
decision it waited for.

For the same reason "sent" is ``dispatched_at <= statement_timestamp()``, not ``now()``: ``now()``
is the transaction's start, before the wait for the lock, and a decision committed during that
wait stamped its run with its own, later ``now()`` — a count against ours missed it, and a
workspace capped at 2 had 3 running (the chaos soak's scenario 12 found it). Every committed row's
stamp is earlier than its commit, so earlier than the decision statement's start: the database's
clock still, read once a decision.

Run by the engine role; a tenant's view of its own quota is reads.py's ``quota_status``.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, Sequence

from motir_celery.store.driver import Statement, first, rows
from motir_celery.store.records import Admitted, Chosen, Quota

if TYPE_CHECKING:
    from motir_celery.store.driver import Conn

AUDIENCE = "admission"
ROLES = ("motir_engine",)

LOCK_ADMISSION = Statement(
    "lock_admission",
    "The fleet's in-flight limit (none: admission is off), and the admission lock until the transaction ends.",
    """
    SELECT max_in_flight, pg_advisory_xact_lock(hashtextextended('motir.admission', 0)) AS locked
    FROM job_admission
    WHERE name = 'fleet'                       -- the one row; none: admission off, no lock taken
    """,
)


def lock_admission(conn: Conn) -> int | None:
    """The fleet's in-flight limit, with the admission lock held to commit; ``None``: admission is off."""
    row = first(conn, LOCK_ADMISSION, {})
    return None if row is None else int(row["max_in_flight"])


#: The fleet's runs in flight, up to the limit (each half stops at the limit: a count of a backlog
#: it never needs). ``ix_job_queue_leases`` and ``ix_job_queue_stale``, each a range of its own.
_FLEET_BUSY = """
    (SELECT count(*) FROM (SELECT 1 FROM job_queue
                           WHERE state = 'running'                 -- ix_job_queue_leases
                             AND id <> ALL(CAST(%(run_ids)s AS uuid[]))   -- the runs being decided
                           LIMIT %(limit)s) r)
    + (SELECT count(*) FROM (SELECT 1 FROM job_queue
                             WHERE state = 'queued'                 -- ix_job_queue_stale
                               AND dispatched_at <= statement_timestamp()   -- sent: not held, not asleep
                               AND id <> ALL(CAST(%(run_ids)s AS uuid[]))
                             LIMIT %(limit)s) d)
"""

#: One workspace's runs in flight (key ``k``), up to ``cap`` (ix_job_queue_in_flight).
_WORKSPACE_BUSY = """
    (SELECT count(*) FROM (SELECT 1 FROM job_queue r
                           WHERE coalesce(r.workspace_id, '') = {k}          -- the workspace's range
                             AND (r.state IN ('queued', 'running')) IS TRUE            -- as the index is declared
                             AND r.dispatched_at <= statement_timestamp()    -- in flight, not held or asleep
                             AND r.id <> ALL(CAST(%(run_ids)s AS uuid[]))
                           LIMIT {cap}) w)
"""

ADMIT = Statement(
    "admit",
    "The gate before runs' messages leave: admit those the fleet's limit and their workspace's cap leave room for; hold the rest.",
    f"""
    WITH batch AS (
      SELECT q.id, q.job_id, coalesce(q.workspace_id, '') AS k,
             row_number() OVER (ORDER BY q.priority DESC, q.created_at, q.id) AS fleet_rank,
             row_number() OVER (PARTITION BY coalesce(q.workspace_id, '')
                                ORDER BY q.priority DESC, q.created_at, q.id) AS ws_rank
      FROM job_queue q
      WHERE q.id = ANY(CAST(%(run_ids)s AS uuid[]))             -- the runs about to be published (primary key)
        AND (q.state = 'queued') IS TRUE                         -- still waiting (a cancelled run is not sent)
        AND q.dispatched_at < 'infinity'::timestamptz            -- not held already
    ), ws AS (
      SELECT b.k, qu.max_running AS cap,
             CASE WHEN qu.max_running IS NULL THEN 0             -- no cap: nothing to count
                  ELSE {_WORKSPACE_BUSY.format(k="b.k", cap="qu.max_running")} END AS busy
      FROM (SELECT DISTINCT k FROM batch) b
      LEFT JOIN job_quota qu ON coalesce(qu.workspace_id, '') = b.k   -- uq_job_quota_workspace; none: no cap
    ), fleet AS (
      SELECT {_FLEET_BUSY} AS busy,
             -- a due held run waits ahead of any newcomer: the dispatcher's order decides, not arrival.
             -- In ix_job_queue_held's order, so that it reads the held runs only (an EXISTS here
             -- was planned as a scan of the table, read whole whenever nothing is held).
             (SELECT true FROM job_queue h
              WHERE h.dispatched_at = 'infinity'::timestamptz AND (h.state = 'queued') IS TRUE
                AND h.run_at <= now()
              ORDER BY coalesce(h.workspace_id, ''), h.priority DESC, h.created_at
              LIMIT 1) IS NOT NULL AS waiting
    ), decided AS (
      SELECT b.id, b.job_id,
             NOT f.waiting
             AND f.busy + b.fleet_rank <= %(limit)s              -- room in the fleet's limit
             AND (w.cap IS NULL OR w.busy + b.ws_rank <= w.cap)  -- and under its workspace's cap
             AS admitted
      FROM batch b JOIN ws w ON w.k = b.k, fleet f
    ), held AS (
      UPDATE job_queue q SET dispatched_at = 'infinity'::timestamptz   -- held: the dispatcher sends it
      FROM decided d WHERE q.id = d.id AND NOT d.admitted
      RETURNING q.id
    )
    SELECT d.id AS run_id, d.job_id, d.admitted, greatest(%(limit)s - f.busy, 0) AS room
    FROM decided d, fleet f
    """,
)


def admit(conn: Conn, run_ids: Sequence[uuid.UUID], *, limit: int) -> list[Admitted]:
    """Decide ``run_ids`` (queued, about to be published) under the admission lock: each admitted
    (publish it) or held (its dispatched_at set to 'infinity'). A run not listed is no longer queued."""
    return [Admitted(**r) for r in rows(conn, ADMIT, {"run_ids": list(run_ids), "limit": limit})]


CHOOSE_NEXT = Statement(
    "choose_next",
    "The dispatcher's choice: the next held run by priority, then fair share by weight, skipping capped workspaces; marked sent.",
    f"""
    WITH RECURSIVE keys AS (
      -- every workspace with a held run, one probe each along ix_job_queue_held (a loose index scan)
      (SELECT coalesce(workspace_id, '') AS k FROM job_queue
       WHERE dispatched_at = 'infinity'::timestamptz AND (state = 'queued') IS TRUE   -- held (the index's predicate)
       ORDER BY coalesce(workspace_id, '') LIMIT 1)
      UNION ALL
      SELECT (SELECT coalesce(q.workspace_id, '') FROM job_queue q
              WHERE q.dispatched_at = 'infinity'::timestamptz AND (q.state = 'queued') IS TRUE
                AND coalesce(q.workspace_id, '') > keys.k                          -- the next workspace
              ORDER BY coalesce(q.workspace_id, '') LIMIT 1)
      FROM keys WHERE keys.k IS NOT NULL
    ), heads AS (
      SELECT keys.k, h.id, h.priority, h.created_at,
             coalesce(qu.weight, 1) AS weight, qu.max_running AS cap
      FROM keys
      CROSS JOIN LATERAL (
        SELECT q.id, q.priority, q.created_at FROM job_queue q
        WHERE coalesce(q.workspace_id, '') = keys.k                                -- this workspace's
          AND q.dispatched_at = 'infinity'::timestamptz AND (q.state = 'queued') IS TRUE   -- held runs
          AND q.run_at <= now()                                                    -- that are due
        ORDER BY q.priority DESC, q.created_at                                     -- most urgent, oldest
        LIMIT 1) h
      LEFT JOIN job_quota qu ON coalesce(qu.workspace_id, '') = keys.k             -- none: weight 1, no cap
      WHERE keys.k IS NOT NULL
    ), shares AS (
      SELECT hd.*, {_WORKSPACE_BUSY.format(k="hd.k", cap="coalesce(hd.cap, %(limit)s)")} AS busy FROM heads hd
    ), chosen AS (
      SELECT s.id FROM shares s
      WHERE (s.cap IS NULL OR s.busy < s.cap)                   -- a workspace at its cap waits
        AND {_FLEET_BUSY} < %(limit)s                           -- a free slot in the fleet's limit
      ORDER BY s.priority DESC,                                 -- priority first, across workspaces
               s.busy::float8 / s.weight,                       -- then the fewest in flight per weight
               s.created_at                                     -- then the oldest
      LIMIT 1
    )
    UPDATE job_queue q SET dispatched_at = now()                -- sent: publish it after commit
    FROM chosen c
    WHERE q.id = c.id
      AND q.dispatched_at = 'infinity'::timestamptz AND (q.state = 'queued') IS TRUE   -- still held
    RETURNING q.id AS run_id, q.job_id, q.workspace_id, q.priority
    """,
)


def choose_next(conn: Conn, *, limit: int) -> Chosen | None:
    """Under the admission lock: the next held run to send (marked sent; publish it after commit), or
    ``None`` (nothing held and due, every waiting workspace at its cap, or no free slot)."""
    row = first(conn, CHOOSE_NEXT, {"limit": limit, "run_ids": []})
    return None if row is None else Chosen(**row)


# --- the operator's writes (motir quota) ------------------------------------------------------

SET_QUOTA = Statement(
    "set_quota",
    "Write one workspace's weight and cap (an operator's motir quota set): the dispatcher's next choice reads it.",
    """
    INSERT INTO job_quota AS t (workspace_id, weight, max_running, updated_by)
    VALUES (%(workspace_id)s, coalesce(CAST(%(weight)s AS int), 1), %(max_running)s, %(actor)s)
    ON CONFLICT ((coalesce(workspace_id, ''))) DO UPDATE           -- uq_job_quota_workspace: one row each
    SET weight = coalesce(CAST(%(weight)s AS int), t.weight),      -- a value not given is kept
        max_running = CASE WHEN %(clear_cap)s THEN NULL
                           ELSE coalesce(CAST(%(max_running)s AS int), t.max_running) END,
        updated_at = now(), updated_by = %(actor)s
    RETURNING workspace_id, weight, max_running, updated_at, updated_by
    """,
)


def set_quota(conn: Conn, workspace_id: str | None, *, weight: int | None, max_running: int | None,
              clear_cap: bool, actor: str) -> Quota:
    row = first(conn, SET_QUOTA, {"workspace_id": workspace_id, "weight": weight, "max_running": max_running,
                                  "clear_cap": clear_cap, "actor": actor})
    assert row is not None
    return Quota(**row)


SET_IN_FLIGHT = Statement(
    "set_in_flight",
    "Turn admission on with the fleet's in-flight limit, or change it (motir quota admission).",
    """
    INSERT INTO job_admission AS t (name, max_in_flight, updated_by) VALUES ('fleet', %(limit)s, %(actor)s)
    ON CONFLICT (name) DO UPDATE SET max_in_flight = excluded.max_in_flight, updated_at = now(),
                                     updated_by = excluded.updated_by      -- pk_job_admission: the one row
    RETURNING max_in_flight
    """,
)


def set_in_flight(conn: Conn, limit: int, *, actor: str) -> None:
    first(conn, SET_IN_FLIGHT, {"limit": limit, "actor": actor})


ADMISSION_OFF = Statement(
    "admission_off",
    "Turn admission off: delete the fleet's row, and send every held run (motir quota admission --off).",
    """
    WITH off AS (DELETE FROM job_admission WHERE name = 'fleet' RETURNING 1)   -- the one row
    UPDATE job_queue SET dispatched_at = now()
    WHERE dispatched_at = 'infinity'::timestamptz AND (state = 'queued') IS TRUE   -- ix_job_queue_held: the held
    RETURNING id AS run_id, job_id
    """,
)


def admission_off(conn: Conn) -> list[tuple[uuid.UUID, str]]:
    """Admission off; the runs it held, marked sent (publish them after commit)."""
    return [(r["run_id"], r["job_id"]) for r in rows(conn, ADMISSION_OFF, {})]


QUOTAS = Statement(
    "quotas",
    "Every workspace's quota and what it has in flight and held now (motir quota show; an operator's view).",
    """
    SELECT qu.workspace_id, qu.weight, qu.max_running, qu.updated_at, qu.updated_by,
           (SELECT count(*) FROM job_queue r                       -- ix_job_queue_in_flight
            WHERE coalesce(r.workspace_id, '') = coalesce(qu.workspace_id, '')
              AND (r.state IN ('queued', 'running')) IS TRUE AND r.dispatched_at <= now()) AS in_flight,
           (SELECT count(*) FROM job_queue h                       -- ix_job_queue_held
            WHERE coalesce(h.workspace_id, '') = coalesce(qu.workspace_id, '')
              AND h.dispatched_at = 'infinity'::timestamptz AND (h.state = 'queued') IS TRUE) AS held,
           (SELECT max_in_flight FROM job_admission WHERE name = 'fleet') AS fleet_limit
    FROM job_quota qu
    WHERE CAST(%(every)s AS boolean)                                          -- every workspace, or one
       OR coalesce(qu.workspace_id, '') = coalesce(CAST(%(workspace_id)s AS text), '')
    ORDER BY coalesce(qu.workspace_id, '')
    """,
)


def quotas(conn: Conn, workspace_id: str | None = None, *, every: bool = True) -> list[dict[str, Any]]:
    """Every quota row (``every``), or ``workspace_id``'s (None: the system runs')."""
    return rows(conn, QUOTAS, {"workspace_id": workspace_id, "every": every})


FLEET = Statement(
    "fleet_admission",
    "The fleet's in-flight limit (none: admission off), its runs in flight and held (motir quota show).",
    """
    SELECT (SELECT max_in_flight FROM job_admission WHERE name = 'fleet') AS fleet_limit,   -- the one row
           (SELECT count(*) FROM job_queue WHERE state = 'running')                          -- ix_job_queue_leases
           + (SELECT count(*) FROM job_queue WHERE state = 'queued' AND dispatched_at <= now())   -- _stale
             AS in_flight,
           (SELECT count(*) FROM job_queue                                                   -- ix_job_queue_held
            WHERE dispatched_at = 'infinity'::timestamptz AND (state = 'queued') IS TRUE) AS held
    """,
)


def fleet(conn: Conn) -> dict[str, Any]:
    row = first(conn, FLEET, {})
    assert row is not None
    return row
