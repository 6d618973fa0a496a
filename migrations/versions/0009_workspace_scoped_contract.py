"""contract: keys are per workspace only, and the app role writes through the checked functions only

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01 20:40:00.000000

Issue 24, the contract half of 0008. Run it once no process of the release before
0008's is left (docs/operations.md, "Deploy order"): that release names
``(name, idempotency_key)`` in ``ON CONFLICT`` and inserts rows as the app role.

* ``uq_job_event_name_idempotency_key`` (one key per event name across every
  workspace) and ``uq_job_queue_singleton_active`` (one active singleton per job
  across every workspace) go; 0008's per-workspace indexes decide alone.
* ``motir_app`` loses INSERT on ``job_event`` and ``job_queue``: it reads, and writes
  only through ``motir_enqueue_event`` / ``_events`` / ``_direct``.
* ``motir_wake_waiters`` (0005) goes: nothing calls it since 0008.
"""
from alembic import op
from sqlalchemy import text

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None

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


def upgrade() -> None:
    op.drop_constraint('uq_job_event_name_idempotency_key', 'job_event', type_='unique')
    op.drop_index('uq_job_queue_singleton_active', table_name='job_queue')
    op.execute("REVOKE INSERT ON job_event, job_queue FROM motir_app")
    op.execute("DROP FUNCTION motir_wake_waiters(text, jsonb)")


def downgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute(WAKE_WAITERS.format(schema=schema))
    op.execute("GRANT INSERT ON job_event, job_queue TO motir_app")
    op.create_index('uq_job_queue_singleton_active', 'job_queue', ['job_id', 'singleton_key'], unique=True,
                    postgresql_where=text("singleton_key IS NOT NULL AND state IN ('queued', 'running')"))
    op.create_unique_constraint('uq_job_event_name_idempotency_key', 'job_event', ['name', 'idempotency_key'])
