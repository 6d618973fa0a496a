"""durable canvas: a woken parent is marked unsent; an index of the unfinished children

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-10 10:00:00.000000

Issue 27. Expand only: one function body replaced, one index added. The previous release
keeps working against it: its code never reads the mark, and reads the index through the
planner only.

* ``motir_on_run_settled`` (the trigger ``motir_run_settled``, 0006): a parent woken by its
  last child's settle is made due as before, and now marked *never sent* (``dispatched_at =
  '-infinity'``). Whoever settled the child claims that mark and publishes the parent after
  its commit (``worker_sql.claim_wakes``: the worker's settle, the sweeper's reclaim, an
  operator's cancel — one of them); a settle made anywhere else (a ``cancel_on`` event, SQL
  by hand) is published by the very next sweep, not ``MOTIR_REPUBLISH_AFTER`` later. Before,
  a parent whose child an operator cancelled waited 69.7 s for its message with the defaults.
* ``ix_job_queue_unfinished_children`` on ``(parent_run_id)`` where a child is queued or
  running: the trigger's "is any child of this parent unfinished?" (run by every child's
  settle, under the parent's lock) and a canvas run's own check read only the unfinished
  children. Through the unique index on (parent_run_id, parent_step_id) they read every
  finished sibling first: quadratic over a chord of 10,000 (measured in docs/jobs.md, Canvas).

Functions and triggers are not compared by ``alembic check``: this revision is the body's one
source, and ``store/routines.py`` declares its digest (``motir migrate --check``).
"""
from alembic import context, op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None

ON_RUN_SETTLED = """
CREATE OR REPLACE FUNCTION motir_on_run_settled() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.state = 'cancelled' THEN
    -- Cancelling a run cancels its unfinished children (each fires this trigger: grandchildren too).
    WITH kids AS (
      UPDATE job_queue
      SET state = 'cancelled', finished_at = now(), claim_token = NULL, lease_expires_at = NULL,
          wait_event = NULL
      WHERE parent_run_id = NEW.id                   -- ix_job_queue_unfinished_children
        AND state IN ('queued', 'running')           -- a finished child stays as it ended
        AND NOT detached                             -- step.invoke(..., detach=True): outlives its parent
      RETURNING id
    )
    UPDATE job_run r SET outcome = 'cancelled', finished_at = now()
    FROM kids WHERE r.run_id = kids.id AND r.outcome = 'running';
  END IF;
  IF NEW.parent_run_id IS NOT NULL THEN
    -- Serialises the children of one parent settling at once, and the parent's own
    -- "are my children done? else suspend" (core/worker/invoke.py takes the same lock): the
    -- UPDATE below takes its snapshot after the lock, so the last child to settle sees
    -- every sibling final, and a parent that checked before this child settled is
    -- already suspended when this runs.
    PERFORM pg_advisory_xact_lock(hashtextextended('motir.parent:' || NEW.parent_run_id::text, 0));
    UPDATE job_queue p
    SET run_at = now(),                              -- due now
        dispatched_at = '-infinity'                  -- and never sent: claimed by whoever settled the
                                                     -- child (claim_wakes), else the next sweep sends it
    WHERE p.id = NEW.parent_run_id
      AND p.state = 'queued'                         -- suspended (a running parent checks for itself)
      AND p.wait_event = 'motir.children'            -- waiting for its children, not sleeping
      AND NOT EXISTS (SELECT 1 FROM job_queue c      -- resumed once: when its last child settles
                      WHERE c.parent_run_id = NEW.parent_run_id AND c.state IN ('queued', 'running'));
  END IF;
  RETURN NULL;
END
$$;
"""


def upgrade() -> None:
    op.execute(ON_RUN_SETTLED)
    op.execute("CREATE INDEX ix_job_queue_unfinished_children ON job_queue (parent_run_id) "
               "WHERE parent_run_id IS NOT NULL AND state IN ('queued', 'running')")


def downgrade() -> None:
    op.execute("DROP INDEX ix_job_queue_unfinished_children")
    # The body 0006 created, from that revision's own text (frozen); the trigger itself stays.
    m6 = context.script.get_revision("0006").module
    body = m6.ON_RUN_SETTLED.split("CREATE TRIGGER", 1)[0]
    op.execute(body.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1))
