"""the functions that find a run by its id, or a waiter by its event, never read a partial index on state (expand only)

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-14 10:00:00.000000

Issue 28. Four function bodies checked a run's state as ``q.state = 'queued'`` next to the
lookup that finds it (its id, or the event it waits for). From that predicate the planner
may read the run through ``ix_job_queue_stale`` or ``ix_job_queue_due`` (indexes of every
queued run), and it does when the table's statistics were taken while nothing was queued:
it costs them at ~0 rows. Once a backlog builds up, each call then scans the whole backlog
(5,000 queued runs: 0.7 ms a ``send_event``, its wake-up of waiters; each child's settle, its
parent's wake-up, likewise). Each now checks ``(q.state = 'queued') IS TRUE``, the same
test (``state`` is never NULL) from which no partial index's predicate is proven: the run
is found through the primary key, a waiter through ``ix_job_queue_waiting``. The statements
of the code follow the same rule (store/sql/worker.py's docstring).

A child's settle finds its parent by id and checks ``p.wait_event = 'motir.children'``
too, from which ``ix_job_queue_waiting`` (every suspended parent) is usable: that check is
written the same way. Each body is its frozen revision's, word for word, but those lines
(asserted), and replaced in place: the signatures, results, owner's rights, search_path
and grants stay, so the previous release runs against this schema as before and nothing
is to contract.
"""
from alembic import context, op
from sqlalchemy import text

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None

#: (revision, its constant) -> each line as it stands, and as it becomes
EDITS = {
    ("0008", "WRITE_EVENT"): (
        ("      AND q.state = 'queued'                       -- suspended waiting (not cancelled, not running)",
         "      AND (q.state = 'queued') IS TRUE             -- suspended waiting (not cancelled, not running)"),),
    ("0008", "WRITE_EVENTS"): (
        ("      AND q.state = 'queued'                         -- suspended waiting (not cancelled, not running)",
         "      AND (q.state = 'queued') IS TRUE               -- suspended waiting (not cancelled, not running)"),),
    # The parent by its id: through the primary key, not ix_job_queue_waiting (every suspended parent) either.
    ("0011", "ON_RUN_SETTLED"): (
        ("      AND p.state = 'queued'                         -- suspended (a running parent checks for itself)",
         "      AND (p.state = 'queued') IS TRUE               -- suspended (a running parent checks for itself)"),
        ("      AND p.wait_event = 'motir.children'            -- waiting for its children, not sleeping",
         "      AND (p.wait_event = 'motir.children') IS TRUE  -- waiting for its children, not sleeping"),),
    ("0012", "WRITE_GATHER"): (
        ("      AND q.state = 'queued' AND q.flow_key IS NULL   -- not gathered yet: a second call for it does nothing",
         "      AND (q.state = 'queued') IS TRUE AND q.flow_key IS NULL   -- not gathered yet: a second call does nothing"),),
}


def _body(revision_: str, name: str) -> str:
    """The frozen revision's function, made a replacement of the function in place."""
    sql = str(getattr(context.script.get_revision(revision_).module, name))
    return sql.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def _apply(forward: bool) -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    for (revision_, name), lines in EDITS.items():
        sql = _body(revision_, name)
        for before, after in lines:
            assert sql.count(before) == 1, f"{revision_}.{name}: the line to edit is not there once"
            if forward:
                sql = sql.replace(before, after)
        op.execute(sql.replace("{schema}", schema))


def upgrade() -> None:
    _apply(forward=True)


def downgrade() -> None:
    _apply(forward=False)
