"""insights and flow control: the stats rollup, its indexes, throttle/debounce/batch columns, motir_gather (expand)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-12 10:00:00.000000

Issue 30. Expand only: nothing the previous release reads or writes changes. Its workers
insert runs without the new columns (all nullable, no default to compute: a metadata-only
ALTER), never read them, and call none of the new functions; its purge deletes runs
without folding them into the rollup (a run purged by the previous release's ``motir
purge`` during the deploy is not counted: docs/operations.md, "Deploy order").

* ``job_queue``: ``flow_wait`` (why a queued run waits on flow control: ``throttle``,
  ``debounce``, ``batch``), ``flow_key`` / ``flow_since`` / ``gathered`` (debounce= and
  batch=: the key, when the gathering began, how many events), ``throttle_key`` /
  ``throttle_at`` (throttle=: the key, the instant the run was admitted), ``folded_at``
  (the finish the stats rollup counted). The CHECK on ``flow_wait`` is added NOT VALID,
  then validated (a scan that does not block writes).
* Indexes on ``job_queue``, each built CONCURRENTLY (the previous release keeps writing
  the table meanwhile): ``uq_job_queue_gathering``, ``ix_job_queue_throttle_waiting``,
  ``ix_job_queue_throttle_starts`` (flow control), ``ix_job_queue_flaky`` (attempts > 1)
  and ``ix_job_queue_succeeded`` (insights). A build that failed leaves an INVALID index;
  the revision drops it first when run again.
* ``job_stats_rollup``: per (job, workspace, 5-minute bucket) and per (job, workspace) all
  time, folded from finished runs by the fleet's sweep and by purge before it deletes.
  ``job_batch_item``: the events of a batch run. Both carry ``workspace_id``: row-level
  security as on the five tables (the app role reads, the engine role writes).
* ``job_sweep`` row ``'stats'``: the fold's watermark (``swept_at``: runs finished before
  it, less a margin, are folded).
* ``motir_gather``: debounce= and batch= decided at send, in the sender's transaction,
  under the key's advisory lock — the writer ``motir_write_gather`` (engine role), the
  checked ``motir_enqueue_gather`` (app role: runs of its own workspace, made in its own
  transaction, within bounds; each guard one line tagged ``-- guard:``), and the dispatcher.
  The event writers of 0008 are untouched: a run is written as before, then gathered.
"""
from alembic import op
from sqlalchemy import text

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None

COLUMNS = ("flow_wait text", "flow_key text", "flow_since timestamptz", "gathered integer", "throttle_key text",
           "throttle_at timestamptz", "folded_at timestamptz")

QUEUE_INDEXES = {
    "uq_job_queue_gathering": "CREATE UNIQUE INDEX CONCURRENTLY uq_job_queue_gathering ON job_queue "
                              "(job_id, workspace_id, flow_key) NULLS NOT DISTINCT "
                              "WHERE flow_wait IN ('debounce', 'batch') AND state = 'queued'",
    "ix_job_queue_throttle_waiting": "CREATE INDEX CONCURRENTLY ix_job_queue_throttle_waiting ON job_queue "
                                     "(job_id, throttle_key, created_at) "
                                     "WHERE flow_wait = 'throttle' AND state = 'queued'",
    "ix_job_queue_throttle_starts": "CREATE INDEX CONCURRENTLY ix_job_queue_throttle_starts ON job_queue "
                                    "(job_id, throttle_key, throttle_at) WHERE throttle_at IS NOT NULL",
    "ix_job_queue_flaky": "CREATE INDEX CONCURRENTLY ix_job_queue_flaky ON job_queue (created_at) "
                          "WHERE attempts > 1",
    "ix_job_queue_succeeded": "CREATE INDEX CONCURRENTLY ix_job_queue_succeeded ON job_queue (job_id, finished_at) "
                              "WHERE state = 'succeeded'",
}

