"""overlap skip: job_queue.skip_overlap and its partial unique index

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 16:02:44.535878
"""
import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

# ADD COLUMN ... NOT NULL DEFAULT false is catalog-only on PostgreSQL >= 11 (no
# table rewrite). The index covers no existing row (none has skip_overlap set)
# but CREATE INDEX still scans job_queue once and blocks writes to it meanwhile:
# on a very large queue, run this revision at a quiet moment.


def upgrade() -> None:
    op.add_column('job_queue', sa.Column('skip_overlap', sa.Boolean(), server_default=sa.text('false'), nullable=False))
    op.create_index('uq_job_queue_skip_overlap_active', 'job_queue', ['job_id'], unique=True, postgresql_where=sa.text("skip_overlap AND state IN ('queued', 'running')"))


def downgrade() -> None:
    op.drop_index('uq_job_queue_skip_overlap_active', table_name='job_queue', postgresql_where=sa.text("skip_overlap AND state IN ('queued', 'running')"))
    op.drop_column('job_queue', 'skip_overlap')
