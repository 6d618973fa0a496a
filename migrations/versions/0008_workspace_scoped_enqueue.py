"""workspace-scoped keys and wake-ups; the app role enqueues through checked functions (expand)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 20:30:00.000000

Issue 24. Expand only — workers and producers of the previous release keep running
against this schema (0009 contracts, once they are gone; docs/operations.md, "Deploy
order"):

* Keys are per workspace. ``uq_job_event_idempotency`` (workspace, name, key) and
  ``uq_job_queue_singleton`` (job, workspace, singleton key; active runs) are added,
  NULLS NOT DISTINCT so that system rows (no workspace) share one key space. The
  global ``(name, idempotency_key)`` constraint and ``uq_job_queue_singleton_active``
  stay until 0009: the previous release names the first in ``ON CONFLICT``.
* The writers of an event, a batch and a direct run are written once each, as
  SECURITY DEFINER functions only the engine role may call (``motir_write_event``,
  ``motir_write_events``, ``motir_write_direct``). Their wake-up of runs waiting for
  an event matches runs of the event's own workspace only (a system event: system
  runs only).
* The app role's way in: ``motir_enqueue_event``, ``motir_enqueue_events``,
  ``motir_enqueue_direct`` (SECURITY DEFINER, fixed ``search_path``, EXECUTE for
  ``motir_app`` only). They take what a producer may choose — job, data, key, a
  delay within bounds, priority — write in the workspace of the caller's transaction
  (``motir.workspace_id``; none set, or another given: refused) and set the rest
  (state ``queued``, no claim, no lease, attempts 0, no cron slot, the event they
  wrote). Each guard is one line tagged ``-- guard:``; tests/store/test_isolation.py drops
  each in turn and shows what it stops.
* ``motir_record_event`` / ``motir_record_events`` (same signatures: the previous
  release calls them) and the new ``motir_direct_run`` dispatch: a member of
  ``motir_engine`` goes to the writer, anyone else to the checked function.

Functions are compared by ``motir migrate --check`` (store/routines.py declares each
one's digest, flags and grants).
"""
from alembic import context, op
from sqlalchemy import text

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None

EVENT_ARGS = ("p_name text, p_data jsonb, p_workspace_id text, p_key text, p_traceparent text, "
              "p_job_ids text[], p_max_attempts int[], p_policies text[], p_priorities smallint[], "
              "p_singletons text[], p_concurrency text[], p_cancel_keys text[]")
EVENT_TYPES = "text, jsonb, text, text, text, text[], int[], text[], smallint[], text[], text[], text[]"
EVENT_CALL = ("p_name, p_data, p_workspace_id, p_key, p_traceparent, p_job_ids, p_max_attempts, p_policies, "
              "p_priorities, p_singletons, p_concurrency, p_cancel_keys")
EVENT_RESULT = "TABLE (woken boolean, event_id uuid, run_id uuid, job_id text)"

EVENTS_ARGS = ("p_names text[], p_datas jsonb[], p_workspace_ids text[], p_keys text[], p_traceparent text, "
               "p_run_events int[], p_job_ids text[], p_max_attempts int[], p_policies text[], "
               "p_priorities smallint[], p_singletons text[], p_concurrency text[], p_cancel_keys text[]")
EVENTS_TYPES = ("text[], jsonb[], text[], text[], text, int[], text[], int[], text[], smallint[], text[], "
                "text[], text[]")
EVENTS_CALL = ("p_names, p_datas, p_workspace_ids, p_keys, p_traceparent, p_run_events, p_job_ids, "
               "p_max_attempts, p_policies, p_priorities, p_singletons, p_concurrency, p_cancel_keys")
EVENTS_RESULT = "TABLE (woken boolean, idx int, event_id uuid, run_id uuid, job_id text)"

