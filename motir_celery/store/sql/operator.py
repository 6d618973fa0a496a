"""The operator's statements: replay, resume, dismiss and cancel — one run or DLQ entry, or many.

What the CLI and the dashboard do on an operator's behalf (core/operator/). Each
"has this been answered already?" is a conditional UPDATE on the entry's audit
columns, so of two concurrent actions one acts and the other is told why not. The
visibility reads run under the caller's app or admin login (row-level security
says what they may see); the actions run as the engine role.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import TYPE_CHECKING, Any

from motir_celery.store.driver import Statement, first, rows

if TYPE_CHECKING:
    from motir_celery.store.driver import Conn

AUDIENCE = "operator"
ROLES = ("motir_engine", "motir_app", "motir_admin")

# --- visibility (under the caller's login) ------------------------------------------------

RUN_VISIBLE = Statement(
    "run_visible",
    "Whether the caller's login sees a run: row-level security decides (another workspace's is not found).",
    "SELECT 1 AS seen FROM job_queue WHERE id = %(id)s",
)

DLQ_VISIBLE = Statement(
    "dlq_visible",
    "Whether the caller's login sees a DLQ entry: row-level security decides.",
    "SELECT 1 AS seen FROM job_run_dlq WHERE id = %(id)s",
)


def visible(conn: Conn, statement: Statement, row_id: uuid.UUID) -> bool:
    return first(conn, statement, {"id": row_id}) is not None


# --- replay and dismiss ---------------------------------------------------------------------

MAY_REPLAY = Statement(
    "may_replay",
    "Whether the current login may replay a DLQ entry (UPDATE on it), and its name: before replay_dlq(session=).",
    "SELECT has_table_privilege('job_run_dlq', 'UPDATE') AS allowed, current_user::text AS login",
)


def may_replay(conn: Conn) -> tuple[bool, str]:
    """Whether ``conn``'s login may replay (the engine role may; the app role may not), and who it is."""
    row = first(conn, MAY_REPLAY, {})
    assert row is not None
    return bool(row["allowed"]), str(row["login"])


REPLAY_STAMP = Statement(
    "replay_stamp",
    "Stamp an open DLQ entry as replayed by an actor, and return what the replay re-emits.",
    """
    UPDATE job_run_dlq SET replayed_at = now(), replayed_by = %(actor)s
    WHERE id = %(id)s
      AND replayed_at IS NULL      -- a second replay (concurrent or later) stamps nothing
      AND dismissed_at IS NULL     -- a dismissed entry is closed
      AND resumed_at IS NULL       -- so is a resumed one (its run was queued again)
    RETURNING function_id, event_name, event_data, workspace_id, idempotency_key, run_id
    """,
)


def replay_stamp(conn: Conn, dlq_id: uuid.UUID, actor: str) -> dict[str, Any] | None:
    return first(conn, REPLAY_STAMP, {"id": dlq_id, "actor": actor})


ENTRY_STATUS = Statement(
    "entry_status",
    "Why a DLQ entry was not acted on: replayed (and by which run), resumed (and which run), dismissed, or missing.",
    """
    SELECT replayed_at IS NOT NULL AS replayed, replay_run_id, resumed_at IS NOT NULL AS resumed, resumed_run_id,
           dismissed_at IS NOT NULL AS dismissed
    FROM job_run_dlq WHERE id = %(id)s
    """,
)


def entry_status(conn: Conn, dlq_id: uuid.UUID) -> dict[str, Any] | None:
    return first(conn, ENTRY_STATUS, {"id": dlq_id})


REPLAY_LINK = Statement(
    "replay_link",
    "Link a replayed DLQ entry to the run its replay made, which takes the failed run's subject.",
    """
    WITH linked AS (
      UPDATE job_run_dlq SET replay_run_id = %(run_id)s WHERE id = %(id)s
      RETURNING run_id AS failed_run
    )
    UPDATE job_queue q SET subject_type = f.subject_type, subject_id = f.subject_id
    FROM linked l JOIN job_queue f ON f.id = l.failed_run    -- the run that failed (NULL once purged: none)
    WHERE q.id = %(run_id)s                                  -- the replay's run, written in this transaction
      AND f.subject_type IS NOT NULL                         -- it named a subject
    """,
)


def replay_link(conn: Conn, dlq_id: uuid.UUID, run_id: uuid.UUID) -> None:
    rows(conn, REPLAY_LINK, {"id": dlq_id, "run_id": run_id})


