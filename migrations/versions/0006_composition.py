"""composition: child runs (parent_run_id, parent_step_id), DLQ resume audit, batch send

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 10:40:00.000000

Issue 20. Expand only: nullable columns, one unique constraint on them, two new
functions and a trigger. Workers of the previous release keep running: they never
write the new columns, and the trigger fires only for rows they cannot make
(parent_run_id set) or for a cancel, which it extends to a run's children.

* ``job_queue.parent_run_id`` / ``parent_step_id``: the run that ``step.invoke`` /
  ``step.gather`` started this one from, and the step; ``detached`` (default false):
  the child is not cancelled with its parent. UNIQUE (parent_run_id,
  parent_step_id) is the arbiter of "one child per (parent, step)"; NULLs are
  distinct, so top-level runs (parent NULL) are never constrained by it.
* ``job_run_dlq.resumed_at`` / ``resumed_by`` / ``resumed_run_id``: resume_dlq's
  audit, stamped by one conditional UPDATE. Resuming moves ``run_id`` to
  ``resumed_run_id`` (the entry is closed; the run may fail again into an entry of
  its own under UNIQUE (run_id)).
* ``motir_record_events``: send_events' statement, the set-based twin of
  motir_record_event (N events, their runs, the wake-up of their waiters).
* ``motir_on_run_settled`` (trigger ``motir_run_settled``, AFTER UPDATE OF state):
  a child reaching a final state makes its parent due once no child of that parent
  is unfinished (under an advisory lock per parent, so two children settling at once
  cannot both see the other unfinished); a cancelled run cancels its unfinished
  children (and, as they fire the trigger too, theirs).

Functions and triggers are not compared by ``alembic check`` (like motir_record_event
since 0004): this revision is their one source.
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

RECORD_EVENTS = """
CREATE FUNCTION motir_record_events(
    p_names text[], p_datas jsonb[], p_workspace_ids text[], p_keys text[], p_traceparent text,
    p_run_events int[], p_job_ids text[], p_max_attempts int[], p_policies text[], p_priorities smallint[],
    p_singletons text[], p_concurrency text[], p_cancel_keys text[])
RETURNS TABLE (woken boolean, idx int, event_id uuid, run_id uuid, job_id text)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
  -- Each event's id, minted here so the rows the INSERT returns map back to their input.
  v_ids uuid[] := ARRAY(SELECT gen_random_uuid() FROM generate_series(1, cardinality(p_names)));
