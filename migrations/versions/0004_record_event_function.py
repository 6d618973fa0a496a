"""record event in one statement: the function motir_record_event

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 00:45:00.000000

send_event wrote an event as two statements (the event and its runs, then the
wake-up of runs waiting for it) in one psycopg pipeline with BEGIN and COMMIT.
A function does both as one statement, which is its own transaction in
autocommit: 0.4 ms less per send at low load, where an idle client and server
pay for every statement in wake-ups (docs/performance.md). queue.record_event
calls it.

The wake-up still needs a snapshot of its own, taken after the shared advisory
lock on the event name is granted (step.wait_for_event's race, queue.lock_wait):
a VOLATILE function takes a fresh snapshot for every query it runs, so the
second RETURN QUERY sees every waiter that committed while the first waited for
the lock. SECURITY INVOKER (the default): row-level security applies to the
caller, as it did to the two statements.
"""
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

RECORD_EVENT = """
CREATE FUNCTION motir_record_event(
    p_name text, p_data jsonb, p_workspace_id text, p_key text, p_traceparent text,
    p_job_ids text[], p_max_attempts int[], p_policies text[], p_priorities smallint[],
    p_singletons text[], p_concurrency text[], p_cancel_keys text[])
RETURNS TABLE (woken boolean, event_id uuid, run_id uuid, job_id text)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
  -- The event and one run per job (the rows of p_job_ids...): (false, event, run, job),
  -- a row with no run when no job subscribes or every run already exists.
  RETURN QUERY
    WITH e AS (
      INSERT INTO job_event (name, data, workspace_id, idempotency_key)
      SELECT p_name, p_data, p_workspace_id, p_key
      -- A shared lock on the event name, held to commit: a run that starts waiting
      -- for this name takes it exclusively before its look-back, so it either sees
      -- this event or is seen by the wake-up below.
      FROM (SELECT pg_advisory_xact_lock_shared(hashtext('motir.wait:' || p_name))) AS wait_fence
      -- (name, idempotency_key) is unique; NULL keys never conflict. A conflict
      -- returns no row here, so no run either.
      ON CONFLICT (name, idempotency_key) DO NOTHING
      RETURNING id, name, workspace_id
    ), runs AS (
      INSERT INTO job_queue AS q (event_id, job_id, event_name, workspace_id, max_attempts, retry_policy,
                                  priority, singleton_key, concurrency_key, cancel_key, traceparent)
      SELECT e.id, s.job_id, e.name, e.workspace_id, s.max_attempts, s.retry_policy,
             s.priority, s.singleton_key, s.concurrency_key, s.cancel_key, p_traceparent
      FROM e, unnest(p_job_ids, p_max_attempts, p_policies, p_priorities, p_singletons, p_concurrency,
                     p_cancel_keys)
             AS s(job_id, max_attempts, retry_policy, priority, singleton_key, concurrency_key, cancel_key)
      -- No conflict target: one run per (event, job), and one active run per (job, singleton_key).
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
    RETURNING true, NULL::uuid, q.id, q.job_id;
END
$$
"""

SIGNATURE = ("motir_record_event(text, jsonb, text, text, text, text[], int[], text[], smallint[], "
             "text[], text[], text[])")


def upgrade() -> None:
    op.execute(RECORD_EVENT)


def downgrade() -> None:
    op.execute(f"DROP FUNCTION {SIGNATURE}")