TABLES = """
CREATE TABLE job_batch_item (
  run_id uuid NOT NULL,
  position integer NOT NULL,
  event_id uuid NOT NULL,
  workspace_id text,
  CONSTRAINT pk_job_batch_item PRIMARY KEY (run_id, position),
  CONSTRAINT fk_job_batch_item_run_id_job_queue FOREIGN KEY (run_id) REFERENCES job_queue (id) ON DELETE CASCADE,
  CONSTRAINT fk_job_batch_item_event_id_job_event FOREIGN KEY (event_id) REFERENCES job_event (id) ON DELETE RESTRICT
);
CREATE INDEX ix_job_batch_item_event ON job_batch_item (event_id);
CREATE TABLE job_stats_rollup (
  id bigint GENERATED ALWAYS AS IDENTITY,
  job_id text NOT NULL,
  workspace_id text,
  bucket timestamptz,
  succeeded_count bigint NOT NULL DEFAULT 0,
  failed_count bigint NOT NULL DEFAULT 0,
  cancelled_count bigint NOT NULL DEFAULT 0,
  retried_count bigint NOT NULL DEFAULT 0,
  attempts_count bigint NOT NULL DEFAULT 0,
  sum_duration_ms double precision NOT NULL DEFAULT 0,
  duration_samples bigint NOT NULL DEFAULT 0,
  duration_buckets bigint[] NOT NULL,
  updated_at timestamptz NOT NULL DEFAULT now(),
  CONSTRAINT pk_job_stats_rollup PRIMARY KEY (id)
);
CREATE UNIQUE INDEX uq_job_stats_rollup ON job_stats_rollup (job_id, workspace_id, bucket) NULLS NOT DISTINCT;
CREATE INDEX ix_job_stats_rollup_bucket ON job_stats_rollup (bucket);
"""

# As 0005 left the five tables' policies (0001's names, 0005's admin arm).
PREDICATE = ("(workspace_id = current_setting('motir.workspace_id', true)) "
             "OR ((current_setting('motir.system_admin', true) = 'true') "
             "AND pg_has_role(current_user, 'motir_admin', 'MEMBER'))")

GATHER_ARGS = "p_run_ids uuid[], p_kinds text[], p_keys text[], p_waits float8[], p_limits float8[]"
GATHER_TYPES = "uuid[], text[], text[], float8[], float8[]"
GATHER_CALL = "p_run_ids, p_kinds, p_keys, p_waits, p_limits"
GATHER_RESULT = "TABLE (run_id uuid, into_run uuid, due boolean, due_in float8)"