DISMISS = Statement(
    "dismiss",
    "Close an open DLQ entry without replaying it, audited (purge may then delete it).",
    """
    UPDATE job_run_dlq SET dismissed_at = now(), dismissed_by = %(actor)s
    WHERE id = %(id)s
      AND replayed_at IS NULL AND dismissed_at IS NULL AND resumed_at IS NULL   -- open entries only
    RETURNING 1 AS dismissed
    """,
)


def dismiss(conn: Conn, dlq_id: uuid.UUID, actor: str) -> bool:
    return first(conn, DISMISS, {"id": dlq_id, "actor": actor}) is not None


# --- cancel ---------------------------------------------------------------------

CANCEL = Statement(
    "cancel",
    "Cancel a queued or running run; a running one stops at its next step boundary (its token is cleared).",
    """
    WITH cancelled AS (
      UPDATE job_queue
      SET state = 'cancelled', finished_at = now(), claim_token = NULL, lease_expires_at = NULL,
          wait_event = NULL
      WHERE id = %(run_id)s
        AND state IN ('queued', 'running')     -- a finished run stays as it ended
      RETURNING id, attempts
    ), ledger AS (
      UPDATE job_run r SET outcome = 'cancelled', finished_at = now()
      FROM cancelled c WHERE r.run_id = c.id AND r.outcome = 'running'
    )
    SELECT count(*) AS cancelled FROM cancelled
    """,
)


def cancel(conn: Conn, run_id: uuid.UUID) -> bool:
    """Cancel a queued or running run. A running one stops at its next step
    boundary: the claim token is cleared, so its next write is refused."""
    row = first(conn, CANCEL, {"run_id": run_id})
    return bool(row and row["cancelled"])


#: The cancels' common end: each run of ``target`` (id, state) cancelled with its actor and reason,
#: its running attempt's ledger row closed; the runs and the states they had returned.
_CANCELLED = """), cancelled AS (
      UPDATE job_queue q
      SET state = 'cancelled', finished_at = now(), claim_token = NULL, lease_expires_at = NULL,
          wait_event = NULL, cancelled_by = %(actor)s, cancel_reason = %(reason)s
      FROM target t WHERE q.id = t.id
      RETURNING q.id, t.state AS was
    ), ledger AS (
      UPDATE job_run r SET outcome = 'cancelled', finished_at = now()
      FROM cancelled c WHERE r.run_id = c.id AND r.outcome = 'running'
    )
    SELECT id, was FROM cancelled
    """


CANCEL_WORKSPACE = Statement(
    "cancel_workspace",
    "Offboarding: cancel every queued (sleeping, waiting) and running run of one workspace, or of one job in it, audited.",
    """
    WITH target AS (
      SELECT id, state FROM job_queue
      WHERE workspace_id = %(workspace)s            -- the workspace offboarded (a tenant's: never the system's)
        AND state IN ('queued', 'running')          -- pending (queued, sleeping, waiting) or running; a finished run stays
        AND (CAST(%(job)s AS text) IS NULL OR job_id = %(job)s)   -- --job: one job of it
      FOR UPDATE                                    -- a claim or settle racing this one waits, then finds it cancelled
    """
    + _CANCELLED,
    prepare=False,   # an optional predicate: planned for each call's filter (driver.Statement)
)


def cancel_workspace(conn: Conn, workspace: str, job: str | None, actor: str,
                     reason: str) -> list[dict[str, Any]]:
    """Cancel the workspace's queued and running runs (of ``job`` only, when given), recording ``actor``
    and ``reason`` on each: ``[{id, was}]``, ``was`` the state it had. A running one stops at its next
    step boundary (its token cleared); a sleeping or waiting one is never woken."""
    return rows(conn, CANCEL_WORKSPACE, {"workspace": workspace, "job": job, "actor": actor, "reason": reason})


CANCEL_SUBJECT = Statement(
    "cancel_subject",
    "Offboarding a subject: cancel every queued (sleeping, waiting) and running run of one subject in one workspace, audited.",
    """
    WITH target AS (
      SELECT id, state FROM job_queue
      WHERE subject_type = %(subject_type)s AND subject_id = %(subject_id)s   -- the subject (ix_job_queue_subject_open)
        AND workspace_id = %(workspace)s            -- in the workspace named (a tenant's: never the system's)
        AND state IN ('queued', 'running')          -- pending (queued, sleeping, waiting) or running; a finished run stays
      FOR UPDATE                                    -- a claim or settle racing this one waits, then finds it cancelled
    """
    + _CANCELLED,
)


