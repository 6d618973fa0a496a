"""a cancel_on event finds the runs it cancels through an index of the active runs by key (expand only)

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-17 10:00:00.000000

Issue 28. An event a ``cancel_on`` rule listens to cancels the job's active runs that carry
its key (``cancel_by_key``, inside that ``send_event``). No index had the key: Postgres read
every run of the job, its whole history (200,000 finished runs: 45 ms an event, growing with
the history). This index holds the queued and running runs that have a key, so the lookup reads
the few it cancels. Its state is written ``state IN ('queued', 'running')``, as the statement
writes it and as ``uq_job_queue_singleton`` is: that form proves no index of one state alone,
and no lookup of one state proves it.

Expand only: a new index, built ``CONCURRENTLY``; the previous release's statement is the
same and reads it as soon as it exists. Nothing to contract.
"""
from alembic import op

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None

INDEX = "ix_job_queue_cancel_active"


def upgrade() -> None:
    with op.get_context().autocommit_block():  # CONCURRENTLY: never blocks the previous release's writes
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {INDEX}")  # an INVALID leftover of a failed build
        op.execute(f"CREATE INDEX CONCURRENTLY {INDEX} ON job_queue (job_id, cancel_key) "
                   "WHERE cancel_key IS NOT NULL AND state IN ('queued', 'running')")


def downgrade() -> None:
    op.execute(f"DROP INDEX IF EXISTS {INDEX}")