WRITE_GATHER = f"""
CREATE FUNCTION motir_write_gather({GATHER_ARGS})
RETURNS {GATHER_RESULT}
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = {{schema}}, pg_temp AS $$
#variable_conflict use_column
DECLARE
  g record;
  v_run job_queue%ROWTYPE;
  v_open job_queue%ROWTYPE;
  v_at timestamptz;
BEGIN
  -- p_kinds: 'debounce' (p_waits: the quiet period, p_limits: the longest wait after the burst's
  -- first event) or 'batch' (p_waits: the timeout after the first event, p_limits: the size).
  FOR g IN
    SELECT t.run_id, t.kind, t.key, t.wait, t.lim, q.job_id, q.workspace_id
    FROM unnest(p_run_ids, p_kinds, p_keys, p_waits, p_limits) AS t(run_id, kind, key, wait, lim)
    JOIN job_queue q ON q.id = t.run_id
    -- One lock order for every caller, so two senders never wait on each other in a cycle.
    ORDER BY q.job_id, q.workspace_id, t.key, t.run_id
  LOOP
    -- The key's lock, held to commit: the senders adding to a key and the claim that closes its
    -- run (core/worker/flow.py) take turns; each statement below takes its snapshot after it.
    PERFORM pg_advisory_xact_lock(hashtextextended(
      'motir.gather:' || g.job_id || chr(31) || coalesce(g.workspace_id, '') || chr(31) || g.key, 0));
    SELECT * INTO v_run FROM job_queue q
    WHERE q.id = g.run_id
      AND q.state = 'queued' AND q.flow_key IS NULL   -- not gathered yet: a second call for it does nothing
      AND q.event_id IS NOT NULL                      -- an event's run (debounce= / batch= are event jobs)
      AND q.claim_token IS NULL
      AND NOT EXISTS (SELECT 1 FROM job_run r WHERE r.run_id = q.id)   -- never started
    FOR UPDATE;
    IF NOT FOUND THEN
      CONTINUE;
    END IF;
    SELECT * INTO v_open FROM job_queue q
    WHERE q.job_id = v_run.job_id
      AND q.workspace_id IS NOT DISTINCT FROM v_run.workspace_id   -- a key is per workspace (system: system runs)
      AND q.flow_key = g.key AND q.flow_wait = g.kind AND q.state = 'queued'   -- its open run (uq_job_queue_gathering)
    FOR UPDATE;
    IF FOUND THEN
      -- The new run is folded into the open one: it never started, nothing points at it.
      DELETE FROM job_queue WHERE id = v_run.id;
      IF g.kind = 'debounce' THEN
        UPDATE job_queue q
        SET event_id = v_run.event_id, event_name = v_run.event_name,   -- the run carries the last event
            traceparent = v_run.traceparent, cancel_key = v_run.cancel_key,   -- and what its data keys
            concurrency_key = v_run.concurrency_key,
            gathered = q.gathered + 1,
            -- quiet for the period from now, but never later than max_wait after the burst began
            run_at = least(now() + make_interval(secs => g.wait), q.flow_since + make_interval(secs => g.lim))
        WHERE q.id = v_open.id
        RETURNING q.run_at INTO v_at;
      ELSE
        INSERT INTO job_batch_item (run_id, position, event_id, workspace_id)
        VALUES (v_open.id, v_open.gathered + 1, v_run.event_id, v_open.workspace_id);
        UPDATE job_queue q
        SET gathered = q.gathered + 1,
            -- full: closed (the next event opens a new batch) and due now
            flow_wait = CASE WHEN q.gathered + 1 >= g.lim THEN NULL ELSE q.flow_wait END,
            run_at = CASE WHEN q.gathered + 1 >= g.lim THEN least(q.run_at, now()) ELSE q.run_at END,
            dispatched_at = CASE WHEN q.gathered + 1 >= g.lim THEN now() ELSE q.dispatched_at END
        WHERE q.id = v_open.id
        RETURNING q.run_at INTO v_at;
      END IF;
      RETURN QUERY SELECT g.run_id, v_open.id, v_at <= now(), greatest(extract(epoch FROM v_at - now()), 0)::float8;
    ELSE
      -- The key's first event: this run opens the gathering.
      UPDATE job_queue q
      SET flow_key = g.key, flow_since = now(), gathered = 1,
          flow_wait = CASE WHEN g.kind = 'batch' AND g.lim <= 1 THEN NULL ELSE g.kind END,
          run_at = now() + make_interval(secs => CASE WHEN g.kind = 'debounce' THEN least(g.wait, g.lim)
                                                      WHEN g.lim <= 1 THEN 0 ELSE g.wait END)
      WHERE q.id = v_run.id
      RETURNING q.run_at INTO v_at;
      IF g.kind = 'batch' THEN
        INSERT INTO job_batch_item (run_id, position, event_id, workspace_id)
        VALUES (v_run.id, 1, v_run.event_id, v_run.workspace_id);
      END IF;
      RETURN QUERY SELECT g.run_id, v_run.id, v_at <= now(), greatest(extract(epoch FROM v_at - now()), 0)::float8;
    END IF;
  END LOOP;
END
$$
"""

# Each guard is one line ending in "-- guard: <name>" (tests/core/test_flow_control.py removes them one by one).
ENQUEUE_GATHER = f"""
CREATE FUNCTION motir_enqueue_gather({GATHER_ARGS})
RETURNS {GATHER_RESULT}
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = {{schema}}, pg_temp AS $$
DECLARE
  v_ws text;
BEGIN
  v_ws := nullif(current_setting('motir.workspace_id', true), '');
  IF v_ws IS NULL THEN RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = 'motir: the app role writes only in the workspace of its transaction, and motir.workspace_id is not set'; END IF;  -- guard: workspace_set
  IF cardinality(p_run_ids) > 1000 OR cardinality(p_kinds) <> cardinality(p_run_ids) OR cardinality(p_keys) <> cardinality(p_run_ids) OR cardinality(p_waits) <> cardinality(p_run_ids) OR cardinality(p_limits) <> cardinality(p_run_ids) THEN RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'motir: at most 1000 runs gathered a call, one kind, key, wait and limit each'; END IF;  -- guard: shape
  IF EXISTS (SELECT 1 FROM unnest(p_run_ids) AS r(id) LEFT JOIN job_queue q ON q.id = r.id WHERE q.id IS NULL OR q.workspace_id IS DISTINCT FROM v_ws OR q.created_at <> now()) THEN RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = format('motir: the app role gathers only runs its own transaction made in workspace %L', v_ws); END IF;  -- guard: own_runs
  IF EXISTS (SELECT 1 FROM unnest(p_kinds, p_keys, p_waits, p_limits) AS t(kind, key, wait, lim) WHERE kind IS NULL OR kind NOT IN ('debounce', 'batch') OR key IS NULL OR length(key) > 1000 OR wait IS NULL OR NOT (wait > 0 AND wait <= 604800) OR lim IS NULL OR (kind = 'debounce' AND NOT (lim >= wait AND lim <= 604800)) OR (kind = 'batch' AND NOT (lim >= 1 AND lim <= 1000 AND lim = trunc(lim)))) THEN RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'motir: debounce (a period and a max wait of at most a week) or batch (a timeout of at most a week, 1 to 1000 events), keys of at most 1000 characters'; END IF;  -- guard: bounds
  RETURN QUERY SELECT * FROM motir_write_gather({GATHER_CALL});
END
$$
"""