def cancel_subject(conn: Conn, workspace: str, subject_type: str, subject_id: str, actor: str,
                   reason: str) -> list[dict[str, Any]]:
    """Cancel the queued and running runs of one subject in ``workspace``, recording ``actor`` and
    ``reason`` on each: ``[{id, was}]``, as ``cancel_workspace``."""
    return rows(conn, CANCEL_SUBJECT, {"workspace": workspace, "subject_type": subject_type,
                                       "subject_id": subject_id, "actor": actor, "reason": reason})


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


def resume(conn: Conn, dlq_id: uuid.UUID, actor: str) -> dict[str, Any]:
    row = first(conn, RESUME, {"id": dlq_id, "actor": actor})
    assert row is not None
    return row


ENTRY_RUN = Statement(
    "entry_run",
    "A DLQ entry's run and whether the entry is open (resume reads it before planning what to resume).",
    """
    SELECT d.run_id, d.function_id,
           d.resumed_at IS NULL AND d.replayed_at IS NULL AND d.dismissed_at IS NULL AS open
    FROM job_run_dlq d WHERE d.id = %(id)s
    """,
)


def entry_run(conn: Conn, dlq_id: uuid.UUID) -> dict[str, Any] | None:
    return first(conn, ENTRY_RUN, {"id": dlq_id})


RUN_FAILURE = Statement(
    "run_failure",
    "A run's state, parent and step, and the DLQ entry that holds it now (open or answered), with its failure.",
    """
    SELECT q.id AS run_id, q.job_id, q.state, q.parent_run_id, q.parent_step_id,
           d.id AS dlq_id, d.failure,
           d.id IS NOT NULL AND d.replayed_at IS NULL AND d.dismissed_at IS NULL AND d.resumed_at IS NULL AS open,
           d.replayed_at IS NOT NULL AS replayed, d.dismissed_at IS NOT NULL AS dismissed
    FROM job_queue q
    LEFT JOIN job_run_dlq d ON d.run_id = q.id     -- uq (run_id): a resumed entry moved to resumed_run_id
    WHERE q.id = %(id)s
    """,
)


def run_failure(conn: Conn, run_id: uuid.UUID) -> dict[str, Any] | None:
    return first(conn, RUN_FAILURE, {"id": run_id})


STEP_CHILDREN = Statement(
    "step_children",
    "The children one step of a parent started (invoke, gather, a canvas link): state and the DLQ entry each holds.",
    """
    SELECT c.id AS run_id, c.job_id, c.state, c.parent_step_id,
           d.id AS dlq_id,
           d.id IS NOT NULL AND d.replayed_at IS NULL AND d.dismissed_at IS NULL AND d.resumed_at IS NULL AS open,
           d.replayed_at IS NOT NULL AS replayed, d.dismissed_at IS NOT NULL AS dismissed
    FROM job_queue c
    LEFT JOIN job_run_dlq d ON d.run_id = c.id
    WHERE c.parent_run_id = %(run_id)s                   -- uq_job_queue_parent_run_id_parent_step_id
      AND (c.parent_step_id = %(step)s OR starts_with(c.parent_step_id, %(step)s || '['))   -- step, step[i]
    """,
)


def step_children(conn: Conn, run_id: uuid.UUID, step: str) -> list[dict[str, Any]]:
    return rows(conn, STEP_CHILDREN, {"run_id": run_id, "step": step})


SUPERSEDE_STEP = Statement(
    "supersede_step",
    "Resume of a parent: its failed composition step's record (and its wait window) kept under a new name, so it awaits its child again.",
    """
    UPDATE job_step SET step_id = step_id || ':resumed:' || %(tag)s   -- ':' is reserved: no step id takes it
    WHERE run_id = %(run_id)s
      AND step_id IN (%(step)s, %(step)s || ':invoke')   -- the step's record, and a timeout's window of it
    RETURNING step_id
    """,
)


def supersede_step(conn: Conn, run_id: uuid.UUID, step: str, tag: str) -> int:
    return len(rows(conn, SUPERSEDE_STEP, {"run_id": run_id, "step": step, "tag": tag}))


