"""The statements of composition (issue 20), catalogued like ``statements.py``.

Batch send (``motir_record_events``, migration 0006), child runs of ``step.invoke`` /
``step.gather`` and their wait, ``resume_dlq``. Each is a ``Statement``: a name, a
one-line description, and its SQL with the reason for each predicate beside it.
Functions take a ``Connection`` and leave the transaction to the caller.
"""

from __future__ import annotations

import uuid
from typing import Any, Sequence

from sqlalchemy import Connection

from motir_celery.store.driver import Statement, first, rows
from motir_celery.store.statements import Claim, RunSpec

__all__ = ["RECORD_EVENTS", "record_events", "START_CHILDREN", "start_children", "LOCK_PARENT", "CHILDREN",
           "children", "lock_parent", "CANCEL_CHILDREN", "cancel_children", "RESUME", "resume", "WAKE_PARENT",
           "woken_parent", "CHILD_WAIT"]

#: The wait_event of a parent suspended until its children settle (the trigger
#: motir_run_settled matches it). No event is ever sent under this name with a
#: wait_value, so send_event never wakes such a parent.
CHILD_WAIT = "motir.children"

RECORD_EVENTS = Statement(
    "record_events",
    "Write N events, their runs, and wake the runs waiting for them (one statement: motir_record_events).",
    """
    SELECT * FROM motir_record_events(
      CAST(%(names)s AS text[]), CAST(%(datas)s AS jsonb[]), CAST(%(workspace_ids)s AS text[]),
      CAST(%(keys)s AS text[]), %(traceparent)s,
      CAST(%(run_events)s AS int[]), CAST(%(job_ids)s AS text[]), CAST(%(max_attempts)s AS int[]),
      CAST(%(policies)s AS text[]), CAST(%(priorities)s AS smallint[]), CAST(%(singletons)s AS text[]),
      CAST(%(concurrency)s AS text[]), CAST(%(cancel_keys)s AS text[]))
    """,
)


def record_events(conn: Connection, events: Sequence[tuple[str, str, str | None, str | None]],
                  specs: Sequence[Sequence[RunSpec]], *, traceparent: str | None) -> list[dict[str, Any]]:
    """``events``: (name, data as JSON, workspace, key); ``specs[i]``: the runs of event i.
    Rows: (woken, idx 1-based, event_id, run_id, job_id); an event deduplicated by its key has none."""
    flat = [(i + 1, s) for i, ss in enumerate(specs) for s in ss]
    params = {
        "names": [e[0] for e in events], "datas": [e[1] for e in events],
        "workspace_ids": [e[2] for e in events], "keys": [e[3] for e in events], "traceparent": traceparent,
        "run_events": [i for i, _ in flat], "job_ids": [s.job_id for _, s in flat],
        "max_attempts": [s.max_attempts for _, s in flat], "policies": [s.policy for _, s in flat],
        "priorities": [s.priority for _, s in flat], "singletons": [s.singleton_key for _, s in flat],
        "concurrency": [s.concurrency_key for _, s in flat], "cancel_keys": [s.cancel_key for _, s in flat],
    }
    return rows(conn, RECORD_EVENTS, params)


EXISTING_EVENTS = Statement(
    "existing_events",
    "What the idempotency keys of deduplicated events already stand for in their workspaces (same data, or not).",
    """
    SELECT k.i, e.id, e.data = k.data AS same
    FROM unnest(CAST(%(names)s AS text[]), CAST(%(keys)s AS text[]), CAST(%(datas)s AS jsonb[]),
                CAST(%(workspace_ids)s AS text[])) WITH ORDINALITY AS k(name, key, data, workspace_id, i)
    JOIN job_event e ON e.name = k.name AND e.idempotency_key = k.key   -- the key's event (uq_job_event_idempotency)
                    AND e.workspace_id IS NOT DISTINCT FROM k.workspace_id   -- keys are per workspace
    """,
)


def existing_events(conn: Connection, events: Sequence[tuple[str, str, str | None, str | None]]) -> list[dict[str, Any]]:
    params = {"names": [e[0] for e in events], "datas": [e[1] for e in events],
              "workspace_ids": [e[2] for e in events], "keys": [e[3] for e in events]}
    return rows(conn, EXISTING_EVENTS, params)


# --- child runs ----------------------------------------------------------------------

