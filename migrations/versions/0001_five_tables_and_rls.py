"""the five tables and their row-level security

Revision ID: 0001
Revises: 
Create Date: 2026-11-29 15:51:38.997051
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# Roles, grants, ENABLE and the two policies per table, as this revision made them.
# Frozen here (it once read motir_celery.store.rls at run time): a revision must
# produce the same schema whatever the package says today. 0005 narrows the app
# role's grants and puts the admin arm behind membership in motir_admin.
RLS_TABLES = ['job_event', 'job_queue', 'job_step', 'job_run', 'job_run_dlq']
ROLES = ('motir_app', 'motir_engine')
WORKSPACE_PREDICATE = (
    "(workspace_id = current_setting('motir.workspace_id', true)) "
    "OR (current_setting('motir.system_admin', true) = 'true')"
)

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('job_event',
    sa.Column('id', sa.UUID(), server_default=sa.text('gen_random_uuid()'), nullable=False),
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('data', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('workspace_id', sa.Text(), nullable=True),
    sa.Column('idempotency_key', sa.Text(), nullable=True),
    sa.Column('received_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_job_event')),
    sa.UniqueConstraint('name', 'idempotency_key', name=op.f('uq_job_event_name_idempotency_key'))
    )
    op.create_table('job_queue',
    sa.Column('id', sa.UUID(), server_default=sa.text('gen_random_uuid()'), nullable=False),
    sa.Column('job_id', sa.Text(), nullable=False),
    sa.Column('event_id', sa.UUID(), nullable=True),
    sa.Column('event_name', sa.Text(), nullable=False),
    sa.Column('workspace_id', sa.Text(), nullable=True),
    sa.Column('scheduled_for', sa.DateTime(timezone=True), nullable=True),
    sa.Column('state', sa.Text(), server_default='queued', nullable=False),
    sa.Column('run_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
    sa.Column('max_attempts', sa.Integer(), nullable=False),
    sa.Column('retry_policy', sa.Text(), nullable=False),
    sa.Column('claim_token', sa.UUID(), nullable=True),
    sa.Column('claimed_by', sa.Text(), nullable=True),
    sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('dispatched_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('result', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("state IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')", name=op.f('ck_job_queue_state')),
    sa.CheckConstraint('attempts >= 0 AND max_attempts >= 1', name=op.f('ck_job_queue_attempts')),
    sa.ForeignKeyConstraint(['event_id'], ['job_event.id'], name=op.f('fk_job_queue_event_id_job_event'), ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_job_queue')),
    sa.UniqueConstraint('event_id', 'job_id', name=op.f('uq_job_queue_event_id_job_id')),
    sa.UniqueConstraint('job_id', 'scheduled_for', name=op.f('uq_job_queue_job_id_scheduled_for'))
    )
    op.create_index('ix_job_queue_due', 'job_queue', ['run_at'], unique=False, postgresql_where=sa.text("state = 'queued'"))
    op.create_index(op.f('ix_job_queue_job_id_created_at'), 'job_queue', ['job_id', 'created_at'], unique=False)
    op.create_index('ix_job_queue_leases', 'job_queue', ['lease_expires_at'], unique=False, postgresql_where=sa.text("state = 'running'"))
    op.create_table('job_run',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=True), nullable=False),
    sa.Column('run_id', sa.UUID(), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('workspace_id', sa.Text(), nullable=True),
    sa.Column('job_id', sa.Text(), nullable=False),
    sa.Column('event_name', sa.Text(), nullable=False),
    sa.Column('worker', sa.Text(), nullable=False),
    sa.Column('outcome', sa.Text(), server_default='running', nullable=False),
    sa.Column('error', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("outcome IN ('running', 'succeeded', 'retrying', 'failed', 'cancelled', 'lost')", name=op.f('ck_job_run_outcome')),
    sa.ForeignKeyConstraint(['run_id'], ['job_queue.id'], name=op.f('fk_job_run_run_id_job_queue'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_job_run')),
    sa.UniqueConstraint('run_id', 'attempt', name=op.f('uq_job_run_run_id_attempt'))
    )
    op.create_table('job_run_dlq',
    sa.Column('id', sa.UUID(), server_default=sa.text('gen_random_uuid()'), nullable=False),
    sa.Column('run_id', sa.UUID(), nullable=True),
    sa.Column('workspace_id', sa.Text(), nullable=True),
    sa.Column('function_id', sa.Text(), nullable=False),
    sa.Column('event_id', sa.UUID(), nullable=True),
    sa.Column('event_name', sa.Text(), nullable=False),
    sa.Column('event_data', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('idempotency_key', sa.Text(), nullable=True),
    sa.Column('failure', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('first_failed_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_failed_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('replayed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('replayed_by', sa.Text(), nullable=True),
    sa.Column('replay_run_id', sa.UUID(), nullable=True),
    sa.Column('dismissed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('dismissed_by', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['replay_run_id'], ['job_queue.id'], name=op.f('fk_job_run_dlq_replay_run_id_job_queue'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['run_id'], ['job_queue.id'], name=op.f('fk_job_run_dlq_run_id_job_queue'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_job_run_dlq')),
    sa.UniqueConstraint('run_id', name=op.f('uq_job_run_dlq_run_id'))
    )
    op.create_index('ix_job_run_dlq_recent', 'job_run_dlq', ['workspace_id', sa.literal_column('last_failed_at DESC')], unique=False)
    op.create_table('job_step',
    sa.Column('run_id', sa.UUID(), nullable=False),
    sa.Column('step_id', sa.Text(), nullable=False),
    sa.Column('workspace_id', sa.Text(), nullable=True),
    sa.Column('output', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('completed_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['job_queue.id'], name=op.f('fk_job_step_run_id_job_queue'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'step_id', name=op.f('pk_job_step'))
    )
    # Roles are the cluster's, not the database's: two databases migrated at once (a test session
    # each, or a tenant database each) both find a role missing, and the second CREATE waits for the
    # first and fails on the name. It was made a moment ago, as asked: that error is not one.
    op.execute("\n".join(
        f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') "
        f"THEN CREATE ROLE {role} NOLOGIN; END IF; "
        f"EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$;"
        for role in ROLES
    ))
    for table in RLS_TABLES:
        op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO motir_app, motir_engine")
        op.execute(f"ALTER TABLE {table} ENABLE ROW LEVEL SECURITY")
    for table in RLS_TABLES:
        for name, role, predicate in ((f"{table}_workspace", "motir_app", WORKSPACE_PREDICATE),
                                      (f"{table}_engine", "motir_engine", "true")):
            op.execute(f"CREATE POLICY {name} ON {table} AS PERMISSIVE FOR ALL TO {role} "
                       f"USING ({predicate}) WITH CHECK ({predicate})")


def downgrade() -> None:
    op.drop_table('job_step')
    op.drop_index('ix_job_run_dlq_recent', table_name='job_run_dlq')
    op.drop_table('job_run_dlq')
    op.drop_table('job_run')
    op.drop_index('ix_job_queue_leases', table_name='job_queue', postgresql_where=sa.text("state = 'running'"))
    op.drop_index(op.f('ix_job_queue_job_id_created_at'), table_name='job_queue')
    op.drop_index('ix_job_queue_due', table_name='job_queue', postgresql_where=sa.text("state = 'queued'"))
    op.drop_table('job_queue')
    op.drop_table('job_event')