COPY_COMPLETED_LINKS = Statement(
    "copy_completed_links",
    "Replay of a canvas: the links its failed run completed, stored on the replay's run (they do not run again).",
    """
    INSERT INTO job_step (run_id, step_id, workspace_id, output, attempt, started_at, completed_at)
    SELECT %(new)s, s.step_id, s.workspace_id, s.output,
           0,                                             -- stored by no attempt of this run: copied
           s.started_at, s.completed_at
    FROM job_step s
    WHERE s.run_id = %(old)s
      AND position(':' in s.step_id) = 0                  -- not a superseded record, not a wait's window
      AND jsonb_typeof(s.output) = 'array' AND jsonb_array_length(s.output) > 0   -- a link's outcomes...
      AND NOT EXISTS (SELECT 1 FROM jsonb_array_elements(s.output) o              -- ...every one a success
                      WHERE NOT (jsonb_typeof(o) = 'object' AND o ? 'ok'))
    ON CONFLICT DO NOTHING                                -- (run_id, step_id): once
    RETURNING step_id
    """,
)


def copy_completed_links(conn: Conn, old: uuid.UUID, new: uuid.UUID) -> int:
    return len(rows(conn, COPY_COMPLETED_LINKS, {"old": old, "new": new}))


# --- bulk -------------------------------------------------------------------------------

OPEN_ENTRIES = Statement(
    "open_entries",
    "The open DLQ entries the caller sees that match a filter (each part optional), oldest failure first.",
    """
    SELECT d.id, d.function_id AS job, d.workspace_id AS workspace, d.last_failed_at AS failed_at,
           concat_ws(': ', d.failure->>'type', d.failure->>'message') AS error
    FROM job_run_dlq d
    WHERE d.replayed_at IS NULL AND d.dismissed_at IS NULL AND d.resumed_at IS NULL   -- open entries only
      AND (CAST(%(job)s AS text) IS NULL OR d.function_id = %(job)s)                   -- --job
      AND (CAST(%(workspace)s AS text) IS NULL OR d.workspace_id = %(workspace)s)      -- --workspace
      AND (CAST(%(error)s AS text) IS NULL                                             -- --error, a substring
           OR concat_ws(': ', d.failure->>'type', d.failure->>'message') ILIKE %(error)s)
      AND (CAST(%(since)s AS timestamptz) IS NULL OR d.last_failed_at >= %(since)s)    -- --since
      AND (CAST(%(until)s AS timestamptz) IS NULL OR d.last_failed_at < %(until)s)     -- --until
    ORDER BY d.last_failed_at, d.id            -- oldest failure first
    LIMIT %(limit)s
    """,
    prepare=False,   # optional predicates: planned for each call's filters (driver.Statement)
)


def open_entries(conn: Conn, *, job: str | None, workspace: str | None, error_like: str | None,
                 since: datetime | None, until: datetime | None, limit: int) -> list[dict[str, Any]]:
    return rows(conn, OPEN_ENTRIES, {"job": job, "workspace": workspace, "error": error_like, "since": since,
                                     "until": until, "limit": limit})


# --- the way back to plain Celery (adapter/rollback.py) ------------------------------------------

ROLLBACK_PENDING = Statement(
    "rollback_pending",
    "The queued and running runs of direct jobs the way back to plain Celery would touch, with their arguments.",
    """
    SELECT q.id, q.job_id, q.state, q.run_at, GREATEST(q.run_at - now(), interval '0') AS due_in,
           e.data AS call,
           (SELECT count(*) FROM job_step s WHERE s.run_id = q.id) AS steps
    FROM job_queue q
    JOIN job_event e ON e.id = q.event_id
    WHERE q.job_id = ANY(%(jobs)s)                   -- the jobs being rolled back, and only those
      AND q.state IN ('queued', 'running')           -- finished runs have nothing to hand back
    ORDER BY q.created_at, q.id
    """,
)


def rollback_pending(conn: Conn, jobs: list[str]) -> list[dict[str, Any]]:
    return rows(conn, ROLLBACK_PENDING, {"jobs": jobs})


ROLLBACK_CANCEL = Statement(
    "rollback_cancel",
    "Cancel one queued run whose work is being handed back to plain Celery, marked as such.",
    """
    UPDATE job_queue
    SET state = 'cancelled', finished_at = now(), claim_token = NULL, lease_expires_at = NULL,
        wait_event = NULL, claimed_by = 'motir rollback',
        result = jsonb_build_object('rolled_back_as', %(task_id)s::text)
    WHERE id = %(run_id)s
      -- only a run no worker holds: of two rollbacks, or a rollback and a claim, one wins (written so
      -- that no partial index on the state matches it: the run is found by its primary key)
      AND (state = 'queued') IS TRUE
    RETURNING id
    """,
)


