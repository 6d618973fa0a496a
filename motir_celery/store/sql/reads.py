"""The reads behind the CLI, the dashboard, /metrics and ``motir doctor``: runs, a run in full, events, the DLQ, health.

The CLI, the dashboard and /metrics send these on a ``workspace_session`` connection:
the app role (or the admin login), row-level security on, so *what* a caller sees is
decided by the policies from the workspace context, never by a ``WHERE`` here. Every
filter below only narrows what the policies already allow; each is optional
(``CAST(%(x)s AS type) IS NULL OR …``: one fixed statement, no SQL built per call).
Every statement is a plain SELECT, so the session may be on a hot standby
(``FRESHNESS`` says how far behind it is).

``motir doctor`` sends its health counts (the ``doctor`` section) as the engine login,
which sees every workspace — it judges the whole fleet — and its login probes as the
app and admin logins it checks. ``ops/reads.py`` and ``ops/metrics.py`` turn the rows
into values; ``ops/doctor.py`` into checks.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import TYPE_CHECKING, Any, Sequence

from motir_celery.store.driver import Statement, first, rows

if TYPE_CHECKING:
    from motir_celery.store.driver import Conn

AUDIENCE = "reads"
ROLES = ("motir_app", "motir_admin", "motir_engine")

# --- where the rows come from ----------------------------------------------------------------

FRESHNESS = Statement(
    "freshness",
    "The reading server's now() and, on a hot standby, whether it streams and how far behind it is.",
    """
    SELECT now() AS now, pg_is_in_recovery() AS standby,
           -- the receiver's pid is the one column of this view every role may read
           EXISTS (SELECT 1 FROM pg_stat_wal_receiver) AS streaming,
           -- replay can be ahead of receive (WAL found in pg_wal at start): that is zero behind
           greatest(pg_wal_lsn_diff(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn()), 0) AS behind,
           -- both clocks (the primary's commit stamp, this server's now()) may differ: never negative
           greatest(extract(epoch FROM now() - pg_last_xact_replay_timestamp()), 0) AS age
    """,
)


def freshness(conn: Conn) -> dict[str, Any]:
    row = first(conn, FRESHNESS, {})
    assert row is not None
    return row


REPLAYED = Statement(
    "replayed",
    "Whether this server shows the primary's writes up to a WAL position (always true on a primary).",
    # a primary has no replay position (NULL): everything it committed, it shows
    "SELECT coalesce(pg_last_wal_replay_lsn() >= CAST(%(lsn)s AS pg_lsn), true) AS replayed",
)


def replayed(conn: Conn, lsn: str) -> bool:
    row = first(conn, REPLAYED, {"lsn": lsn})
    assert row is not None
    return bool(row["replayed"])


# --- runs ------------------------------------------------------------------------------------

# A run's summary: its row, and whether an open DLQ entry holds it.
_RUN_COLUMNS = """
    q.id, q.job_id, q.event_name, q.workspace_id, q.state, q.attempts, q.max_attempts, q.retry_policy,
    q.created_at, q.run_at, q.finished_at, q.claimed_by,
    EXISTS (SELECT 1 FROM job_run_dlq d
            WHERE d.run_id = q.id
              AND d.replayed_at IS NULL AND d.dismissed_at IS NULL) AS in_dlq   -- open (a resumed one has no run_id)
"""

LIST_RUNS = Statement(
    "list_runs",
    "The newest runs the caller sees, narrowed by job, state, workspace and creation time (each optional).",
    f"""
    SELECT {_RUN_COLUMNS}
    FROM job_queue q
    WHERE (CAST(%(job)s AS text) IS NULL OR q.job_id = %(job)s)                       -- --job
      AND (CAST(%(state)s AS text) IS NULL OR q.state = %(state)s)                    -- --state
      AND (CAST(%(workspace)s AS text) IS NULL OR q.workspace_id = %(workspace)s)     -- an admin's --workspace
      AND (CAST(%(since)s AS timestamptz) IS NULL OR q.created_at >= %(since)s)       -- --since
    ORDER BY q.created_at DESC, q.id        -- newest first; the id breaks ties stably
    LIMIT %(limit)s
    """,
    prepare=False,   # optional predicates: planned for each call's filters (driver.Statement)
)


def list_runs(conn: Conn, *, job: str | None, state: str | None, workspace: str | None,
              since: datetime | None, limit: int) -> list[dict[str, Any]]:
    return rows(conn, LIST_RUNS, {"job": job, "state": state, "workspace": workspace, "since": since,
                                  "limit": limit})


RUN = Statement(
    "run",
    "One run the caller sees, with its event, lease, result and audit (step.audit), and the database's now().",
    f"""
    SELECT {_RUN_COLUMNS}, now() AS now, q.event_id, e.data AS event_data, e.idempotency_key,
           q.scheduled_for, q.lease_expires_at, q.result, q.provider_key, q.model_version
    FROM job_queue q LEFT JOIN job_event e ON e.id = q.event_id   -- a cron run has no event
    WHERE q.id = %(id)s
    """,
)


def run(conn: Conn, run_id: uuid.UUID) -> dict[str, Any] | None:
    return first(conn, RUN, {"id": run_id})


RUN_STEPS = Statement(
    "run_steps",
    "A run's stored steps, in the order they ran.",
    """
    SELECT step_id, attempt, started_at, completed_at, output FROM job_step
    WHERE run_id = %(id)s
    ORDER BY started_at, completed_at, step_id
    """,
)


def run_steps(conn: Conn, run_id: uuid.UUID) -> list[dict[str, Any]]:
    return rows(conn, RUN_STEPS, {"id": run_id})


RUN_ATTEMPTS = Statement(
    "run_attempts",
    "A run's attempts (the ledger): worker, outcome, times and error of each.",
    """
    SELECT attempt, worker, outcome, started_at, finished_at, error FROM job_run
    WHERE run_id = %(id)s
    ORDER BY started_at, id   -- in the order they ran (ix_job_run_ledger): a resume restarts the numbers at 1
    """,
)


def run_attempts(conn: Conn, run_id: uuid.UUID) -> list[dict[str, Any]]:
    return rows(conn, RUN_ATTEMPTS, {"id": run_id})


# Every column of a DLQ entry (ops/reads.py's DlqEntry, field by field).
_DLQ_COLUMNS = """
    d.id, d.run_id, d.workspace_id, d.function_id, d.event_name, d.event_data, d.failure, d.attempts,
    d.first_failed_at, d.last_failed_at, d.replayed_at, d.replayed_by, d.replay_run_id,
    d.dismissed_at, d.dismissed_by, d.resumed_at, d.resumed_by, d.resumed_run_id, d.idempotency_key
