"""the next run of a concurrency key, found in its order through an index of its own (expand only)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-16 10:00:00.000000

Issue 28. When a run of a ``concurrency=`` job frees its slot, ``next_in_line`` picks the
key's queued, due run of the highest priority, oldest first, and sends it. No index served
that order: Postgres read every due queued run (``ix_job_queue_due``), kept the key's and
sorted them, at every settle of such a run (20,000 queued: 20 ms a settle, growing with the
backlog). This index holds the queued runs of each (job, key) in that order, so the pick
reads the first one or few. Its state is written ``(state = 'queued') IS TRUE`` as
``next_in_line`` writes it (store/sql/worker.py says why: that form proves no index of a
state alone). Only runs with a key are in it.

Expand only: a new index, built ``CONCURRENTLY``; the previous release's ``next_in_line``
does not use it (it checks ``state = 'queued'``) and runs as before.
"""
from alembic import op

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None

INDEX = "ix_job_queue_concurrency_queued"


def upgrade() -> None:
    with op.get_context().autocommit_block():  # CONCURRENTLY: never blocks the previous release's writes
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {INDEX}")  # an INVALID leftover of a failed build
        op.execute(f"CREATE INDEX CONCURRENTLY {INDEX} ON job_queue (job_id, concurrency_key, priority DESC, run_at) "
                   "WHERE concurrency_key IS NOT NULL AND (state = 'queued') IS TRUE")


def downgrade() -> None:
    op.execute(f"DROP INDEX IF EXISTS {INDEX}")