def rollback_cancel(conn: Conn, run_id: uuid.UUID, task_id: str) -> bool:
    """Cancel ``run_id`` if it is still queued (True), its work re-sent as Celery task ``task_id``."""
    return first(conn, ROLLBACK_CANCEL, {"run_id": run_id, "task_id": task_id}) is not None


# --- a workspace's export and erase (offboarding; core/operator/offboard.py) ------------------

#: Every table that carries a workspace's rows (each has workspace_id and its RLS policy).
WORKSPACE_TABLES = ("job_event", "job_queue", "job_step", "job_run", "job_run_dlq", "job_batch_item",
                    "job_progress", "job_stream_item", "job_stats_rollup")

WORKSPACE_ROWS = Statement(
    "workspace_rows",
    "How many rows of one workspace each table holds (offboarding's completeness check).",
    "SELECT " + ", ".join(f"(SELECT count(*) FROM {t} WHERE workspace_id = %(workspace)s) AS {t}"   # each: its workspace's
                          for t in WORKSPACE_TABLES),
)


def workspace_rows(conn: Conn, workspace: str) -> dict[str, int]:
    row = first(conn, WORKSPACE_ROWS, {"workspace": workspace})
    assert row is not None
    return {t: int(row[t]) for t in WORKSPACE_TABLES}


EXPORT_WORKSPACE = Statement(
    "export_workspace",
    "Every row of one workspace, table by table, each as its JSON text (never decoded: data nested too deeply exports too).",
    "\nUNION ALL\n".join(f"SELECT '{t}' AS tbl, CAST(to_jsonb(x) AS text) AS row FROM {t} x "
                          "WHERE x.workspace_id = %(workspace)s"                                   # the workspace's rows only
                          for t in WORKSPACE_TABLES),
    prepare=False,   # one call per offboarding
)


def export_workspace(conn: Conn, workspace: str) -> list[dict[str, Any]]:
    """``[{tbl, row}]``: every row of ``workspace``, ``row`` its JSON text."""
    return rows(conn, EXPORT_WORKSPACE, {"workspace": workspace})


WORKSPACE_ACTIVE = Statement(
    "workspace_active",
    "How many queued or running runs a workspace has (an erase refuses while there is one).",
    """
    SELECT count(*) AS n FROM job_queue
    WHERE workspace_id = %(workspace)s AND state IN ('queued', 'running')   -- cancel them first (cancel_workspace)
    """,
)


def workspace_active(conn: Conn, workspace: str) -> int:
    row = first(conn, WORKSPACE_ACTIVE, {"workspace": workspace})
    return int(row["n"]) if row else 0


# The erase, in this order in one transaction: the DLQ rows (they only SET NULL on a run's delete),
# the runs (their steps, attempts, batch items, progress and stream items go with them: ON DELETE
# CASCADE), the events (RESTRICT: no run may still name one), the stats rollup.
ERASE_DLQ = Statement(
    "erase_dlq",
    "Erase: one workspace's DLQ entries.",
    "DELETE FROM job_run_dlq WHERE workspace_id = %(workspace)s RETURNING id",   # the workspace's only
)
ERASE_RUNS = Statement(
    "erase_runs",
    "Erase: one workspace's runs, none queued or running (their steps, attempts, items and progress cascade).",
    """
    DELETE FROM job_queue
    WHERE workspace_id = %(workspace)s                 -- the workspace's only
      AND state NOT IN ('queued', 'running')           -- a run started meanwhile stays: the erase is then incomplete
    RETURNING id
    """,
)
ERASE_EVENTS = Statement(
    "erase_events",
    "Erase: one workspace's events (after its runs: a run still naming one refuses the erase).",
    "DELETE FROM job_event WHERE workspace_id = %(workspace)s RETURNING id",   # the workspace's only
)
ERASE_ROLLUP = Statement(
    "erase_rollup",
    "Erase: one workspace's rows of the stats rollup.",
    "DELETE FROM job_stats_rollup WHERE workspace_id = %(workspace)s RETURNING id",   # the workspace's only
)


def erase_workspace(conn: Conn, workspace: str) -> None:
    """Delete ``workspace``'s rows from every table, in the caller's transaction (see the comment above)."""
    for statement in (ERASE_DLQ, ERASE_RUNS, ERASE_EVENTS, ERASE_ROLLUP):
        rows(conn, statement, {"workspace": workspace})