START_CHILDREN = Statement(
    "start_children",
    "Start the child runs of one step.invoke / step.gather (each once per (parent, step)), fenced on the parent's claim.",
    """
    WITH parent AS (
      SELECT id, workspace_id FROM job_queue
      WHERE id = %(run_id)s
        AND claim_token = %(token)s            -- fence: only the parent's current holder starts children
        AND state = 'running'
      FOR SHARE                                -- a concurrent cancel of the parent waits, then cancels them
    ), spec AS (
      SELECT * FROM unnest(CAST(%(steps)s AS text[]), CAST(%(names)s AS text[]), CAST(%(datas)s AS jsonb[]),
                           CAST(%(keys)s AS text[]), CAST(%(job_ids)s AS text[]), CAST(%(max_attempts)s AS int[]),
                           CAST(%(policies)s AS text[]), CAST(%(priorities)s AS smallint[]),
                           CAST(%(singletons)s AS text[]), CAST(%(concurrency)s AS text[]),
                           CAST(%(cancel_keys)s AS text[]), CAST(%(detached)s AS boolean[]))
             AS s(step_id, name, data, key, job_id, max_attempts, retry_policy, priority, singleton_key,
                  concurrency_key, cancel_key, detached)
    ), e AS (
      INSERT INTO job_event (name, data, workspace_id, idempotency_key)
      SELECT s.name, s.data, p.workspace_id, s.key        -- the child carries the parent's workspace
      FROM parent p, spec s
      -- the key is derived from (parent run, step): a parent that runs this step again
      -- (retry, crash, redelivery) writes no second event (uq_job_event_idempotency)
      ON CONFLICT DO NOTHING
      RETURNING id, name, workspace_id, idempotency_key
    ), runs AS (
      INSERT INTO job_queue (event_id, job_id, event_name, workspace_id, max_attempts, retry_policy, priority,
                             singleton_key, concurrency_key, cancel_key, traceparent, parent_run_id, parent_step_id,
                             detached)
      SELECT e.id, s.job_id, e.name, e.workspace_id, s.max_attempts, s.retry_policy, s.priority,
             s.singleton_key, s.concurrency_key, s.cancel_key, %(traceparent)s, p.id, s.step_id, s.detached
      FROM e JOIN spec s ON s.key = e.idempotency_key, parent p
      -- No conflict target: UNIQUE (parent_run_id, parent_step_id) is the arbiter of one child
      -- per (parent, step); (event_id, job_id) and the singleton index apply as to any run.
      ON CONFLICT DO NOTHING
      RETURNING id, job_id
    )
    SELECT id AS run_id, job_id, (SELECT count(*) FROM parent) AS held FROM runs
    UNION ALL SELECT NULL, NULL, (SELECT count(*) FROM parent)    -- always one row: is the parent still ours?
    """,
)


def start_children(conn: Connection, claim: Claim, children_: Sequence[tuple[str, str, str, str, RunSpec]],
                   *, traceparent: str | None, detach: bool = False) -> tuple[bool, list[tuple[uuid.UUID, str]]]:
    """``children_``: (step key, event name, data as JSON, idempotency key, spec).
    Returns (parent still held, [(run_id, job_id) created now]) — publish those after commit."""
    params = {
        "run_id": claim.run_id, "token": claim.token, "traceparent": traceparent,
        "steps": [c[0] for c in children_], "names": [c[1] for c in children_], "datas": [c[2] for c in children_],
        "keys": [c[3] for c in children_], "job_ids": [c[4].job_id for c in children_],
        "max_attempts": [c[4].max_attempts for c in children_], "policies": [c[4].policy for c in children_],
        "priorities": [c[4].priority for c in children_], "singletons": [c[4].singleton_key for c in children_],
        "concurrency": [c[4].concurrency_key for c in children_],
        "cancel_keys": [c[4].cancel_key for c in children_], "detached": [detach for _ in children_],
    }
    found = rows(conn, START_CHILDREN, params)
    held = bool(found and found[-1]["held"])
    return held, [(r["run_id"], r["job_id"]) for r in found if r["run_id"] is not None]


LOCK_PARENT = Statement(
    "lock_parent",
    "The per-parent lock the trigger motir_run_settled takes before waking a parent (held to commit).",
    "SELECT pg_advisory_xact_lock(hashtextextended('motir.parent:' || CAST(%(run_id)s AS text), 0)) AS locked",
)


def lock_parent(conn: Connection, run_id: uuid.UUID) -> None:
    """After it, every child settle committed so far is visible, and every later one
    sees this transaction's suspension (and wakes it)."""
    rows(conn, LOCK_PARENT, {"run_id": run_id})


CHILDREN = Statement(
    "children",
    "The children of one step of a parent: state, result, and the error of their last attempt.",
    """
    SELECT c.parent_step_id AS step_id, c.id AS run_id, c.job_id, c.state, c.result,
           (SELECT r.error FROM job_run r
            WHERE r.run_id = c.id                    -- its ledger (ix_job_run_ledger)
            ORDER BY r.started_at DESC LIMIT 1) AS error
    FROM job_queue c
    WHERE c.parent_run_id = %(run_id)s               -- served by uq_job_queue_parent_run_id_parent_step_id
      AND c.parent_step_id = ANY(CAST(%(steps)s AS text[]))
    """,
)


