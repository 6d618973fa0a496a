"""sweep slot: one sweep per period across the fleet; indexes purge needs on the DLQ

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 13:00:00.000000

Issue 19. Expand only: one new table with one row. Workers of the previous release
never read it and keep sweeping every period as before; this release's workers take
the row's period before sweeping, so however many hosts run, one sweep does the work
of each period (core/sweeper.py).

* ``job_sweep``: one row per sweep kind (``'fleet'``), ``swept_at`` the database time
  of the last sweep that took the slot, ``swept_by`` its worker. A conditional
  ``UPDATE … WHERE swept_at <= now() - period`` decides: of concurrent sweepers, the
  first updates the row, the rest re-check the new version and update nothing (no
  write, no WAL). The row starts at ``-infinity``: the first sweep always runs.
* Grants: the engine role reads and updates the row, nothing more; the app and
  admin roles get nothing (no tenant data, so no row-level security either).
* ``ix_job_run_dlq_replay_run`` / ``ix_job_run_dlq_resumed_run``: partial indexes on
  the DLQ's two links to ``job_queue`` that had none. Deleting a run (``motir purge``)
  makes Postgres find the rows referencing it (ON DELETE SET NULL); without them it
  read the whole DLQ twice per run: 10 runs/s at 50,000 entries, 2,851 with them
  (docs/scaling.md, "Retention at depth"). Plain CREATE INDEX: it blocks writes to the
  DLQ (failures being recorded) while it builds, well under a second for 50,000 entries.
* The engine role may read ``alembic_version``: ``motir doctor``, run with the
  workers' login, compares it with the head (before, a real engine login was refused
  there: "permission denied for table alembic_version").
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'job_sweep',
        sa.Column('name', sa.Text(), nullable=False),
        sa.Column('swept_at', postgresql.TIMESTAMP(timezone=True), server_default=sa.text("'-infinity'"),
                  nullable=False),
        sa.Column('swept_by', sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint('name', name=op.f('pk_job_sweep')),
    )
    op.execute("INSERT INTO job_sweep (name) VALUES ('fleet')")
    op.execute("GRANT SELECT, UPDATE ON job_sweep TO motir_engine")
    op.execute("GRANT SELECT ON alembic_version TO motir_engine")
    op.create_index('ix_job_run_dlq_replay_run', 'job_run_dlq', ['replay_run_id'], unique=False,
                    postgresql_where=sa.text('replay_run_id IS NOT NULL'))
    op.create_index('ix_job_run_dlq_resumed_run', 'job_run_dlq', ['resumed_run_id'], unique=False,
                    postgresql_where=sa.text('resumed_run_id IS NOT NULL'))


def downgrade() -> None:
    op.drop_index('ix_job_run_dlq_resumed_run', table_name='job_run_dlq')
    op.drop_index('ix_job_run_dlq_replay_run', table_name='job_run_dlq')
    op.execute("REVOKE SELECT ON alembic_version FROM motir_engine")
    op.drop_table('job_sweep')
