"""who goes next: quotas as rows (job_quota), the fleet's in-flight limit (job_admission), the held runs' indexes (expand only)

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-20 10:00:00.000000

Issue 46. A run is *held* when admission keeps its message back: it stays ``queued`` with
``dispatched_at = 'infinity'`` (no message sent), until the dispatcher chooses it
(core/admission.py). Nothing else changes shape.

* ``job_quota``: one row per workspace (``workspace_id`` NULL: the system runs, one more
  workspace), its ``weight`` (its share of the in-flight runs while others wait) and
  ``max_running`` (its cap, NULL: none). Row-level security as on every table with a
  ``workspace_id``: the app role reads its own workspace's row, the engine role (operator
  actions: ``motir quota set``) writes.
* ``job_admission``: the fleet's in-flight limit, one row ``'fleet'``. No row: admission is off
  and every run is published at once, as before this revision. Engine role only.
* ``ix_job_queue_held``: the held runs of each workspace, most urgent then oldest first (the
  dispatcher's heads); ``ix_job_queue_in_flight``: a workspace's runs in flight (queued with a
  message, or running), to count them against its cap and weight. Both built ``CONCURRENTLY``.

Rolling-deploy safe (expand only): the previous release never reads the two tables, and no run is
held until an operator inserts the ``'fleet'`` row, which they do once every process runs this
release (docs/fair-share.md, "Turning it on"). Even a held run is safe under the previous release:
its sweeper re-publishes a queued run whose ``dispatched_at`` is older than ``republish_after``,
which ``'infinity'`` never is, so it leaves held runs alone rather than sending them twice — and
its claim reads no new column. A rollback (downgrade) first deletes the ``'fleet'`` row and
releases held runs (``dispatched_at = now() - interval '1 day'``) so the previous sweeper sends them.
"""
from alembic import op

revision = '0021'
down_revision = '0020'
branch_labels = None
depends_on = None

# As 0005 left the tables' policies (0001's names, 0005's admin arm).
PREDICATE = ("(workspace_id = current_setting('motir.workspace_id', true)) "
             "OR ((current_setting('motir.system_admin', true) = 'true') "
             "AND pg_has_role(current_user, 'motir_admin', 'MEMBER'))")

TABLES = """
CREATE TABLE job_quota (
  id bigint GENERATED ALWAYS AS IDENTITY,
  workspace_id text,
  weight integer NOT NULL DEFAULT 1,
  max_running integer,
  updated_at timestamptz NOT NULL DEFAULT now(),
  updated_by text,
  CONSTRAINT pk_job_quota PRIMARY KEY (id),
  CONSTRAINT ck_job_quota_weight CHECK (weight BETWEEN 1 AND 1000),
  CONSTRAINT ck_job_quota_max_running CHECK (max_running >= 1)
);
CREATE UNIQUE INDEX uq_job_quota_workspace ON job_quota ((coalesce(workspace_id, '')));
CREATE TABLE job_admission (
  name text NOT NULL,
  max_in_flight integer NOT NULL,
  updated_at timestamptz NOT NULL DEFAULT now(),
  updated_by text,
  CONSTRAINT pk_job_admission PRIMARY KEY (name),
  CONSTRAINT ck_job_admission_max_in_flight CHECK (max_in_flight >= 1)
);
"""

QUEUE_INDEXES = {
    "ix_job_queue_held": "CREATE INDEX CONCURRENTLY ix_job_queue_held ON job_queue "
                         "((coalesce(workspace_id, '')), priority DESC, created_at) "
                         "WHERE dispatched_at = 'infinity'::timestamptz AND (state = 'queued') IS TRUE",
    "ix_job_queue_in_flight": "CREATE INDEX CONCURRENTLY ix_job_queue_in_flight ON job_queue "
                              "((coalesce(workspace_id, '')), dispatched_at) "
                              "WHERE (state IN ('queued', 'running')) IS TRUE",
}


def upgrade() -> None:
    op.execute(TABLES)
    op.execute("GRANT SELECT ON job_quota TO motir_app")
    op.execute("GRANT SELECT, INSERT, UPDATE, DELETE ON job_quota TO motir_engine")
    op.execute("ALTER TABLE job_quota ENABLE ROW LEVEL SECURITY")
    op.execute(f"CREATE POLICY job_quota_workspace ON job_quota AS PERMISSIVE FOR ALL TO motir_app "
               f"USING ({PREDICATE}) WITH CHECK ({PREDICATE})")
    op.execute("CREATE POLICY job_quota_engine ON job_quota AS PERMISSIVE FOR ALL TO motir_engine "
               "USING (true) WITH CHECK (true)")
    op.execute("GRANT SELECT, INSERT, UPDATE, DELETE ON job_admission TO motir_engine")
    # Outside the transaction: CONCURRENTLY builds never block the previous release's writes.
    with op.get_context().autocommit_block():
        for name, sql in QUEUE_INDEXES.items():
            op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")  # an INVALID leftover of a failed build
            op.execute(sql)


def downgrade() -> None:
    # Nothing held is left behind: the previous release's sweeper sends these at its next pass.
    op.execute("DELETE FROM job_admission")
    op.execute("UPDATE job_queue SET dispatched_at = now() - interval '1 day' "
               "WHERE dispatched_at = 'infinity'::timestamptz AND state = 'queued'")
    for name in QUEUE_INDEXES:
        op.execute(f"DROP INDEX IF EXISTS {name}")
    op.execute("DROP TABLE job_admission")
    op.execute("DROP TABLE job_quota")