"""

RUN_DLQ = Statement(
    "run_dlq",
    "The DLQ entries of a run: its own (it failed) and the one it is the replay of.",
    f"""
    SELECT {_DLQ_COLUMNS} FROM job_run_dlq d
    WHERE d.run_id = %(id)s              -- its own entry (at most one)
       OR d.replay_run_id = %(id)s       -- the entry whose replay made it (ix_job_run_dlq_replay_run)
    """,
)


def run_dlq(conn: Conn, run_id: uuid.UUID) -> list[dict[str, Any]]:
    return rows(conn, RUN_DLQ, {"id": run_id})


RUN_FAMILY = Statement(
    "run_family",
    "The run that started a run (step.invoke / step.gather) and the runs it started, with their step.",
    """
    -- Two index lookups (the primary key; uq_job_queue_parent_run_id_parent_step_id), not an OR join.
    SELECT q.id, q.job_id, q.state, q.parent_step_id, true AS is_parent FROM job_queue q
    WHERE q.id = (SELECT parent_run_id FROM job_queue WHERE id = %(id)s)       -- its parent
    UNION ALL
    SELECT q.id, q.job_id, q.state, q.parent_step_id, false FROM job_queue q
    WHERE q.parent_run_id = %(id)s                                              -- its children
    """,
)


def run_family(conn: Conn, run_id: uuid.UUID) -> list[dict[str, Any]]:
    return rows(conn, RUN_FAMILY, {"id": run_id})


RUN_TREE = Statement(
    "run_tree",
    "A run's descendants (a canvas's tree: the run page, motir runs tree), breadth first, to a bounded depth and count.",
    """
    WITH RECURSIVE tree AS (
      SELECT c.id, c.parent_run_id, c.parent_step_id, c.job_id, c.state, 1 AS depth,
             left(c.result::text, 120) AS result        -- a glimpse: a chord's body may hold 10,000 values
      FROM job_queue c
      WHERE c.parent_run_id = %(id)s                    -- its children (uq_job_queue_parent_run_id_parent_step_id)
      UNION ALL
      SELECT c.id, c.parent_run_id, c.parent_step_id, c.job_id, c.state, t.depth + 1, left(c.result::text, 120)
      FROM tree t JOIN job_queue c ON c.parent_run_id = t.id
      WHERE t.depth < %(depth)s                         -- no deeper than asked
    )
    -- evaluated as it is read: the LIMIT stops the walk, however large the canvas
    SELECT id, parent_run_id, parent_step_id AS step_id, job_id, state, depth, result FROM tree LIMIT %(limit)s
    """,
)

CHILD_STATES = Statement(
    "child_states",
    "How many runs a run started, by state (a canvas's progress: 9,500 of 10,000 members succeeded).",
    """
    SELECT state, count(*) AS n FROM job_queue
    WHERE parent_run_id = %(id)s                        -- its children (uq_job_queue_parent_run_id_parent_step_id)
    GROUP BY state
    """,
)


def run_tree(conn: Conn, run_id: uuid.UUID, *, depth: int, limit: int) -> list[dict[str, Any]]:
    return rows(conn, RUN_TREE, {"id": run_id, "depth": depth, "limit": limit})


def child_states(conn: Conn, run_id: uuid.UUID) -> dict[str, int]:
    return {r["state"]: int(r["n"]) for r in rows(conn, CHILD_STATES, {"id": run_id})}


RUN_RESUMES = Statement(
    "run_resumes",
    "The DLQ entries closed by resuming a run, newest first.",
    f"""
    SELECT {_DLQ_COLUMNS} FROM job_run_dlq d
    WHERE d.resumed_run_id = %(id)s      -- ix_job_run_dlq_resumed_run
    ORDER BY d.resumed_at DESC
    """,
)


def run_resumes(conn: Conn, run_id: uuid.UUID) -> list[dict[str, Any]]:
    return rows(conn, RUN_RESUMES, {"id": run_id})


# --- events ----------------------------------------------------------------------------------

LIST_EVENTS = Statement(
    "list_events",
    "The newest events the caller sees, narrowed by name, workspace and one payload field's text (each optional).",
    """
    SELECT e.id, e.name, e.workspace_id, e.idempotency_key, e.received_at, e.data FROM job_event e
    WHERE (CAST(%(name)s AS text) IS NULL OR e.name = %(name)s)                          -- name
      AND (CAST(%(workspace)s AS text) IS NULL OR e.workspace_id = %(workspace)s)        -- an admin's workspace
      AND (CAST(%(path)s AS text[]) IS NULL                                              -- field=value: the field's
           OR e.data #>> CAST(%(path)s AS text[]) = %(value)s)                           -- text at that path
    ORDER BY e.received_at DESC, e.id       -- newest first; the id breaks ties stably
    LIMIT %(limit)s
    """,
    prepare=False,   # optional predicates: planned for each call's filters (driver.Statement)
)


def list_events(conn: Conn, *, name: str | None, workspace: str | None, path: list[str] | None,
                value: str, limit: int) -> list[dict[str, Any]]:
    return rows(conn, LIST_EVENTS, {"name": name, "workspace": workspace, "path": path, "value": value,
                                    "limit": limit})


EVENT_RUNS = Statement(
    "event_runs",
    "The runs some events made, oldest first.",
    """
    SELECT event_id, id, job_id, state FROM job_queue
    WHERE event_id = ANY(%(ids)s)           -- uq (event_id, job_id), event_id leading
    ORDER BY created_at
    """,
)


def event_runs(conn: Conn, event_ids: Sequence[uuid.UUID]) -> list[dict[str, Any]]:
    return rows(conn, EVENT_RUNS, {"ids": list(event_ids)})


# --- the DLQ ---------------------------------------------------------------------------------

LIST_DLQ = Statement(
    "list_dlq",
    "The newest DLQ entries the caller sees: open ones only unless asked, narrowed by job and workspace.",
    f"""
    SELECT {_DLQ_COLUMNS} FROM job_run_dlq d
    WHERE (CAST(%(include_closed)s AS boolean)                                        -- --all
           OR (d.replayed_at IS NULL AND d.dismissed_at IS NULL AND d.resumed_at IS NULL))   -- else open only
      AND (CAST(%(job)s AS text) IS NULL OR d.function_id = %(job)s)                  -- --job
      AND (CAST(%(workspace)s AS text) IS NULL OR d.workspace_id = %(workspace)s)     -- an admin's --workspace
    ORDER BY d.last_failed_at DESC, d.id    -- newest failure first
    LIMIT %(limit)s
    """,
    prepare=False,   # optional predicates: planned for each call's filters (driver.Statement)
)


def list_dlq(conn: Conn, *, include_closed: bool, job: str | None, workspace: str | None,
             limit: int) -> list[dict[str, Any]]:
    return rows(conn, LIST_DLQ, {"include_closed": include_closed, "job": job, "workspace": workspace,
                                 "limit": limit})


DLQ_ENTRY = Statement(
    "dlq_entry",
    "One DLQ entry the caller sees, every column.",
    f"SELECT {_DLQ_COLUMNS} FROM job_run_dlq d WHERE d.id = %(id)s",
)


def dlq_entry(conn: Conn, dlq_id: uuid.UUID) -> dict[str, Any] | None:
    return first(conn, DLQ_ENTRY, {"id": dlq_id})


# --- queue health (the dashboard's, /metrics', the CLI's) ------------------------------------------

QUEUE_DEPTH = Statement(
    "queue_depth",
    "How many runs each job has in each state.",
    "SELECT job_id, state, count(*) AS n FROM job_queue GROUP BY job_id, state",
)


def queue_depth(conn: Conn) -> list[dict[str, Any]]:
    return rows(conn, QUEUE_DEPTH, {})


OLDEST_DUE = Statement(
    "oldest_due",
    "Per job, how many seconds its oldest due queued run has waited past its run_at.",
    """
    SELECT job_id, extract(epoch FROM now() - min(run_at)) AS age FROM job_queue
    WHERE state = 'queued' AND run_at <= now()   -- due: the rows ix_job_queue_due indexes
    GROUP BY job_id
    """,
)


def oldest_due(conn: Conn) -> dict[str, float]:
    return {r["job_id"]: float(r["age"]) for r in rows(conn, OLDEST_DUE, {})}


EXPIRED_LEASES = Statement(
    "expired_leases",
    "Per job, the running runs whose lease expired and that no sweeper has reclaimed yet.",
    """
    SELECT job_id, count(*) AS n FROM job_queue
    WHERE state = 'running' AND lease_expires_at < now()   -- ix_job_queue_leases
    GROUP BY job_id
    """,
)


def expired_leases(conn: Conn) -> dict[str, int]:
    return {r["job_id"]: int(r["n"]) for r in rows(conn, EXPIRED_LEASES, {})}


DLQ_OPEN = Statement(
    "dlq_open",
    "How many DLQ entries are open (neither replayed, dismissed nor resumed).",
    "SELECT count(*) AS n FROM job_run_dlq WHERE replayed_at IS NULL AND dismissed_at IS NULL AND resumed_at IS NULL",
)


def dlq_open(conn: Conn) -> int:
    row = first(conn, DLQ_OPEN, {})
    assert row is not None
    return int(row["n"])


# --- /metrics: what happened in the window ---------------------------------------------------------

DLQ_BY_JOB = Statement(
    "dlq_by_job",
    "Per job, the open DLQ entries and those replayed within the window (of one workspace, or every one the caller sees).",
    """
    SELECT function_id AS job_id,
           count(*) FILTER (WHERE replayed_at IS NULL AND dismissed_at IS NULL AND resumed_at IS NULL) AS open,
           count(*) FILTER (WHERE replayed_at >= now() - make_interval(secs => %(window)s)) AS replays
    FROM job_run_dlq
    -- an admin's --workspace / ?workspace=: that workspace's entries only, as the runs it is shown with
    WHERE (CAST(%(workspace)s AS text) IS NULL OR workspace_id = %(workspace)s)
    GROUP BY function_id
    """,
    prepare=False,   # an optional predicate: planned for each call's filter (driver.Statement)
)


def dlq_by_job(conn: Conn, *, window: float, workspace: str | None = None) -> list[dict[str, Any]]:
    return rows(conn, DLQ_BY_JOB, {"window": window, "workspace": workspace})


RUNS_RECENT = Statement(
    "runs_recent",
    "Per job and final state, the runs that finished within the window and their created-to-finished quantiles.",
    """
    SELECT job_id, state, count(*) AS n,
           percentile_cont(CAST(%(q)s AS float8[])) WITHIN GROUP
             (ORDER BY extract(epoch FROM finished_at - created_at)) AS quantiles
    FROM job_queue
    WHERE finished_at >= now() - make_interval(secs => %(window)s)   -- ix_job_queue_finished
    GROUP BY job_id, state
    """,
)


def runs_recent(conn: Conn, *, window: float, quantiles: Sequence[float]) -> list[dict[str, Any]]:
    return rows(conn, RUNS_RECENT, {"window": window, "q": list(quantiles)})


ATTEMPTS_RECENT = Statement(
    "attempts_recent",
    "Per job and outcome, the attempts that ended within the window.",
    """
    SELECT job_id, outcome, count(*) AS n FROM job_run
    WHERE finished_at >= now() - make_interval(secs => %(window)s)
    GROUP BY job_id, outcome
    """,
)


def attempts_recent(conn: Conn, *, window: float) -> list[dict[str, Any]]:
    return rows(conn, ATTEMPTS_RECENT, {"window": window})


STEPS_RECENT = Statement(
    "steps_recent",
    "Per job, the step bodies stored within the window and their duration quantiles.",
    """
    SELECT q.job_id, count(*) AS n,
           percentile_cont(CAST(%(q)s AS float8[])) WITHIN GROUP
             (ORDER BY extract(epoch FROM s.completed_at - s.started_at)) AS quantiles
    FROM job_step s JOIN job_queue q ON q.id = s.run_id
    WHERE s.completed_at >= now() - make_interval(secs => %(window)s)
    GROUP BY q.job_id
    """,
)


def steps_recent(conn: Conn, *, window: float, quantiles: Sequence[float]) -> list[dict[str, Any]]:
    return rows(conn, STEPS_RECENT, {"window": window, "q": list(quantiles)})


# --- motir doctor (as the engine login, and as each login it checks) --------------------------------

QUEUED_BY_JOB = Statement(
    "queued_by_job",
    "Per job, how many runs are queued (doctor names the Celery queues nobody consumes).",
    "SELECT job_id, count(*) AS n FROM job_queue WHERE state = 'queued' GROUP BY job_id",
)


def queued_by_job(conn: Conn) -> dict[str, int]:
    return {r["job_id"]: int(r["n"]) for r in rows(conn, QUEUED_BY_JOB, {})}


SWEEPER_OVERDUE = Statement(
    "sweeper_overdue",
    "What a sweeper would have fixed by now: leases expired, and due runs unpublished, for longer than a grace.",
    """
    SELECT
      (SELECT count(*) FROM job_queue WHERE state = 'running'
         AND lease_expires_at < now() - make_interval(secs => %(grace)s)) AS stale_leases,   -- not reclaimed
      (SELECT count(*) FROM job_queue WHERE state = 'queued' AND run_at <= now()             -- due, and its
         AND dispatched_at < now() - make_interval(secs => %(republish)s + %(grace)s))       -- message not
        AS unpublished                                                                       -- sent again
    """,
)


def sweeper_overdue(conn: Conn, *, grace: float, republish_after: float) -> dict[str, Any]:
    row = first(conn, SWEEPER_OVERDUE, {"grace": grace, "republish": republish_after})
    assert row is not None
    return row


QUEUE_SUMMARY = Statement(
    "queue_summary",
    "Queued, due and running runs, how long the oldest due run has waited, and its job.",
    """
    SELECT count(*) FILTER (WHERE state = 'queued') AS queued,
           count(*) FILTER (WHERE state = 'queued' AND run_at <= now()) AS due,
           count(*) FILTER (WHERE state = 'running') AS running,
           extract(epoch FROM now() - min(run_at) FILTER (WHERE state = 'queued' AND run_at <= now())) AS oldest,
           -- which job waits longest: a job no worker imports is the usual culprit
           (SELECT job_id FROM job_queue WHERE state = 'queued' AND run_at <= now()
            ORDER BY run_at LIMIT 1) AS oldest_job
    FROM job_queue WHERE state IN ('queued', 'running')   -- the live rows (partial indexes)
    """,
)


def queue_summary(conn: Conn) -> dict[str, Any]:
    row = first(conn, QUEUE_SUMMARY, {})
    assert row is not None
    return row


RLS_PROBE = Statement(
    "rls_probe",
    "Who the current login reads as, whether row-level security applies to it, and whether its role bypasses it.",
    """
    SELECT current_user AS who, row_security_active('job_queue') AS active,
           (SELECT rolsuper OR rolbypassrls FROM pg_roles WHERE rolname = current_user) AS bypass
    """,
)


def rls_probe(conn: Conn) -> dict[str, Any]:
    row = first(conn, RLS_PROBE, {})
    assert row is not None
    return row


# Roles the login may become (RESET ROLE, SET ROLE) that would not be bound by the app
# policy: superusers, BYPASSRLS, the tables' owner, the engine (its policy admits all),
# and the admin role (for which motir.system_admin opens every workspace).
LOGIN_ESCAPES = Statement(
    "login_escapes",
    "The session's login and every role it may become that row-level security would not bind as the app role.",
    """
    SELECT session_user AS login, coalesce(array_agg(r.rolname || CASE
             WHEN r.rolsuper THEN ' (superuser)' WHEN r.rolbypassrls THEN ' (BYPASSRLS)'
             WHEN r.oid = (SELECT relowner FROM pg_class WHERE oid = 'job_queue'::regclass) THEN ' (owner)'
             WHEN r.rolname = %(engine)s THEN ' (engine policy: every row)'
             ELSE ' (admin: motir.system_admin counts)' END ORDER BY r.rolname)
           FILTER (WHERE r.oid IS NOT NULL), '{}') AS exits
    FROM (SELECT 1) AS one
    LEFT JOIN pg_roles r ON pg_has_role(session_user, r.oid, 'MEMBER')      -- roles it is, or may SET ROLE to
      AND (r.rolsuper OR r.rolbypassrls                                     -- RLS never binds these
           OR r.rolname IN (%(engine)s, %(admin)s)                          -- policies that see every workspace
           OR r.oid = (SELECT relowner FROM pg_class WHERE oid = 'job_queue'::regclass))   -- the owner
    """,
)


def login_escapes(conn: Conn, *, engine_role: str, admin_role: str) -> tuple[str, list[str]]:
    row = first(conn, LOGIN_ESCAPES, {"engine": engine_role, "admin": admin_role})
    assert row is not None
    return row["login"], list(row["exits"])


# --- insights: the stats rollup, flaky and slow runs, flow control's waits (ops/insights.py) -----
#
# The rollup (job_stats_rollup, core/worker/rollup.py) has one row per (job, workspace, 5-minute
# bucket) and one per (job, workspace) with bucket NULL (all time); the policies show a caller the
# rows of its workspace(s), and these sum them per job. A histogram (duration_buckets) is summed
# element by element (unnest WITH ORDINALITY).

INSIGHTS_WINDOW = Statement(
    "insights_window",
    "Per job, the rollup's counts, duration sums and histogram over the buckets since an instant (job, workspace optional).",
    """
    WITH b AS (
      SELECT * FROM job_stats_rollup
      WHERE bucket >= %(since)s                                              -- ix_job_stats_rollup_bucket
        AND (CAST(%(job)s AS text) IS NULL OR job_id = %(job)s)
        AND (CAST(%(workspace)s AS text) IS NULL OR workspace_id = %(workspace)s)   -- an admin's narrowing
    ), h AS (
      SELECT b.job_id, u.i, sum(u.n) AS n FROM b, unnest(b.duration_buckets) WITH ORDINALITY AS u(n, i)
      GROUP BY b.job_id, u.i
    )
    SELECT s.*, (SELECT array_agg(h.n ORDER BY h.i) FROM h WHERE h.job_id = s.job_id) AS histogram
    FROM (SELECT job_id, sum(succeeded_count) AS succeeded, sum(failed_count) AS failed,
                 sum(cancelled_count) AS cancelled, sum(retried_count) AS retried, sum(attempts_count) AS attempts,
                 sum(sum_duration_ms) AS sum_ms, sum(duration_samples) AS samples, max(updated_at) AS updated_at
          FROM b GROUP BY job_id) s
    ORDER BY s.job_id
    """,
    prepare=False,
)


def insights_window(conn: Conn, *, since: datetime, job: str | None = None,
                    workspace: str | None = None) -> list[dict[str, Any]]:
    return rows(conn, INSIGHTS_WINDOW, {"since": since, "job": job, "workspace": workspace})


INSIGHTS_SERIES = Statement(
    "insights_series",
    "Per job and step of time since an instant, the rollup's runs by outcome and retried runs (the insights' charts).",
    """
    SELECT job_id, date_bin(make_interval(secs => %(step)s), bucket, TIMESTAMPTZ '2000-01-01 00:00:00+00') AS at,
           sum(succeeded_count) AS succeeded, sum(failed_count) AS failed, sum(cancelled_count) AS cancelled,
           sum(retried_count) AS retried
    FROM job_stats_rollup
    WHERE bucket >= %(since)s                                                -- ix_job_stats_rollup_bucket
      AND (CAST(%(job)s AS text) IS NULL OR job_id = %(job)s)
      AND (CAST(%(workspace)s AS text) IS NULL OR workspace_id = %(workspace)s)
    GROUP BY job_id, at
    ORDER BY job_id, at
    """,
    prepare=False,
)


def insights_series(conn: Conn, *, since: datetime, step: float, job: str | None = None,
                    workspace: str | None = None) -> list[dict[str, Any]]:
    return rows(conn, INSIGHTS_SERIES, {"since": since, "step": step, "job": job, "workspace": workspace})


STATS_TOTALS = Statement(
    "stats_totals",
    "Per job (and workspace, when asked), every run ever folded: counts, duration sums, histogram (/metrics' counters).",
    """
    WITH b AS (
      SELECT *, CASE WHEN %(by_workspace)s THEN workspace_id END AS ws
      FROM job_stats_rollup
      WHERE bucket IS NULL                                                  -- the totals rows (ix_job_stats_rollup_bucket)
    ), h AS (
      SELECT b.job_id, b.ws, u.i, sum(u.n) AS n FROM b, unnest(b.duration_buckets) WITH ORDINALITY AS u(n, i)
      GROUP BY b.job_id, b.ws, u.i
    )
    SELECT s.*, (SELECT array_agg(h.n ORDER BY h.i) FROM h
                 WHERE h.job_id = s.job_id AND h.ws IS NOT DISTINCT FROM s.workspace_id) AS histogram
    FROM (SELECT job_id, ws AS workspace_id, sum(succeeded_count) AS succeeded, sum(failed_count) AS failed,
                 sum(cancelled_count) AS cancelled, sum(retried_count) AS retried, sum(attempts_count) AS attempts,
                 sum(sum_duration_ms) AS sum_ms, sum(duration_samples) AS samples
          FROM b GROUP BY job_id, ws) s
    ORDER BY s.job_id, s.workspace_id
    """,
)


def stats_totals(conn: Conn, *, by_workspace: bool = False) -> list[dict[str, Any]]:
    return rows(conn, STATS_TOTALS, {"by_workspace": by_workspace})


FLAKY_RUNS = Statement(
    "flaky_runs",
    "The newest runs since an instant that needed more than one attempt (job optional): show me flaky runs.",
    """
    SELECT q.id, q.job_id, q.workspace_id, q.state, q.attempts, q.max_attempts, q.created_at, q.finished_at
    FROM job_queue q
    WHERE q.attempts > 1                                    -- ix_job_queue_flaky: only retried runs are in it
      AND q.created_at >= %(since)s                         -- the window, newest first along the index
      AND (CAST(%(job)s AS text) IS NULL OR q.job_id = %(job)s)
    ORDER BY q.created_at DESC
    LIMIT %(limit)s
    """,
    prepare=False,
)


def flaky_runs(conn: Conn, *, since: datetime, job: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
    return rows(conn, FLAKY_RUNS, {"since": since, "job": job, "limit": limit})


SLOWEST_RUNS = Statement(
    "slowest_runs",
    "A job's slowest successful runs that finished since an instant: first attempt's start to finish.",
    """
    SELECT q.id, q.workspace_id, q.attempts, q.finished_at,
           extract(epoch FROM q.finished_at - s.started_at) AS seconds
    FROM job_queue q
    CROSS JOIN LATERAL (SELECT min(r.started_at) AS started_at FROM job_run r
                        WHERE r.run_id = q.id) AS s                 -- its ledger (ix_job_run_ledger)
    WHERE q.state = 'succeeded'                                     -- ix_job_queue_succeeded: succeeded runs only,
      AND q.job_id = %(job)s                                        -- of this job,
      AND q.finished_at >= %(since)s                                -- by finish
    ORDER BY seconds DESC NULLS LAST
    LIMIT %(limit)s
    """,
)


def slowest_runs(conn: Conn, *, job: str, since: datetime, limit: int = 10) -> list[dict[str, Any]]:
    return rows(conn, SLOWEST_RUNS, {"job": job, "since": since, "limit": limit})


FLOW_WAITING = Statement(
    "flow_waiting",
    "Per job and reason (throttle, debounce, batch), the queued runs waiting on flow control and the soonest due.",
    """
    SELECT job_id, flow_wait, count(*) AS n, min(run_at) AS next_at, sum(coalesce(gathered, 0)) AS gathered
    FROM job_queue
    WHERE flow_wait = 'throttle' AND (state = 'queued') IS TRUE               -- ix_job_queue_throttle_queued
    GROUP BY job_id, flow_wait
    UNION ALL
    SELECT job_id, flow_wait, count(*), min(run_at), sum(coalesce(gathered, 0))
    FROM job_queue
    WHERE flow_wait IN ('debounce', 'batch') AND (state = 'queued') IS TRUE   -- uq_job_queue_gathering_open
    GROUP BY job_id, flow_wait
    ORDER BY job_id, flow_wait
    """,
)


def flow_waiting(conn: Conn) -> list[dict[str, Any]]:
    return rows(conn, FLOW_WAITING, {})


RUN_FLOW = Statement(
    "run_flow",
    "Why one run waits on flow control: its reason, key, gathering, throttle start, and the runs of its key ahead of it.",
    """
    SELECT q.flow_wait, q.flow_key, q.flow_since, q.gathered, q.throttle_key, q.throttle_at, q.run_at,
           (SELECT count(*) FROM job_queue w                        -- ix_job_queue_throttle_queued
            WHERE q.flow_wait = 'throttle'
              AND w.job_id = q.job_id AND w.throttle_key = q.throttle_key
              AND w.flow_wait = 'throttle' AND (w.state = 'queued') IS TRUE AND w.id <> q.id
              AND (q.throttle_key = '' OR w.workspace_id IS NOT DISTINCT FROM q.workspace_id)
              AND (w.priority > q.priority
                   OR (w.priority = q.priority AND (w.created_at, w.id) < (q.created_at, q.id)))) AS ahead
    FROM job_queue q
    WHERE q.id = %(run_id)s
      AND (q.flow_wait IS NOT NULL OR q.flow_key IS NOT NULL OR q.throttle_key IS NOT NULL)   -- a flow job's run
    """,
)


def run_flow(conn: Conn, run_id: uuid.UUID) -> dict[str, Any] | None:
    return first(conn, RUN_FLOW, {"run_id": run_id})


# --- progress and streams (core/producer/streams.py, the dashboard, `motir runs show`) ----------
#
# Read under the caller's row-level security like every read here, and naming the workspace as
# the result handle's read does (producer.RUN_RESULT): a reader through the engine login (system
# runs) finds no tenant's run, and under the app role another workspace's run is not found.

RUN_PROGRESS = Statement(
    "run_progress",
    "A run's state, steps stored, latest progress (state, meta, attempt) and its streams' names and totals, in one workspace.",
    """
    SELECT q.id, q.state AS run_state, q.attempts, p.state, p.meta, p.attempt, p.updated_at,
           coalesce(p.streams, '{}') AS streams, coalesce(p.stream_items, 0) AS stream_items,
           coalesce(p.stream_bytes, 0) AS stream_bytes,
           (SELECT count(*) FROM job_step s WHERE s.run_id = q.id) AS steps   -- its primary key's prefix
    FROM job_queue q
    LEFT JOIN job_progress p ON p.run_id = q.id                -- its primary key
    WHERE q.id = %(run_id)s
      AND q.workspace_id IS NOT DISTINCT FROM %(workspace_id)s   -- another workspace's run is not found
    """,
)


def run_progress(conn: Conn, run_id: uuid.UUID, workspace_id: str | None) -> dict[str, Any] | None:
    return first(conn, RUN_PROGRESS, {"run_id": run_id, "workspace_id": workspace_id})


ACTIVE_FOR_SUBJECT = Statement(
    "active_for_subject",
    "The open (queued, sleeping, waiting, running) runs of one subject in one workspace: is one already active for it.",
    """
    SELECT id, job_id, state, run_at, wait_event, created_at
    FROM job_queue
    WHERE subject_type = %(subject_type)s AND subject_id = %(subject_id)s   -- the subject (ix_job_queue_subject_open)
      AND workspace_id IS NOT DISTINCT FROM %(workspace_id)s   -- this workspace's (None: the system's); RLS agrees
      AND state IN ('queued', 'running')                       -- open: a finished run is history (and not indexed)
    ORDER BY created_at, id
    LIMIT %(limit)s
    """,
)


def active_for_subject(conn: Conn, subject_type: str, subject_id: str, workspace_id: str | None,
                       limit: int) -> list[dict[str, Any]]:
    return rows(conn, ACTIVE_FOR_SUBJECT, {"subject_type": subject_type, "subject_id": subject_id,
                                           "workspace_id": workspace_id, "limit": limit})


STREAM_ITEMS = Statement(
    "stream_items",
    "Items of one stream of a run after a position (or from an offset), in order, with the run's state in the same snapshot.",
    """
    SELECT q.state AS run_state, i.position, i.item, i.attempt
    FROM job_queue q
    LEFT JOIN LATERAL (
      SELECT s.position, s.item, s.attempt FROM job_stream_item s
      WHERE s.run_id = q.id AND s.stream = %(stream)s     -- the primary key, in its order
        AND s.position > %(after)s                        -- past the reader's cursor
      ORDER BY s.position
      LIMIT %(limit)s OFFSET %(offset)s
    ) i ON true
    WHERE q.id = %(run_id)s
      AND q.workspace_id IS NOT DISTINCT FROM %(workspace_id)s   -- another workspace's run is not found
    ORDER BY i.position
    """,
)


def stream_items(conn: Conn, run_id: uuid.UUID, workspace_id: str | None, stream: str, *, after: int,
                 offset: int, limit: int) -> tuple[str | None, list[dict[str, Any]]]:
    """(the run's state, its items after ``after``); (None, []) when the run is not found (or not
    visible). One statement: a reader that finds the run finished and no item past its cursor has
    read every item (the settle commits after the last write)."""
    found = rows(conn, STREAM_ITEMS, {"run_id": run_id, "workspace_id": workspace_id, "stream": stream,
                                      "after": after, "offset": offset, "limit": limit})
    if not found:
        return None, []
    return found[0]["run_state"], [r for r in found if r["position"] is not None]


STREAM_COUNTS = Statement(
    "stream_counts",
    "Each stream of a run: how many items it holds and its last position (`motir runs show`, the run page).",
    """
    SELECT s.stream, count(*) AS items, max(s.position) AS last
    FROM job_stream_item s
    WHERE s.run_id = %(run_id)s                -- the primary key's prefix
    GROUP BY s.stream ORDER BY s.stream
    """,
)


def stream_counts(conn: Conn, run_id: uuid.UUID) -> list[dict[str, Any]]:
    return rows(conn, STREAM_COUNTS, {"run_id": run_id})


LISTEN_RUN = Statement(
    "listen_run",
    "A follower's LISTEN on one run's channel (motir_listen: the name derived from the run id).",
    "SELECT motir_listen(%(run_id)s) AS listening",
    prepare=False,  # once per follower and run, on the listener's own connection
)

UNLISTEN_RUN = Statement(
    "unlisten_run",
    "A follower's UNLISTEN of one run's channel, once nobody follows it in this process.",
    "SELECT motir_unlisten(%(run_id)s) AS listening",
    prepare=False,
)


def listen_run(conn: Conn, run_id: uuid.UUID, *, listen: bool) -> None:
    rows(conn, LISTEN_RUN if listen else UNLISTEN_RUN, {"run_id": run_id})


# --- admission: a workspace's own quota (core/admission.py) -------------------------------------

QUOTA_STATUS = Statement(
    "quota_status",
    "A workspace's own weight and cap, its runs in flight and held: what its tenant sees (RLS decides which rows).",
    """
    SELECT (SELECT weight FROM job_quota                     -- uq_job_quota_workspace; none: weight 1
            WHERE coalesce(workspace_id, '') = coalesce(%(workspace_id)s, '')) AS weight,
           (SELECT max_running FROM job_quota                -- none: no cap
            WHERE coalesce(workspace_id, '') = coalesce(%(workspace_id)s, '')) AS max_running,
           (SELECT count(*) FROM job_queue r                 -- ix_job_queue_in_flight
            WHERE coalesce(r.workspace_id, '') = coalesce(%(workspace_id)s, '')
              AND (r.state IN ('queued', 'running')) IS TRUE AND r.dispatched_at <= now()) AS in_flight,
           (SELECT count(*) FROM job_queue r                 -- the running ones among them
            WHERE coalesce(r.workspace_id, '') = coalesce(%(workspace_id)s, '')
              AND (r.state IN ('queued', 'running')) IS TRUE AND r.state = 'running'
              AND r.dispatched_at <= now()) AS running,
           (SELECT count(*) FROM job_queue h                 -- ix_job_queue_held: waiting for their turn
            WHERE coalesce(h.workspace_id, '') = coalesce(%(workspace_id)s, '')
              AND h.dispatched_at = 'infinity'::timestamptz AND (h.state = 'queued') IS TRUE) AS held
    """,
)


def quota_status(conn: Conn, workspace_id: str | None) -> dict[str, Any]:
    """The workspace's quota and load; on a tenant's session, RLS shows only its own rows."""
    row = first(conn, QUOTA_STATUS, {"workspace_id": workspace_id})
    assert row is not None
    return row
