"""a direct run whose key is a UUID (Celery's task id) gets it as its run id (expand only)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-08 10:00:00.000000

Issue 26, the cut-over. ``motir_write_direct`` (0008's writer of a direct run; the
engine role's, and the app role's through ``motir_enqueue_direct``) now makes the run's
id the call's idempotency key when that key is a UUID in its canonical form — Celery's
task id: ``apply_async(task_id=...)``, or the id of a message in Celery's own protocol
that a worker adopts — so ``AsyncResult(<task id>)`` finds the run. A key that is not a
UUID, or none, leaves the id to ``gen_random_uuid()`` as before. When that id is already
another run's (the same task id given to another job, or in another workspace: keys are
per job and workspace, run ids are not), the run gets a fresh id instead, in the same
statement: the event's key, not the run id, is what deduplicates.

Only the body changes, and the signature, the checked function and the dispatcher
stay: the previous release calls the same function and reads the run id the statement
returns, so it keeps working against this schema (nothing to contract later).
"""
from alembic import context, op
from sqlalchemy import text

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None

DIRECT_ARGS = ("p_name text, p_data jsonb, p_workspace_id text, p_key text, p_eta timestamptz, "
               "p_countdown float8, p_job_id text, p_max_attempts int, p_policy text, p_priority smallint, "
               "p_singleton text, p_concurrency text, p_cancel_key text, p_traceparent text, p_after float8")
DIRECT_RESULT = "TABLE (event_id uuid, run_id uuid, due_in float8)"

WRITE_DIRECT = f"""
CREATE OR REPLACE FUNCTION motir_write_direct({DIRECT_ARGS})
RETURNS {DIRECT_RESULT}
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = {{schema}}, pg_temp AS $$
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
    SELECT coalesce(p_eta, now() + make_interval(secs => p_countdown)) AS run_at,
           -- a key that is a canonical UUID (Celery's task id) is the run's id: AsyncResult(task_id)
           CASE WHEN p_key ~* '^[0-9a-f]{{8}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{12}}$'
                THEN CAST(p_key AS uuid) END AS wanted
  ), chosen AS (
    INSERT INTO job_queue (id, event_id, job_id, event_name, workspace_id, max_attempts, retry_policy, priority,
                           singleton_key, concurrency_key, cancel_key, traceparent, run_at, dispatched_at)
    SELECT coalesce(due.wanted, gen_random_uuid()), e.id, p_job_id, e.name, e.workspace_id, p_max_attempts,
           p_policy, p_priority, p_singleton, p_concurrency, p_cancel_key, p_traceparent, due.run_at,
           -- due later than republish_after: no message now, the sweeper publishes it once due
           -- ("message older than republish_after" then holds at run_at); else published now.
           greatest(now(), due.run_at - make_interval(secs => p_after))
    FROM e, due
    -- No conflict target: one run per (event, job), one active run per (job, workspace, singleton
    -- key), and a wanted id that is already another run's.
    ON CONFLICT DO NOTHING
    RETURNING id, run_at
  ), fresh AS (
    -- The wanted id was refused: if by another run holding that id, this run takes a fresh one
    -- (a refusal by the singleton key refuses this INSERT too).
    INSERT INTO job_queue (event_id, job_id, event_name, workspace_id, max_attempts, retry_policy, priority,
                           singleton_key, concurrency_key, cancel_key, traceparent, run_at, dispatched_at)
    SELECT e.id, p_job_id, e.name, e.workspace_id, p_max_attempts, p_policy, p_priority,
           p_singleton, p_concurrency, p_cancel_key, p_traceparent, due.run_at,
           greatest(now(), due.run_at - make_interval(secs => p_after))
    FROM e, due
    WHERE due.wanted IS NOT NULL            -- only a wanted id can have been refused for being taken
      AND NOT EXISTS (SELECT 1 FROM chosen)  -- and only when the first INSERT wrote nothing
    ON CONFLICT DO NOTHING
    RETURNING id, run_at
  ), runs AS (
    SELECT id, run_at FROM chosen UNION ALL SELECT id, run_at FROM fresh
  )
  SELECT e.id, runs.id,
         -- seconds until due by the database's clock: the Celery countdown of its message
         extract(epoch FROM runs.run_at - now())::float8
  FROM e LEFT JOIN runs ON true
$$
"""


def upgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    # CREATE OR REPLACE keeps the function's owner, its grants (EXECUTE for motir_engine only)
    # and the callers bound to it (motir_enqueue_direct, motir_direct_run).
    op.execute(WRITE_DIRECT.replace("{schema}", schema))


def downgrade() -> None:
    # The body 0008 created, from that revision's own text (frozen).
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    m8 = context.script.get_revision("0008").module
    op.execute(m8.WRITE_DIRECT.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
               .replace("{schema}", schema))
