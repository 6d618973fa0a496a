"""a tenant's life: the registry of jobs the checked functions check, their new guards, listing indexes (expand)

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-20 10:00:00.000000

Issue 47. Expand only.

* ``job_registry``: one row per job a worker of the fleet defines — its id, its kind (``direct``,
  ``event``, ``cron``) and, for an event job, the events it subscribes to. Every worker writes
  its jobs at start-up (an upsert: the table is the union of the fleet's jobs; core/registry.py).
  No tenant rows (no ``workspace_id``, so no policy): the engine role reads and writes it, the
  app role holds nothing on it (the checked functions read it with their owner's rights).
* The app role's checked functions (0008) get five guards, each one line tagged ``-- guard:``
  as before (tests/store/test_isolation.py removes each in turn):
  ``job_kind`` — the job is registered and of the right kind: a direct job for
  ``motir_enqueue_direct``; for ``motir_enqueue_event(s)`` an event job that subscribes to the
  event's name (a cron job runs only through its beat slot, which the engine role writes);
  ``direct_event`` — a direct run's event is named after its job (``direct.<job id>``), not an
  event of another job or a child's (``motir.invoke:``);
  ``payload_bounds`` — the data is at most 1,500,000 characters as Postgres prints it (the Python
  producer's 1,000,000 of compact JSON print in at most 1.5 times that: a space after each ``,``
  and ``:``) and no value lies deeper than 100 levels below the top (the worker decodes it with
  Python's ``json``, whose recursion limit is about 1,000);
  ``traceparent`` — NULL, or W3C trace context: ``version-trace_id-parent_id-flags`` in lowercase
  hex, version ``ff`` and all-zero ids refused, at most 256 characters;
  ``delay_bounds`` (replaced) — countdown 0 to a year, and an eta within a year either side of
  the database's now() (44 BC, ``infinity``: refused).
  Bodies only (CREATE OR REPLACE): the signatures, results, owner's rights, ``search_path`` and
  grants stay.
* ``job_queue.cancelled_by`` / ``cancel_reason``: who cancelled a run, and why, when it was cancelled
  by an operator's offboarding (``motir cancel --workspace``; the instant is its ``finished_at``).
  Nullable, no default: a metadata-only ALTER; the previous release never names them.
* ``ix_job_queue_recent`` ``(created_at DESC, id)`` and ``ix_job_queue_workspace_recent``
  ``(workspace_id, created_at DESC, id)``: the operator's listing (``motir runs``, the dashboard)
  and one tenant's, newest first, read from the index in the listing's order instead of a sort of
  the whole table (tests/store/test_schema.py's EXPLAIN tests). Built ``CONCURRENTLY``.

Rolling deploy: the previous release never names ``job_registry`` or the new indexes, and its
statements are unchanged. Its producers that log in as the app role call the same functions with
the same arguments; what they send is within every new bound (the Python producer's limits), and
the job check holds **only once the registry has a row**: until the first worker of this release
has started, the functions accept any job id as before, so producers of the previous release
keep working while its workers are replaced (none of them writes the registry). From then on a
job is known to the functions once any worker that defines it has started: roll the workers
before the producers that send a new job (as with Celery, where a task unknown to the worker is
refused). Downgrade puts 0008's bodies back and drops the indexes and the table.
"""
from alembic import context, op
from sqlalchemy import text

revision = '0020'
down_revision = '0019'
branch_labels = None
depends_on = None

TABLE = """
CREATE TABLE job_registry (
  job_id text NOT NULL,
  kind text NOT NULL,
  events text[] NOT NULL DEFAULT '{}',
  registered_at timestamptz NOT NULL DEFAULT now(),
  registered_by text,
  CONSTRAINT pk_job_registry PRIMARY KEY (job_id),
  CONSTRAINT ck_job_registry_kind CHECK (kind IN ('direct', 'event', 'cron'))
)
"""

QUEUE_INDEXES = {
    "ix_job_queue_recent": "CREATE INDEX CONCURRENTLY ix_job_queue_recent ON job_queue (created_at DESC, id)",
    "ix_job_queue_workspace_recent": "CREATE INDEX CONCURRENTLY ix_job_queue_workspace_recent ON job_queue "
                                     "(workspace_id, created_at DESC, id)",
}

# The guards every checked function gains. "The registry has a row" is the rolling deploy's rule
# (the module docstring): an empty registry checks no job id.
_REGISTERED = "EXISTS (SELECT 1 FROM job_registry)"
_DATA_BOUNDS = ("octet_length({data}::text) > 1500000 "
                "OR jsonb_path_exists({data}, 'strict $.**{{101 to last}}')")
_TRACEPARENT = (
    "IF p_traceparent IS NOT NULL AND (length(p_traceparent) > 256 OR p_traceparent !~ "
    "'^([0-9a-e][0-9a-f]|f[0-9a-e])-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}(-[!-~]*)?$' "
    "OR p_traceparent ~ '^00-.{53}.') THEN RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = "
    "'motir: a traceparent is W3C trace context (version-trace_id-parent_id-flags, lowercase hex, "
    "ids not all zero), at most 256 characters'; END IF;  -- guard: traceparent")
_PAYLOAD_MESSAGE = ("at most 1,500,000 characters as Postgres prints it and no value deeper than 100 levels "
                    "below the top")