DIRECT_ARGS = ("p_name text, p_data jsonb, p_workspace_id text, p_key text, p_eta timestamptz, "
               "p_countdown float8, p_job_id text, p_max_attempts int, p_policy text, p_priority smallint, "
               "p_singleton text, p_concurrency text, p_cancel_key text, p_traceparent text, p_after float8")
DIRECT_TYPES = ("text, jsonb, text, text, timestamptz, float8, text, int, text, smallint, text, text, text, "
                "text, float8")
DIRECT_CALL = ("p_name, p_data, p_workspace_id, p_key, p_eta, p_countdown, p_job_id, p_max_attempts, p_policy, "
               "p_priority, p_singleton, p_concurrency, p_cancel_key, p_traceparent, p_after")
DIRECT_RESULT = "TABLE (event_id uuid, run_id uuid, due_in float8)"

DEFINER = "SECURITY DEFINER SET search_path = {schema}, pg_temp"

# --- the writers (engine only) -----------------------------------------------------------

WRITE_EVENT = f"""
CREATE FUNCTION motir_write_event({EVENT_ARGS})
RETURNS {EVENT_RESULT}
LANGUAGE plpgsql VOLATILE {DEFINER} AS $$
#variable_conflict use_column
BEGIN
  RETURN QUERY
    WITH e AS (
      INSERT INTO job_event (name, data, workspace_id, idempotency_key)
      SELECT p_name, p_data, p_workspace_id, p_key
      -- A shared lock on the event name, held to commit: a run that starts waiting for
      -- this name takes it exclusively before its look-back, so it either sees this
      -- event or is seen by the wake-up below.
      FROM (SELECT pg_advisory_xact_lock_shared(hashtext('motir.wait:' || p_name))) AS wait_fence
      -- (workspace, name, key) is unique (and, until 0009, (name, key)); NULL keys never
      -- conflict. A conflict returns no row here, so no run either.
      ON CONFLICT DO NOTHING
      RETURNING id, name, workspace_id
    ), runs AS (
      INSERT INTO job_queue AS q (event_id, job_id, event_name, workspace_id, max_attempts, retry_policy,
                                  priority, singleton_key, concurrency_key, cancel_key, traceparent)
      SELECT e.id, s.job_id, e.name, e.workspace_id, s.max_attempts, s.retry_policy,
             s.priority, s.singleton_key, s.concurrency_key, s.cancel_key, p_traceparent
      FROM e, unnest(p_job_ids, p_max_attempts, p_policies, p_priorities, p_singletons, p_concurrency,
                     p_cancel_keys)
             AS s(job_id, max_attempts, retry_policy, priority, singleton_key, concurrency_key, cancel_key)
      -- No conflict target: one run per (event, job), one active run per (job, workspace, singleton key).
      ON CONFLICT DO NOTHING
      RETURNING q.id, q.job_id
    )
    SELECT false, e.id, runs.id, runs.job_id FROM e LEFT JOIN runs ON true;
  IF NOT FOUND THEN
    RETURN;  -- deduplicated by its idempotency key: nothing was written, nobody is woken
  END IF;
  -- Runs suspended in step.wait_for_event for this event become due now: (true, NULL, run, job).
  -- This query's snapshot is taken now, after the lock above was granted.
  RETURN QUERY
    UPDATE job_queue q
    SET run_at = now(), dispatched_at = now()      -- due now; the caller publishes after commit
    WHERE q.wait_event = p_name                    -- served by ix_job_queue_waiting
      AND q.state = 'queued'                       -- suspended waiting (not cancelled, not running)
      AND q.wait_value = (p_data #>> q.wait_path)  -- the field the waiter matches on
      AND q.workspace_id IS NOT DISTINCT FROM p_workspace_id   -- the event's own workspace (system: system runs)
    RETURNING true, NULL::uuid, q.id, q.job_id;
END
$$
"""

