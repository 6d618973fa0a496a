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
* ``job_queue.subject_type`` / ``subject_id`` (seed 003's subject): what a run is about, as the
  producer names it (``job.apply_async(..., subject=("media_item", "42"))``): two plain nullable
  text columns, no FK, no typed column per subject shape. The subject travels in the direct run's
  arguments (``{"args", "kwargs", "subject": {"type", "id"}}``), so no function's signature
  changes: ``motir_write_direct`` (body replaced, 0013's statement) copies it to the two columns,
  and ``motir_enqueue_direct`` gains a sixth guard, ``subject`` — an object of exactly ``type``
  (1 to 64 of ``A-Za-z0-9_.-``: no ``:``, so ``TYPE:ID`` splits once) and ``id`` (1 to 255
  characters). ``ix_job_queue_subject_open`` ``(subject_type, subject_id, workspace_id)``, partial on
  open runs that name a subject: "cancel every open run of this subject"
  (``motir cancel --workspace W --subject TYPE:ID``) and "is one active for it"
  (``active_for_subject``) each read only it (EXPLAIN tests in tests/store/test_schema.py).
* ``job_queue.provider_key`` / ``model_version`` (seed 003's providerKey / modelVersion): an audit of
  what ran the job — which downstream provider handled it and which model/version it ran against —
  set by the job body (``step.audit(provider_key=..., model_version=...)``) and written by the
  success settle itself (its statement gains two parameters, NULL unless set). ``varchar(200)``,
  nullable, no default: a metadata-only ALTER (no rewrite, no scan); the bound is Postgres's as well
  as the Python call's. Never read by the claim, not indexed.
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
refused). The previous release's success settle never names the audit columns: a run it settles keeps them NULL.
Downgrade puts 0008's bodies (and 0013's writer) back and drops the indexes, the columns and the table.
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

# A run's subject (seed 003's subjectType / subjectId): what the run is about, named by the producer
# (``subject=("media_item", "42")``). Bounds the producer and the checked function both apply.
SUBJECT_TYPE = "^[A-Za-z0-9_.-]{1,64}$"
SUBJECT_ID_MAX = 255
# The audit columns' bound (characters), the Python call's as well (core/shapes.py AUDIT_MAX).
AUDIT_MAX = 200

QUEUE_INDEXES = {
    "ix_job_queue_recent": "CREATE INDEX CONCURRENTLY ix_job_queue_recent ON job_queue (created_at DESC, id)",
    "ix_job_queue_workspace_recent": "CREATE INDEX CONCURRENTLY ix_job_queue_workspace_recent ON job_queue "
                                     "(workspace_id, created_at DESC, id)",
    # "Cancel every open run of this subject", "is one active for it": only open runs that name a
    # subject are in it, so it stays the size of the work in flight, not of the history.
    "ix_job_queue_subject_open": "CREATE INDEX CONCURRENTLY ix_job_queue_subject_open ON job_queue "
                                 "(subject_type, subject_id, workspace_id) "
                                 "WHERE subject_type IS NOT NULL AND state IN ('queued', 'running')",
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
  IF p_data -> 'subject' IS NOT NULL AND NOT (CASE WHEN jsonb_typeof(p_data -> 'subject') = 'object' THEN (SELECT count(*) FROM jsonb_object_keys(p_data -> 'subject')) = 2 AND jsonb_typeof(p_data #> '{{subject,type}}') = 'string' AND jsonb_typeof(p_data #> '{{subject,id}}') = 'string' AND (p_data #>> '{{subject,type}}') ~ '{SUBJECT_TYPE}' AND length(p_data #>> '{{subject,id}}') BETWEEN 1 AND {SUBJECT_ID_MAX} ELSE false END) THEN RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'motir: a run''s subject is {{"type": 1 to 64 of A-Z a-z 0-9 _ . -, "id": 1 to {SUBJECT_ID_MAX} characters}}'; END IF;  -- guard: subject
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


#: The writer of a direct run (0013's, 0010's statement) also writes the run's subject, which its
#: arguments carry (``p_data -> 'subject'``, checked by the guard above for the app role and by the
#: Python producer for the engine role): in both of its INSERTs, two more columns.
SUBJECT_COLUMNS = ("cancel_key, traceparent, run_at, dispatched_at)",
                   "cancel_key, traceparent, run_at, dispatched_at, subject_type, subject_id)")
SUBJECT_VALUES = ("greatest(now(), due.run_at - make_interval(secs => p_after))\n    FROM e, due",
                  "greatest(now(), due.run_at - make_interval(secs => p_after)),\n"
                  "           p_data #>> '{subject,type}', p_data #>> '{subject,id}'\n    FROM e, due")


def _write_direct(forward: bool) -> str:
    """0013's motir_write_direct; with the subject columns."""
    sql = str(context.script.get_revision("0013").module.in_plpgsql(
        context.script.get_revision("0010").module.WRITE_DIRECT))
    if not forward:
        return sql
    for before, after in (SUBJECT_COLUMNS, SUBJECT_VALUES):
        assert sql.count(before) == 2, f"0013's motir_write_direct: {before!r} is not in both INSERTs"
        sql = sql.replace(before, after)
    return sql


def _functions(forward: bool) -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    for name in GUARDS:
        op.execute(_body(name, forward).replace("{schema}", schema))
    op.execute(_write_direct(forward).replace("{schema}", schema))


def upgrade() -> None:
    op.execute(TABLE)
    op.execute("ALTER TABLE job_queue ADD COLUMN cancelled_by text, ADD COLUMN cancel_reason text, "
               "ADD COLUMN subject_type text, ADD COLUMN subject_id text, "
               f"ADD COLUMN provider_key varchar({AUDIT_MAX}), ADD COLUMN model_version varchar({AUDIT_MAX})")
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
    op.execute("ALTER TABLE job_queue DROP COLUMN cancelled_by, DROP COLUMN cancel_reason, "
               "DROP COLUMN subject_type, DROP COLUMN subject_id, DROP COLUMN provider_key, DROP COLUMN model_version")
    op.execute("DROP TABLE job_registry")
