"""progress and streams: a running run's latest progress, its streams' items, the functions followers LISTEN with (expand)

Revision ID: 0019
Revises: 0017
Create Date: 2026-12-19 10:00:00.000000

Issue 45. Expand only: two new tables and two new functions; nothing the previous release
reads or writes changes. (Re-chained by whoever merges 0018 and 0020 beside it.)

* ``job_progress``: one row per run that reported progress (``step.progress``, a durable Celery
  task's ``self.update_state``) or wrote to a stream: its latest progress state and meta, the
  attempt that wrote them, the names of its streams and their totals (items, bytes), which bound
  what one run may store. The primary key is the run.
* ``job_stream_item``: one row per item of a run's stream, keyed ``(run_id, stream, position)``;
  the position is derived from where the item was written (the step and its order: a re-run
  writes the same positions again, overwriting, never appending).
* Both cascade from ``job_queue`` (purged with their run) and carry ``workspace_id``: row-level
  security as on the other tables (the app role reads its workspace's; the engine role writes).
* ``motir_listen(uuid)`` / ``motir_unlisten(uuid)``: LISTEN / UNLISTEN on the channel of one run's
  streams and progress (``motir_s_<run id in hex>``), for followers; the name is derived from a
  uuid, so no caller chooses an identifier. Writers notify it with ``pg_notify``. Functions are
  not compared by ``alembic check``: this revision is their one source.

Rolling deploy, and how it was checked: the previous release's workers, producers and dashboard
never name the new tables or functions, and this revision changes nothing they do name — no
column, index, function or policy of 0017 is altered or dropped, which
tests/store/test_migrations.py (``test_0019_is_expand_only...``) checks on a database migrated
to 0017 with runs in it, before and after this revision and after its downgrade. The worker path's
statements (claim, step record, settle) are the same in both releases. The new release needs this
revision first (its result reads join ``job_progress``): migrate, then roll the code, as for every
expand revision here. A run that a new worker streams and an old one re-runs after a crash keeps
the new worker's items (the old one writes none). Downgrade drops the tables (the progress and the
stream items with them) and the functions.
"""
from alembic import op

revision = '0019'
down_revision = '0017'
branch_labels = None
depends_on = None

TABLES = """
CREATE TABLE job_progress (
  run_id uuid NOT NULL,
  workspace_id text,
  state text,
  meta jsonb,
  attempt integer NOT NULL,
  updated_at timestamptz NOT NULL DEFAULT now(),
  streams text[] NOT NULL DEFAULT '{}',
  stream_items integer NOT NULL DEFAULT 0,
  stream_bytes bigint NOT NULL DEFAULT 0,
  CONSTRAINT pk_job_progress PRIMARY KEY (run_id),
  CONSTRAINT fk_job_progress_run_id_job_queue FOREIGN KEY (run_id) REFERENCES job_queue (id) ON DELETE CASCADE
);
CREATE TABLE job_stream_item (
  run_id uuid NOT NULL,
  stream text NOT NULL,
  position bigint NOT NULL,
  workspace_id text,
  item jsonb NOT NULL,
  bytes integer NOT NULL,
  attempt integer NOT NULL,
  CONSTRAINT pk_job_stream_item PRIMARY KEY (run_id, stream, position),
  CONSTRAINT fk_job_stream_item_run_id_job_queue FOREIGN KEY (run_id) REFERENCES job_queue (id) ON DELETE CASCADE
);
"""

# As 0005 left the five tables' policies (0001's names, 0005's admin arm).
PREDICATE = ("(workspace_id = current_setting('motir.workspace_id', true)) "
             "OR ((current_setting('motir.system_admin', true) = 'true') "
             "AND pg_has_role(current_user, 'motir_admin', 'MEMBER'))")

FUNCTIONS = """
CREATE FUNCTION motir_listen(p_run uuid) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  -- the channel is derived from a uuid: no caller names an identifier
  EXECUTE format('LISTEN %I', 'motir_s_' || replace(p_run::text, '-', ''));
  RETURN true;
END
$$;
CREATE FUNCTION motir_unlisten(p_run uuid) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  EXECUTE format('UNLISTEN %I', 'motir_s_' || replace(p_run::text, '-', ''));
  RETURN true;
END
$$;
"""


def upgrade() -> None:
    op.execute(TABLES)
    for table in ("job_progress", "job_stream_item"):
        op.execute(f"GRANT SELECT ON {table} TO motir_app")
        op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO motir_engine")
        op.execute(f"ALTER TABLE {table} ENABLE ROW LEVEL SECURITY")
        op.execute(f"CREATE POLICY {table}_workspace ON {table} AS PERMISSIVE FOR ALL TO motir_app "
                   f"USING ({PREDICATE}) WITH CHECK ({PREDICATE})")
        op.execute(f"CREATE POLICY {table}_engine ON {table} AS PERMISSIVE FOR ALL TO motir_engine "
                   "USING (true) WITH CHECK (true)")
    op.execute(FUNCTIONS)
    for name in ("motir_listen", "motir_unlisten"):
        op.execute(f"REVOKE ALL ON FUNCTION {name}(uuid) FROM PUBLIC")
        op.execute(f"GRANT EXECUTE ON FUNCTION {name}(uuid) TO motir_app, motir_engine")


def downgrade() -> None:
    op.execute("DROP FUNCTION motir_unlisten(uuid)")
    op.execute("DROP FUNCTION motir_listen(uuid)")
    op.execute("DROP TABLE job_stream_item")
    op.execute("DROP TABLE job_progress")