WRITE_EVENTS = f"""
CREATE FUNCTION motir_write_events({EVENTS_ARGS})
RETURNS {EVENTS_RESULT}
LANGUAGE plpgsql VOLATILE {DEFINER} AS $$
#variable_conflict use_column
DECLARE
  -- Each event's id, minted here so the rows the INSERT returns map back to their input.
  v_ids uuid[] := ARRAY(SELECT gen_random_uuid() FROM generate_series(1, cardinality(p_names)));
BEGIN
  -- Shared locks on every distinct event name, held to commit, in one order (two batches
  -- never wait on each other in a cycle): step.wait_for_event's fence, as in motir_write_event.
  PERFORM pg_advisory_xact_lock_shared(hashtext('motir.wait:' || n))
  FROM (SELECT DISTINCT n FROM unnest(p_names) AS n ORDER BY n) AS names;
  RETURN QUERY
    WITH ev AS MATERIALIZED (
      SELECT v_ids[t.i] AS id, t.i::int AS i, t.name, t.data, t.workspace_id, t.key
      FROM unnest(p_names, p_datas, p_workspace_ids, p_keys) WITH ORDINALITY AS t(name, data, workspace_id, key, i)
    ), e AS (
      INSERT INTO job_event (id, name, data, workspace_id, idempotency_key)
      SELECT ev.id, ev.name, ev.data, ev.workspace_id, ev.key FROM ev ORDER BY ev.i
      -- (workspace, name, key) is unique; NULL keys never conflict. A conflict (with an earlier
      -- event, or an earlier row of this batch) writes no event, hence no run.
      ON CONFLICT DO NOTHING
      RETURNING id
    ), runs AS (
      INSERT INTO job_queue AS q (event_id, job_id, event_name, workspace_id, max_attempts, retry_policy,
                                  priority, singleton_key, concurrency_key, cancel_key, traceparent)
      SELECT ev.id, s.job_id, ev.name, ev.workspace_id, s.max_attempts, s.retry_policy,
             s.priority, s.singleton_key, s.concurrency_key, s.cancel_key, p_traceparent
      FROM e JOIN ev ON ev.id = e.id
      JOIN unnest(p_run_events, p_job_ids, p_max_attempts, p_policies, p_priorities, p_singletons,
                  p_concurrency, p_cancel_keys)
             AS s(i, job_id, max_attempts, retry_policy, priority, singleton_key, concurrency_key, cancel_key)
        ON s.i = ev.i                                -- the runs of this event
      ON CONFLICT DO NOTHING
      RETURNING q.id, q.job_id, q.event_id
    )
    SELECT false, ev.i, e.id, runs.id, runs.job_id FROM e JOIN ev ON ev.id = e.id LEFT JOIN runs ON runs.event_id = e.id;
  -- Runs suspended in step.wait_for_event for any event written become due: (true, NULL, NULL, run, job).
  -- A fresh snapshot, taken after the locks above were granted.
  RETURN QUERY
    UPDATE job_queue q
    SET run_at = now(), dispatched_at = now()        -- due now; the caller publishes after commit
    -- Driven from the waiters (ix_job_queue_waiting: only waiting runs), never from the queued runs.
    WHERE q.wait_event = ANY(ARRAY(SELECT DISTINCT unnest(p_names)))
      AND q.state = 'queued'                         -- suspended waiting (not cancelled, not running)
      AND EXISTS (SELECT 1 FROM job_event e
                  WHERE e.id = ANY(v_ids)            -- the events this call wrote (a deduplicated one is absent)
                    AND e.name = q.wait_event
                    AND e.workspace_id IS NOT DISTINCT FROM q.workspace_id   -- the waiter's own workspace
                    AND (e.data #>> q.wait_path) = q.wait_value)   -- the field the waiter matches on
    RETURNING true, NULL::int, NULL::uuid, q.id, q.job_id;
END
$$
"""