BEGIN
  -- Shared locks on every distinct event name, held to commit, in one order (two
  -- batches never wait on each other in a cycle): step.wait_for_event's fence, as
  -- in motir_record_event.
  PERFORM pg_advisory_xact_lock_shared(hashtext('motir.wait:' || n))
  FROM (SELECT DISTINCT n FROM unnest(p_names) AS n ORDER BY n) AS names;
  RETURN QUERY
    WITH ev AS MATERIALIZED (
      SELECT v_ids[t.i] AS id, t.i::int AS i, t.name, t.data, t.workspace_id, t.key
      FROM unnest(p_names, p_datas, p_workspace_ids, p_keys) WITH ORDINALITY AS t(name, data, workspace_id, key, i)
    ), e AS (
      INSERT INTO job_event (id, name, data, workspace_id, idempotency_key)
      SELECT ev.id, ev.name, ev.data, ev.workspace_id, ev.key FROM ev ORDER BY ev.i
      -- (name, idempotency_key) is unique; NULL keys never conflict. A conflict (with an
      -- earlier event, or an earlier row of this batch) writes no event, hence no run.
      ON CONFLICT (name, idempotency_key) DO NOTHING
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
      -- No conflict target: one run per (event, job), one active run per (job, singleton_key).
      ON CONFLICT DO NOTHING
      RETURNING q.id, q.job_id, q.event_id
    )
    SELECT false, ev.i, e.id, runs.id, runs.job_id FROM e JOIN ev ON ev.id = e.id LEFT JOIN runs ON runs.event_id = e.id;
  -- Runs suspended in step.wait_for_event for any event written become due: (true, NULL, NULL, run, job).
  -- A fresh snapshot, taken after the locks above were granted.
  IF has_table_privilege('job_queue', 'UPDATE') THEN
    RETURN QUERY
      UPDATE job_queue q
      SET run_at = now(), dispatched_at = now()        -- due now; the caller publishes after commit
      -- Driven from the waiters (ix_job_queue_waiting: only waiting runs), never from the
      -- queued runs: a join on the events let the planner scan every queued run (measured:
      -- 8 ms a batch at 16k queued runs, growing with the backlog).
      WHERE q.wait_event = ANY(ARRAY(SELECT DISTINCT unnest(p_names)))
        AND q.state = 'queued'                         -- suspended waiting (not cancelled, not running)
        AND EXISTS (SELECT 1 FROM job_event e
                    WHERE e.id = ANY(v_ids)            -- the events this call wrote (a deduplicated one is absent)
                      AND e.name = q.wait_event
                      AND (e.data #>> q.wait_path) = q.wait_value)   -- the field the waiter matches on
      RETURNING true, NULL::int, NULL::uuid, q.id, q.job_id;
  ELSE
    RETURN QUERY SELECT true, NULL::int, NULL::uuid, w.run_id, w.job_id
      FROM job_event e, motir_wake_waiters(e.name, e.data) AS w WHERE e.id = ANY(v_ids);
  END IF;
END
$$
"""
RECORD_EVENTS_SIGNATURE = ("motir_record_events(text[], jsonb[], text[], text[], text, int[], text[], int[], "
                           "text[], smallint[], text[], text[], text[])")

ON_RUN_SETTLED = """
CREATE FUNCTION motir_on_run_settled() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.state = 'cancelled' THEN
    -- Cancelling a run cancels its unfinished children (each fires this trigger: grandchildren too).
    WITH kids AS (
      UPDATE job_queue
      SET state = 'cancelled', finished_at = now(), claim_token = NULL, lease_expires_at = NULL,
          wait_event = NULL
      WHERE parent_run_id = NEW.id                   -- served by uq_job_queue_parent_run_id_parent_step_id
        AND state IN ('queued', 'running')           -- a finished child stays as it ended
        AND NOT detached                             -- step.invoke(..., detach=True): outlives its parent
      RETURNING id
    )
    UPDATE job_run r SET outcome = 'cancelled', finished_at = now()
    FROM kids WHERE r.run_id = kids.id AND r.outcome = 'running';
  END IF;
  IF NEW.parent_run_id IS NOT NULL THEN
    -- Serialises the children of one parent settling at once, and the parent's own
    -- "are my children done? else suspend" (core/invoke.py takes the same lock): the
    -- UPDATE below takes its snapshot after the lock, so the last child to settle sees
    -- every sibling final, and a parent that checked before this child settled is
    -- already suspended when this runs.
    PERFORM pg_advisory_xact_lock(hashtextextended('motir.parent:' || NEW.parent_run_id::text, 0));
    UPDATE job_queue p
    SET run_at = now(), dispatched_at = now()        -- due now; the settling worker publishes it
    WHERE p.id = NEW.parent_run_id
      AND p.state = 'queued'                         -- suspended (a running parent checks for itself)
      AND p.wait_event = 'motir.children'            -- waiting for its children, not sleeping
      AND NOT EXISTS (SELECT 1 FROM job_queue c      -- resumed once: when its last child settles
                      WHERE c.parent_run_id = NEW.parent_run_id AND c.state IN ('queued', 'running'));
  END IF;
  RETURN NULL;
END
$$;
CREATE TRIGGER motir_run_settled AFTER UPDATE OF state ON job_queue FOR EACH ROW
  WHEN (OLD.state IS DISTINCT FROM NEW.state
        AND NEW.state IN ('succeeded', 'failed', 'cancelled')
        AND (NEW.parent_run_id IS NOT NULL OR NEW.state = 'cancelled'))
  EXECUTE FUNCTION motir_on_run_settled();
"""


def upgrade() -> None:
    op.add_column('job_queue', sa.Column('parent_run_id', sa.UUID(), nullable=True))
    op.add_column('job_queue', sa.Column('parent_step_id', sa.Text(), nullable=True))
    op.add_column('job_queue', sa.Column('detached', sa.Boolean(), server_default=sa.text('false'), nullable=False))
    op.create_foreign_key(op.f('fk_job_queue_parent_run_id_job_queue'), 'job_queue', 'job_queue',
                          ['parent_run_id'], ['id'], ondelete='SET NULL')
    op.create_unique_constraint(op.f('uq_job_queue_parent_run_id_parent_step_id'), 'job_queue',
                                ['parent_run_id', 'parent_step_id'])
    op.add_column('job_run_dlq', sa.Column('resumed_at', postgresql.TIMESTAMP(timezone=True), nullable=True))
    op.add_column('job_run_dlq', sa.Column('resumed_by', sa.Text(), nullable=True))
    op.add_column('job_run_dlq', sa.Column('resumed_run_id', sa.UUID(), nullable=True))
    op.create_foreign_key(op.f('fk_job_run_dlq_resumed_run_id_job_queue'), 'job_run_dlq', 'job_queue',
                          ['resumed_run_id'], ['id'], ondelete='SET NULL')
    op.execute(RECORD_EVENTS)
    op.execute(ON_RUN_SETTLED)


def downgrade() -> None:
    op.execute("DROP TRIGGER motir_run_settled ON job_queue")
    op.execute("DROP FUNCTION motir_on_run_settled()")
    op.execute(f"DROP FUNCTION {RECORD_EVENTS_SIGNATURE}")
    op.drop_constraint(op.f('fk_job_run_dlq_resumed_run_id_job_queue'), 'job_run_dlq', type_='foreignkey')
    op.drop_column('job_run_dlq', 'resumed_run_id')
    op.drop_column('job_run_dlq', 'resumed_by')
    op.drop_column('job_run_dlq', 'resumed_at')
    op.drop_constraint(op.f('uq_job_queue_parent_run_id_parent_step_id'), 'job_queue', type_='unique')
    op.drop_constraint(op.f('fk_job_queue_parent_run_id_job_queue'), 'job_queue', type_='foreignkey')
    op.drop_column('job_queue', 'detached')
    op.drop_column('job_queue', 'parent_step_id')
    op.drop_column('job_queue', 'parent_run_id')