def children(conn: Connection, run_id: uuid.UUID, steps: Sequence[str]) -> dict[str, dict[str, Any]]:
    return {r["step_id"]: r for r in rows(conn, CHILDREN, {"run_id": run_id, "steps": list(steps)})}


CANCEL_CHILDREN = Statement(
    "cancel_children",
    "Cancel the unfinished children of one step (its timeout passed); their ledgers closed.",
    """
    WITH cancelled AS (
      UPDATE job_queue
      SET state = 'cancelled', finished_at = now(), claim_token = NULL, lease_expires_at = NULL, wait_event = NULL
      WHERE parent_run_id = %(run_id)s AND parent_step_id = ANY(CAST(%(steps)s AS text[]))
        AND state IN ('queued', 'running')     -- a finished child stays as it ended
        AND NOT detached                       -- a detached child runs on; the parent stops waiting
      RETURNING id
    ), ledger AS (
      UPDATE job_run r SET outcome = 'cancelled', finished_at = now()
      FROM cancelled c WHERE r.run_id = c.id AND r.outcome = 'running'
    )
    SELECT id AS run_id FROM cancelled
    """,
)


def cancel_children(conn: Connection, run_id: uuid.UUID, steps: Sequence[str]) -> list[uuid.UUID]:
    return [r["run_id"] for r in rows(conn, CANCEL_CHILDREN, {"run_id": run_id, "steps": list(steps)})]


WAKE_PARENT = Statement(
    "woken_parent",
    "The parent a child's settle just made due (the trigger did it, in the settle's transaction): publish it.",
    """
    SELECT p.id AS run_id, p.job_id FROM job_queue c JOIN job_queue p ON p.id = c.parent_run_id
    WHERE c.id = %(run_id)s
      AND p.state = 'queued' AND p.wait_event = 'motir.children'   -- suspended for its children
      AND p.run_at <= now()                                         -- and due: the last child settled
    """,
)


def woken_parent(conn: Connection, run_id: uuid.UUID) -> tuple[uuid.UUID, str] | None:
    row = first(conn, WAKE_PARENT, {"run_id": run_id})
    return None if row is None else (row["run_id"], row["job_id"])


# --- resume ----------------------------------------------------------------------------

RESUME = Statement(
    "resume",
    "Close a DLQ entry as resumed and queue its failed run again, steps kept, attempts fresh (one statement).",
    """
    WITH entry AS (
      UPDATE job_run_dlq
      SET resumed_at = now(), resumed_by = %(actor)s,
          resumed_run_id = run_id, run_id = NULL     -- closed; the run may fail again into an entry of its own
      WHERE id = %(id)s
        AND resumed_at IS NULL                       -- a second resume (concurrent or later) stamps nothing
        AND replayed_at IS NULL                      -- replayed: the failure was answered with a new run
        AND dismissed_at IS NULL                     -- dismissed: closed
        AND run_id IS NOT NULL                       -- the run still exists (not purged)
      RETURNING resumed_run_id
    ), run AS (
      UPDATE job_queue q
      SET state = 'queued', attempts = 0,            -- a fresh attempt budget (max_attempts as recorded)
          run_at = now(), dispatched_at = now(),     -- due now; the caller publishes after commit
          finished_at = NULL, result = NULL, claim_token = NULL, claimed_by = NULL, lease_expires_at = NULL,
          wait_event = NULL, wait_path = NULL, wait_value = NULL
      FROM entry
      WHERE q.id = entry.resumed_run_id
        AND q.state = 'failed'                       -- only a run that failed for good is resumed
      RETURNING q.id, q.job_id
    )
    SELECT (SELECT count(*) FROM entry) AS stamped, run.id AS run_id, run.job_id FROM (SELECT 1) one
    LEFT JOIN run ON true
    """,
)

RESUME_STATUS = Statement(
    "resume_status",
    "Why an entry was not resumed: missing, resumed, replayed, dismissed, or its run purged.",
    """
    SELECT resumed_at IS NOT NULL AS resumed, resumed_run_id, replayed_at IS NOT NULL AS replayed,
           dismissed_at IS NOT NULL AS dismissed
    FROM job_run_dlq WHERE id = %(id)s
    """,
)


def resume(conn: Connection, dlq_id: uuid.UUID, actor: str) -> dict[str, Any]:
    row = first(conn, RESUME, {"id": dlq_id, "actor": actor})
    assert row is not None
    return row


def resume_status(conn: Connection, dlq_id: uuid.UUID) -> dict[str, Any] | None:
    return first(conn, RESUME_STATUS, {"id": dlq_id})
