"""least privilege: the app role reads and inserts only; the admin arm needs motir_admin

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 10:30:00.000000

Issue 17 (docs/security.md). Expand, then contract, so that workers of the
previous release keep running against this schema while it is applied:

1. expand — the role ``motir_admin`` (NOLOGIN, a member of ``motir_app``);
   ``motir_wake_waiters``, the one UPDATE an app-role transaction still needs
   (send_event(session=…) makes the runs waiting for its event due), as a
   SECURITY DEFINER function that touches nothing but those runs of the
   caller's workspace; ``motir_record_event`` replaced under the same signature
   (the previous release calls it too) so that a caller without UPDATE on
   ``job_queue`` wakes waiters through that function;
2. contract — ``motir_app`` loses UPDATE and DELETE everywhere and INSERT on
   ``job_step``, ``job_run`` and ``job_run_dlq`` (the engine role, which workers
   use, keeps all four); the workspace policies' admin arm is honoured only for
   members of ``motir_admin``.

Everything is stated here, not read from motir_celery.store.rls: a revision is
frozen. Roles are cluster-wide and outlive the schema: created if missing
(concurrent migrations of other databases may race: the loser's error is
swallowed), never dropped by the downgrade.
"""
from alembic import op
from sqlalchemy import text

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None

RLS_TABLES = ['job_event', 'job_queue', 'job_step', 'job_run', 'job_run_dlq']
APP_INSERTS = ['job_event', 'job_queue']

PREDICATE_0001 = (
    "(workspace_id = current_setting('motir.workspace_id', true)) "
    "OR (current_setting('motir.system_admin', true) = 'true')"
)
PREDICATE_0005 = (
    "(workspace_id = current_setting('motir.workspace_id', true)) "
    "OR ((current_setting('motir.system_admin', true) = 'true') "
    "AND pg_has_role(current_user, 'motir_admin', 'MEMBER'))"
)

CREATE_ADMIN_ROLE = """
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'motir_admin') THEN
    CREATE ROLE motir_admin NOLOGIN;
  END IF;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
  NULL;  -- another database's migration created it a moment ago
END $$;
DO $$ BEGIN
  -- motir_admin reads through motir_app's grants and policies (inherited).
  IF NOT pg_has_role('motir_admin', 'motir_app', 'MEMBER') THEN
    GRANT motir_app TO motir_admin;
  END IF;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
  NULL;
END $$;
"""

# The wake-up of send_event for a caller without UPDATE on job_queue. SECURITY
# DEFINER (runs as the owner, which RLS does not filter), so it states the
# filter itself: only the runs of the workspace the caller's transaction is in
# (the GUC that workspace_session sets), only runs suspended waiting for this
# event, only run_at and dispatched_at. That is no more than the caller can do
# by inserting a matching event, which its INSERT grant allows.
WAKE_WAITERS = """
CREATE FUNCTION motir_wake_waiters(p_name text, p_data jsonb)
RETURNS TABLE (run_id uuid, job_id text)
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = {schema}, pg_temp AS $$
  UPDATE job_queue q
  SET run_at = now(), dispatched_at = now()
  WHERE q.wait_event = p_name
    AND q.state = 'queued'
    AND q.wait_value = (p_data #>> q.wait_path)
    AND q.workspace_id = current_setting('motir.workspace_id', true)
  RETURNING q.id, q.job_id
$$;
REVOKE ALL ON FUNCTION motir_wake_waiters(text, jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION motir_wake_waiters(text, jsonb) TO motir_app;
"""

_RECORD_EVENT_HEAD = """
CREATE OR REPLACE FUNCTION motir_record_event(
    p_name text, p_data jsonb, p_workspace_id text, p_key text, p_traceparent text,
    p_job_ids text[], p_max_attempts int[], p_policies text[], p_priorities smallint[],
    p_singletons text[], p_concurrency text[], p_cancel_keys text[])
RETURNS TABLE (woken boolean, event_id uuid, run_id uuid, job_id text)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
  RETURN QUERY
    WITH e AS (
      INSERT INTO job_event (name, data, workspace_id, idempotency_key)
      SELECT p_name, p_data, p_workspace_id, p_key
      FROM (SELECT pg_advisory_xact_lock_shared(hashtext('motir.wait:' || p_name))) AS wait_fence
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
      ON CONFLICT DO NOTHING
      RETURNING q.id, q.job_id
    )
    SELECT false, e.id, runs.id, runs.job_id FROM e LEFT JOIN runs ON true;
  IF NOT FOUND THEN
    RETURN;
  END IF;
"""

_WAKE_0004 = """
  RETURN QUERY
    UPDATE job_queue q
    SET run_at = now(), dispatched_at = now()
    WHERE q.wait_event = p_name
      AND q.state = 'queued'
      AND q.wait_value = (p_data #>> q.wait_path)
    RETURNING true, NULL::uuid, q.id, q.job_id;
END
$$
"""

# The engine (and any role that may UPDATE job_queue) wakes exactly as 0004 did,
# RLS applying to it; the app role goes through motir_wake_waiters.
_WAKE_0005 = """
  IF has_table_privilege('job_queue', 'UPDATE') THEN
    RETURN QUERY
      UPDATE job_queue q
      SET run_at = now(), dispatched_at = now()
      WHERE q.wait_event = p_name
        AND q.state = 'queued'
        AND q.wait_value = (p_data #>> q.wait_path)
      RETURNING true, NULL::uuid, q.id, q.job_id;
  ELSE
    RETURN QUERY SELECT true, NULL::uuid, w.run_id, w.job_id FROM motir_wake_waiters(p_name, p_data) AS w;
  END IF;
END
$$
"""


def _policies(predicate: str) -> None:
    for table in RLS_TABLES:
        op.execute(f"ALTER POLICY {table}_workspace ON {table} USING ({predicate}) WITH CHECK ({predicate})")


def upgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    # --- expand
    op.execute(CREATE_ADMIN_ROLE)
    op.execute(WAKE_WAITERS.format(schema=schema))
    op.execute(_RECORD_EVENT_HEAD + _WAKE_0005)
    # --- contract
    for table in RLS_TABLES:
        op.execute(f"REVOKE UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER ON {table} FROM motir_app")
        if table not in APP_INSERTS:
            op.execute(f"REVOKE INSERT ON {table} FROM motir_app")
    _policies(PREDICATE_0005)


def downgrade() -> None:
    _policies(PREDICATE_0001)
    for table in RLS_TABLES:
        op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO motir_app")
    op.execute(_RECORD_EVENT_HEAD + _WAKE_0004)
    op.execute("DROP FUNCTION motir_wake_waiters(text, jsonb)")