WRITE_DIRECT = f"""
CREATE FUNCTION motir_write_direct({DIRECT_ARGS})
RETURNS {DIRECT_RESULT}
LANGUAGE sql VOLATILE {DEFINER} AS $$
  WITH e AS (
    INSERT INTO job_event (name, data, workspace_id, idempotency_key)
    VALUES (p_name, p_data, p_workspace_id, p_key)
    -- (workspace, name, key) is unique and the name is the job's own: a key (Celery's
    -- task_id) used twice for this job in this workspace writes nothing. NULL keys never conflict.
    ON CONFLICT DO NOTHING
    RETURNING id, name, workspace_id
  ), due AS (
    -- countdown is a duration on the database's clock; eta an absolute instant the caller
    -- chose (timestamptz, so its zone is kept). Never the caller's clock.
    SELECT coalesce(p_eta, now() + make_interval(secs => p_countdown)) AS run_at
  ), runs AS (
    INSERT INTO job_queue (event_id, job_id, event_name, workspace_id, max_attempts, retry_policy, priority,
                           singleton_key, concurrency_key, cancel_key, traceparent, run_at, dispatched_at)
    SELECT e.id, p_job_id, e.name, e.workspace_id, p_max_attempts, p_policy, p_priority,
           p_singleton, p_concurrency, p_cancel_key, p_traceparent, due.run_at,
           -- due later than republish_after: no message now, the sweeper publishes it once due
           -- ("message older than republish_after" then holds at run_at); else published now.
           greatest(now(), due.run_at - make_interval(secs => p_after))
    FROM e, due
    -- No conflict target: one run per (event, job), one active run per (job, workspace, singleton key).
    ON CONFLICT DO NOTHING
    RETURNING id, run_at
  )
  SELECT e.id, runs.id,
         -- seconds until due by the database's clock: the Celery countdown of its message
         extract(epoch FROM runs.run_at - now())::float8
  FROM e LEFT JOIN runs ON true
$$
"""

# --- the checked functions (the app role's only way to write) ------------------------------
# Each guard is one line ending in "-- guard: <name>" (the mutation test removes them one by one).

_WORKSPACE_GUARDS = """
  v_ws := nullif(current_setting('motir.workspace_id', true), '');
  IF v_ws IS NULL THEN RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = 'motir: the app role writes only in the workspace of its transaction, and motir.workspace_id is not set'; END IF;  -- guard: workspace_set
"""

ENQUEUE_EVENT = f"""
CREATE FUNCTION motir_enqueue_event({EVENT_ARGS})
RETURNS {EVENT_RESULT}
LANGUAGE plpgsql VOLATILE {DEFINER} AS $$
DECLARE
  v_ws text;
BEGIN
{_WORKSPACE_GUARDS}
  IF p_workspace_id IS DISTINCT FROM v_ws THEN RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = format('motir: an event of workspace %L sent in a transaction of workspace %L', p_workspace_id, v_ws); END IF;  -- guard: workspace_match
  IF p_name IS NULL OR length(p_name) NOT BETWEEN 1 AND 200 OR (p_key IS NOT NULL AND length(p_key) NOT BETWEEN 1 AND 255) THEN RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'motir: an event name is 1 to 200 characters, a key 1 to 255'; END IF;  -- guard: name_and_key
  IF cardinality(p_job_ids) > 1000 OR EXISTS (SELECT 1 FROM unnest(p_max_attempts) AS a WHERE a IS NULL OR a NOT BETWEEN 1 AND 100) THEN RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'motir: at most 1000 runs an event, each of 1 to 100 attempts'; END IF;  -- guard: run_bounds
  RETURN QUERY SELECT * FROM motir_write_event(p_name, p_data, v_ws, p_key, p_traceparent, p_job_ids,
    p_max_attempts, p_policies, p_priorities, p_singletons, p_concurrency, p_cancel_keys);
END
$$
"""

