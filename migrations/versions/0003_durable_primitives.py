"""durable primitives: priority, singleton, concurrency, waits, deferrals, tracing; retention index

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 16:19:12.283945
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

OUTCOMES_0001 = "outcome IN ('running', 'succeeded', 'retrying', 'failed', 'cancelled', 'lost')"
OUTCOMES_0003 = ("outcome IN ('running', 'succeeded', 'retrying', 'failed', 'cancelled', 'lost', "
                 "'suspended', 'deferred')")


def upgrade() -> None:
    op.add_column('job_queue', sa.Column('priority', sa.SmallInteger(), server_default='0', nullable=False))
    op.add_column('job_queue', sa.Column('singleton_key', sa.Text(), nullable=True))
    op.add_column('job_queue', sa.Column('concurrency_key', sa.Text(), nullable=True))
    op.add_column('job_queue', sa.Column('cancel_key', sa.Text(), nullable=True))
    op.add_column('job_queue', sa.Column('wait_event', sa.Text(), nullable=True))
    op.add_column('job_queue', sa.Column('wait_path', postgresql.ARRAY(sa.Text()), nullable=True))
    op.add_column('job_queue', sa.Column('wait_value', sa.Text(), nullable=True))
    op.add_column('job_queue', sa.Column('deferrals', sa.Integer(), server_default='0', nullable=False))
    op.add_column('job_queue', sa.Column('traceparent', sa.Text(), nullable=True))
    op.create_index('ix_job_queue_concurrency_running', 'job_queue', ['concurrency_key', 'job_id'], unique=False, postgresql_where=sa.text("concurrency_key IS NOT NULL AND state = 'running'"))
    op.create_index('ix_job_queue_waiting', 'job_queue', ['wait_event'], unique=False, postgresql_where=sa.text('wait_event IS NOT NULL'))
    op.create_index('uq_job_queue_singleton_active', 'job_queue', ['job_id', 'singleton_key'], unique=True, postgresql_where=sa.text("singleton_key IS NOT NULL AND state IN ('queued', 'running')"))
    # Suspended and deferred attempts are not charged, so an attempt number can
    # repeat in the ledger: uniqueness moves to "one open attempt per run".
    op.drop_constraint(op.f('uq_job_run_run_id_attempt'), 'job_run', type_='unique')
    op.create_index('uq_job_run_open', 'job_run', ['run_id'], unique=True, postgresql_where=sa.text("outcome = 'running'"))
    op.create_index('ix_job_run_ledger', 'job_run', ['run_id', 'started_at'], unique=False)
    op.create_index('ix_job_queue_stale', 'job_queue', ['dispatched_at'], unique=False, postgresql_where=sa.text("state = 'queued'"))
    op.create_index('ix_job_queue_finished', 'job_queue', ['finished_at'], unique=False, postgresql_where=sa.text('finished_at IS NOT NULL'))
    # Check constraints are not compared by autogenerate: written by hand, from
    # the same tuples the models use.
    op.create_check_constraint(op.f('ck_job_queue_priority'), 'job_queue', 'priority BETWEEN 0 AND 9')
    op.drop_constraint(op.f('ck_job_run_outcome'), 'job_run', type_='check')
    op.create_check_constraint(op.f('ck_job_run_outcome'), 'job_run', OUTCOMES_0003)


def downgrade() -> None:
    op.drop_index('ix_job_queue_stale', table_name='job_queue', postgresql_where=sa.text("state = 'queued'"))
    op.drop_index('ix_job_queue_finished', table_name='job_queue', postgresql_where=sa.text('finished_at IS NOT NULL'))
    op.drop_index('ix_job_run_ledger', table_name='job_run')
    op.drop_index('uq_job_run_open', table_name='job_run', postgresql_where=sa.text("outcome = 'running'"))
    op.create_unique_constraint(op.f('uq_job_run_run_id_attempt'), 'job_run', ['run_id', 'attempt'])
    op.drop_constraint(op.f('ck_job_run_outcome'), 'job_run', type_='check')
    op.create_check_constraint(op.f('ck_job_run_outcome'), 'job_run', OUTCOMES_0001)
    op.drop_constraint(op.f('ck_job_queue_priority'), 'job_queue', type_='check')
    op.drop_index('uq_job_queue_singleton_active', table_name='job_queue', postgresql_where=sa.text("singleton_key IS NOT NULL AND state IN ('queued', 'running')"))
    op.drop_index('ix_job_queue_waiting', table_name='job_queue', postgresql_where=sa.text('wait_event IS NOT NULL'))
    op.drop_index('ix_job_queue_concurrency_running', table_name='job_queue', postgresql_where=sa.text("concurrency_key IS NOT NULL AND state = 'running'"))
    op.drop_column('job_queue', 'traceparent')
    op.drop_column('job_queue', 'deferrals')
    op.drop_column('job_queue', 'wait_value')
    op.drop_column('job_queue', 'wait_path')
    op.drop_column('job_queue', 'wait_event')
    op.drop_column('job_queue', 'cancel_key')
    op.drop_column('job_queue', 'concurrency_key')
    op.drop_column('job_queue', 'singleton_key')
    op.drop_column('job_queue', 'priority')
