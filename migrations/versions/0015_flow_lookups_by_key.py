"""flow control's lookups by key read indexes of their own, never a partial index on state alone (expand)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-15 10:00:00.000000

Issue 28, the lookups 0014 left. Three statements find flow control's queued runs by key:
the count of a throttle key's runs waiting ahead (the claim's ``throttle_state``, and
``run_flow`` for the dashboard and CLI), the flow listing (``flow_waiting``), and the open
run of a debounce / batch key in ``motir_write_gather`` (every ``send_event`` to such a
job). Each checked ``state = 'queued'``, which lets the planner read ``ix_job_queue_stale``
or ``ix_job_queue_due`` (every queued run) instead of the key's index; with statistics
taken while nothing was queued it does, and each call scanned the whole backlog (50,000
queued: 9.7 ms a throttled claim's count, 14 ms a gather, against 0.2 and 0.8 analyzed).

The rule of 0014 cannot be applied to the statements alone: the key's indexes had
``state = 'queued'`` in their predicates, which only that form proves. So this revision
builds the two indexes again under new names, with ``(state = 'queued') IS TRUE`` (the
same rows: ``state`` is never NULL), and the statements check that form: it proves these
predicates and no predicate of a state alone. The gather's open run names its kinds too
(``flow_wait IN ('debounce', 'batch')``), so a generic plan of the function proves its
index as well. Its new run, found by id, checks ``(q.event_id IS NOT NULL) IS TRUE``: written
plainly, a history of runs without events had the planner read every event run through
``uq_job_queue_event_id_job_id`` instead of the primary key. The body of ``motir_write_gather``
is 0012's with 0014's line and this revision's lines replaced (asserted).

Expand only: the old indexes stay, so the previous release's statements keep theirs (and
``uq_job_queue_gathering`` its guarantee beside the new one's); a later release drops
``ix_job_queue_throttle_waiting`` and ``uq_job_queue_gathering`` (docs/operations.md).
"""
from alembic import context, op
from sqlalchemy import text

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None

QUEUE_INDEXES = {
    "ix_job_queue_throttle_queued": "CREATE INDEX CONCURRENTLY ix_job_queue_throttle_queued ON job_queue "
                                    "(job_id, throttle_key, created_at) "
                                    "WHERE flow_wait = 'throttle' AND (state = 'queued') IS TRUE",
    "uq_job_queue_gathering_open": "CREATE UNIQUE INDEX CONCURRENTLY uq_job_queue_gathering_open ON job_queue "
                                   "(job_id, workspace_id, flow_key) NULLS NOT DISTINCT "
                                   "WHERE flow_wait IN ('debounce', 'batch') AND (state = 'queued') IS TRUE",
}

#: motir_write_gather's lookups: each line as 0012 left it, and as it becomes.
GATHER_EDITS = (
    # The new run by its id: through the primary key, not uq_job_queue_event_id_job_id's every event
    # run (statistics of a history without events cost them at ~0 rows, as the state's above).
    ("      AND q.event_id IS NOT NULL                      -- an event's run (debounce= / batch= are event jobs)",
     "      AND (q.event_id IS NOT NULL) IS TRUE            -- an event's run (debounce= / batch= are event jobs)"),
    # The key's open run.
    ("      AND q.flow_key = g.key AND q.flow_wait = g.kind AND q.state = 'queued'   -- its open run (uq_job_queue_gathering)",
     "      AND q.flow_key = g.key AND q.flow_wait = g.kind AND (q.state = 'queued') IS TRUE   -- its open run\n"
     "      AND q.flow_wait IN ('debounce', 'batch')        -- uq_job_queue_gathering_open, in a generic plan too"),
)


def _gather_body(forward: bool) -> str:
    """0012's motir_write_gather with 0014's edit, and this revision's when ``forward``."""
    sql = str(context.script.get_revision("0012").module.WRITE_GATHER)
    edits = [*context.script.get_revision("0014").module.EDITS[("0012", "WRITE_GATHER")],
             *(GATHER_EDITS if forward else ())]
    for before, after in edits:
        assert sql.count(before) == 1, "0012.WRITE_GATHER: the line to edit is not there once"
        sql = sql.replace(before, after)
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    return sql.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1).replace("{schema}", schema)


def upgrade() -> None:
    # The indexes first, outside the transaction (CONCURRENTLY never blocks the previous release's
    # writes), then the body that reads one of them.
    with op.get_context().autocommit_block():
        for name, sql in QUEUE_INDEXES.items():
            op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")  # an INVALID leftover of a failed build
            op.execute(sql)
    op.execute(_gather_body(forward=True))


def downgrade() -> None:
    op.execute(_gather_body(forward=False))
    for name in QUEUE_INDEXES:
        op.execute(f"DROP INDEX IF EXISTS {name}")