ENQUEUE_EVENTS = f"""
CREATE FUNCTION motir_enqueue_events({EVENTS_ARGS})
RETURNS {EVENTS_RESULT}
LANGUAGE plpgsql VOLATILE {DEFINER} AS $$
DECLARE
  v_ws text;
BEGIN
{_WORKSPACE_GUARDS}
  IF EXISTS (SELECT 1 FROM unnest(p_workspace_ids) AS w WHERE w IS DISTINCT FROM v_ws) THEN RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = format('motir: a batch with events of another workspace than %L, the transaction''s', v_ws); END IF;  -- guard: workspace_match
  IF cardinality(p_names) > 10000 OR EXISTS (SELECT 1 FROM unnest(p_names, p_keys) AS t(n, k) WHERE n IS NULL OR length(n) NOT BETWEEN 1 AND 200 OR (k IS NOT NULL AND length(k) NOT BETWEEN 1 AND 255)) THEN RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'motir: at most 10000 events a batch, names of 1 to 200 characters, keys 1 to 255'; END IF;  -- guard: name_and_key
  IF cardinality(p_job_ids) > 100000 OR EXISTS (SELECT 1 FROM unnest(p_max_attempts) AS a WHERE a IS NULL OR a NOT BETWEEN 1 AND 100) THEN RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'motir: runs of 1 to 100 attempts'; END IF;  -- guard: run_bounds
  RETURN QUERY SELECT * FROM motir_write_events(p_names, p_datas, p_workspace_ids, p_keys, p_traceparent,
    p_run_events, p_job_ids, p_max_attempts, p_policies, p_priorities, p_singletons, p_concurrency, p_cancel_keys);
END
$$
"""

ENQUEUE_DIRECT = f"""
CREATE FUNCTION motir_enqueue_direct({DIRECT_ARGS})
RETURNS {DIRECT_RESULT}
LANGUAGE plpgsql VOLATILE {DEFINER} AS $$
DECLARE
  v_ws text;
BEGIN
{_WORKSPACE_GUARDS}
  IF p_workspace_id IS DISTINCT FROM v_ws THEN RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = format('motir: a run of workspace %L made in a transaction of workspace %L', p_workspace_id, v_ws); END IF;  -- guard: workspace_match
  IF p_name IS NULL OR length(p_name) NOT BETWEEN 1 AND 200 OR (p_key IS NOT NULL AND length(p_key) NOT BETWEEN 1 AND 255) THEN RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'motir: an event name is 1 to 200 characters, a key 1 to 255'; END IF;  -- guard: name_and_key
  IF p_max_attempts IS NULL OR p_max_attempts NOT BETWEEN 1 AND 100 THEN RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'motir: a run has 1 to 100 attempts'; END IF;  -- guard: run_bounds
  IF p_countdown IS NULL OR p_countdown NOT BETWEEN 0 AND 31536000 OR p_eta > now() + interval '366 days' THEN RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'motir: a run is due within a year'; END IF;  -- guard: delay_bounds
  RETURN QUERY SELECT * FROM motir_write_direct(p_name, p_data, v_ws, p_key, p_eta, p_countdown, p_job_id,
    p_max_attempts, p_policy, p_priority, p_singleton, p_concurrency, p_cancel_key, p_traceparent,
    least(greatest(coalesce(p_after, 60), 0), 86400));
END
$$
"""

# --- the dispatchers (what the code calls; SECURITY INVOKER) ------------------------------

_ENGINE = "pg_has_role(current_user, 'motir_engine', 'MEMBER')"

RECORD_EVENT = f"""
CREATE OR REPLACE FUNCTION motir_record_event({EVENT_ARGS})
RETURNS {EVENT_RESULT}
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  -- The engine role writes any workspace's rows; anyone else goes through the checks.
  IF {_ENGINE} THEN
    RETURN QUERY SELECT * FROM motir_write_event({EVENT_CALL});
  ELSE
    RETURN QUERY SELECT * FROM motir_enqueue_event({EVENT_CALL});
  END IF;
END
$$
"""