GATHER = f"""
CREATE FUNCTION motir_gather({GATHER_ARGS})
RETURNS {GATHER_RESULT}
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  -- The engine role gathers any workspace's runs; anyone else goes through the checks.
  IF pg_has_role(current_user, 'motir_engine', 'MEMBER') THEN
    RETURN QUERY SELECT * FROM motir_write_gather({GATHER_CALL});
  ELSE
    RETURN QUERY SELECT * FROM motir_enqueue_gather({GATHER_CALL});
  END IF;
END
$$
"""


def upgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute("ALTER TABLE job_queue " + ", ".join(f"ADD COLUMN {c}" for c in COLUMNS))
    op.execute("ALTER TABLE job_queue ADD CONSTRAINT ck_job_queue_flow_wait "
               "CHECK (flow_wait IN ('throttle', 'debounce', 'batch')) NOT VALID")
    op.execute(TABLES)
    for table in ("job_batch_item", "job_stats_rollup"):
        op.execute(f"GRANT SELECT ON {table} TO motir_app")
        op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO motir_engine")
        op.execute(f"ALTER TABLE {table} ENABLE ROW LEVEL SECURITY")
        op.execute(f"CREATE POLICY {table}_workspace ON {table} AS PERMISSIVE FOR ALL TO motir_app "
                   f"USING ({PREDICATE}) WITH CHECK ({PREDICATE})")
        op.execute(f"CREATE POLICY {table}_engine ON {table} AS PERMISSIVE FOR ALL TO motir_engine "
                   "USING (true) WITH CHECK (true)")
    op.execute("INSERT INTO job_sweep (name) VALUES ('stats') ON CONFLICT DO NOTHING")
    for sql in (WRITE_GATHER, ENQUEUE_GATHER):
        op.execute(sql.replace("{schema}", schema))
    op.execute(GATHER)
    op.execute(f"REVOKE ALL ON FUNCTION motir_write_gather({GATHER_TYPES}) FROM PUBLIC")
    op.execute(f"GRANT EXECUTE ON FUNCTION motir_write_gather({GATHER_TYPES}) TO motir_engine")
    op.execute(f"REVOKE ALL ON FUNCTION motir_enqueue_gather({GATHER_TYPES}) FROM PUBLIC")
    op.execute(f"GRANT EXECUTE ON FUNCTION motir_enqueue_gather({GATHER_TYPES}) TO motir_app")
    op.execute(f"REVOKE ALL ON FUNCTION motir_gather({GATHER_TYPES}) FROM PUBLIC")
    op.execute(f"GRANT EXECUTE ON FUNCTION motir_gather({GATHER_TYPES}) TO motir_app, motir_engine")
    # Outside the transaction: CONCURRENTLY builds never block the previous release's writes.
    with op.get_context().autocommit_block():
        op.execute("ALTER TABLE job_queue VALIDATE CONSTRAINT ck_job_queue_flow_wait")
        for name, sql in QUEUE_INDEXES.items():
            op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")  # an INVALID leftover of a failed build
            op.execute(sql)


def downgrade() -> None:
    for name in ("motir_gather", "motir_enqueue_gather", "motir_write_gather"):
        op.execute(f"DROP FUNCTION {name}({GATHER_TYPES})")
    op.execute("DELETE FROM job_sweep WHERE name = 'stats'")
    op.execute("DROP TABLE job_stats_rollup")
    op.execute("DROP TABLE job_batch_item")
    for name in QUEUE_INDEXES:
        op.execute(f"DROP INDEX IF EXISTS {name}")
    op.execute("ALTER TABLE job_queue DROP CONSTRAINT ck_job_queue_flow_wait, "
               + ", ".join(f"DROP COLUMN {c.split()[0]}" for c in COLUMNS))