DIRECT_GUARDS = f"""
  IF {_REGISTERED} AND NOT EXISTS (SELECT 1 FROM job_registry r WHERE r.job_id = p_job_id AND r.kind = 'direct') THEN RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('motir: %L is not a direct job of this deployment (a job id names a job a worker registered; an event job runs through its event, a cron job through its beat slot)', p_job_id); END IF;  -- guard: job_kind
  IF p_name IS DISTINCT FROM 'direct.' || p_job_id THEN RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('motir: a direct run of %L is made by the event %L, not %L', p_job_id, 'direct.' || p_job_id, p_name); END IF;  -- guard: direct_event
  IF {_DATA_BOUNDS.format(data='p_data')} THEN RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'motir: a run''s arguments are {_PAYLOAD_MESSAGE}'; END IF;  -- guard: payload_bounds
  {_TRACEPARENT}
"""

EVENT_GUARDS = f"""
  IF {_REGISTERED} AND EXISTS (SELECT 1 FROM unnest(p_job_ids) AS j WHERE NOT EXISTS (SELECT 1 FROM job_registry r WHERE r.job_id = j AND r.kind = 'event' AND p_name = ANY (r.events))) THEN RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('motir: a run of a job that is not an event job of this deployment subscribing to %L (a job id names a job a worker registered)', p_name); END IF;  -- guard: job_kind
  IF {_DATA_BOUNDS.format(data='p_data')} THEN RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'motir: event data is {_PAYLOAD_MESSAGE}'; END IF;  -- guard: payload_bounds
  {_TRACEPARENT}
"""

EVENTS_GUARDS = f"""
  IF {_REGISTERED} AND EXISTS (SELECT 1 FROM unnest(p_run_events, p_job_ids) AS s(i, j) WHERE NOT EXISTS (SELECT 1 FROM job_registry r WHERE r.job_id = s.j AND r.kind = 'event' AND p_names[s.i] = ANY (r.events))) THEN RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'motir: a run of a job that is not an event job of this deployment subscribing to its event (a job id names a job a worker registered)'; END IF;  -- guard: job_kind
  IF EXISTS (SELECT 1 FROM unnest(p_datas) AS d WHERE {_DATA_BOUNDS.format(data='d')}) THEN RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'motir: each event''s data is {_PAYLOAD_MESSAGE}'; END IF;  -- guard: payload_bounds
  {_TRACEPARENT}
"""

#: 0008's delay guard, and what it becomes: bounded both ways.
DELAY_BEFORE = ("  IF p_countdown IS NULL OR p_countdown NOT BETWEEN 0 AND 31536000 OR p_eta > now() + interval "
                "'366 days' THEN RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'motir: a run is due within a "
                "year'; END IF;  -- guard: delay_bounds")
DELAY_AFTER = ("  IF p_countdown IS NULL OR p_countdown NOT BETWEEN 0 AND 31536000 OR p_eta NOT BETWEEN now() - "
               "interval '366 days' AND now() + interval '366 days' THEN RAISE EXCEPTION USING ERRCODE = '22023', "
               "MESSAGE = 'motir: a run is due within a year, and an eta is within a year of now'; END IF;  "
               "-- guard: delay_bounds")

#: 0008's constant -> the guards inserted before its call of the writer
GUARDS = {"ENQUEUE_DIRECT": DIRECT_GUARDS, "ENQUEUE_EVENT": EVENT_GUARDS, "ENQUEUE_EVENTS": EVENTS_GUARDS}
#: Where they go: the writer's call, once in each body.
CALL = "  RETURN QUERY SELECT * FROM motir_write_"


def _body(name: str, forward: bool) -> str:
    """0008's checked function (frozen there), as a replacement in place; with this revision's guards."""
    sql = str(getattr(context.script.get_revision("0008").module, name))
    sql = sql.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
    if not forward:
        return sql
    assert sql.count(CALL) == 1, f"0008.{name}: the writer's call is not there once"
    sql = sql.replace(CALL, GUARDS[name].strip("\n") + "\n" + CALL)
    if name == "ENQUEUE_DIRECT":
        assert sql.count(DELAY_BEFORE) == 1, "0008.ENQUEUE_DIRECT: the delay guard is not there once"
        sql = sql.replace(DELAY_BEFORE, DELAY_AFTER)
    return sql


def _functions(forward: bool) -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    for name in GUARDS:
        op.execute(_body(name, forward).replace("{schema}", schema))


def upgrade() -> None:
    op.execute(TABLE)
    op.execute("ALTER TABLE job_queue ADD COLUMN cancelled_by text, ADD COLUMN cancel_reason text")
    op.execute("GRANT SELECT, INSERT, UPDATE ON job_registry TO motir_engine")
    _functions(forward=True)
    # Outside the transaction: CONCURRENTLY builds never block the previous release's writes.
    with op.get_context().autocommit_block():
        for name, sql in QUEUE_INDEXES.items():
            op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")  # an INVALID leftover of a failed build
            op.execute(sql)


def downgrade() -> None:
    for name in QUEUE_INDEXES:
        op.execute(f"DROP INDEX IF EXISTS {name}")
    _functions(forward=False)
    op.execute("ALTER TABLE job_queue DROP COLUMN cancelled_by, DROP COLUMN cancel_reason")
    op.execute("DROP TABLE job_registry")