RECORD_EVENTS = f"""
CREATE OR REPLACE FUNCTION motir_record_events({EVENTS_ARGS})
RETURNS {EVENTS_RESULT}
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  IF {_ENGINE} THEN
    RETURN QUERY SELECT * FROM motir_write_events({EVENTS_CALL});
  ELSE
    RETURN QUERY SELECT * FROM motir_enqueue_events({EVENTS_CALL});
  END IF;
END
$$
"""

DIRECT_RUN = f"""
CREATE FUNCTION motir_direct_run({DIRECT_ARGS})
RETURNS {DIRECT_RESULT}
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  IF {_ENGINE} THEN
    RETURN QUERY SELECT * FROM motir_write_direct({DIRECT_CALL});
  ELSE
    RETURN QUERY SELECT * FROM motir_enqueue_direct({DIRECT_CALL});
  END IF;
END
$$
"""

WRITERS = {"motir_write_event": EVENT_TYPES, "motir_write_events": EVENTS_TYPES, "motir_write_direct": DIRECT_TYPES}
CHECKED = {"motir_enqueue_event": EVENT_TYPES, "motir_enqueue_events": EVENTS_TYPES,
           "motir_enqueue_direct": DIRECT_TYPES}
DISPATCHERS = {"motir_record_event": EVENT_TYPES, "motir_record_events": EVENTS_TYPES, "motir_direct_run": DIRECT_TYPES}


def upgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute("CREATE UNIQUE INDEX uq_job_event_idempotency ON job_event (workspace_id, name, idempotency_key) "
               "NULLS NOT DISTINCT WHERE idempotency_key IS NOT NULL")
    op.execute("CREATE UNIQUE INDEX uq_job_queue_singleton ON job_queue (job_id, workspace_id, singleton_key) "
               "NULLS NOT DISTINCT WHERE singleton_key IS NOT NULL AND state IN ('queued', 'running')")
    for sql in (WRITE_EVENT, WRITE_EVENTS, WRITE_DIRECT, ENQUEUE_EVENT, ENQUEUE_EVENTS, ENQUEUE_DIRECT):
        op.execute(sql.replace("{schema}", schema))
    for sql in (RECORD_EVENT, RECORD_EVENTS, DIRECT_RUN):
        op.execute(sql)
    for name, types in WRITERS.items():
        op.execute(f"REVOKE ALL ON FUNCTION {name}({types}) FROM PUBLIC")
        op.execute(f"GRANT EXECUTE ON FUNCTION {name}({types}) TO motir_engine")
    for name, types in CHECKED.items():
        op.execute(f"REVOKE ALL ON FUNCTION {name}({types}) FROM PUBLIC")
        op.execute(f"GRANT EXECUTE ON FUNCTION {name}({types}) TO motir_app")
    for name, types in DISPATCHERS.items():
        op.execute(f"REVOKE ALL ON FUNCTION {name}({types}) FROM PUBLIC")
        op.execute(f"GRANT EXECUTE ON FUNCTION {name}({types}) TO motir_app, motir_engine")


def downgrade() -> None:
    # The dispatchers as 0005 and 0006 made them, from those revisions' own text (frozen).
    scripts = context.script
    m5, m6 = scripts.get_revision("0005").module, scripts.get_revision("0006").module
    for name, types in DISPATCHERS.items():
        op.execute(f"DROP FUNCTION {name}({types})")
    for name, types in {**CHECKED, **WRITERS}.items():
        op.execute(f"DROP FUNCTION {name}({types})")
    op.execute(m5._RECORD_EVENT_HEAD + m5._WAKE_0005)
    op.execute(m6.RECORD_EVENTS)
    op.execute("DROP INDEX uq_job_queue_singleton")
    op.execute("DROP INDEX uq_job_event_idempotency")
