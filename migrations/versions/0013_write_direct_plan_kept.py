"""motir_write_direct in PL/pgSQL, so each session plans its statement once (expand only)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-13 10:00:00.000000

Issue 28. ``motir_write_direct`` (the writer of a direct run: every ``.delay()``) was a
``LANGUAGE sql`` function with ``SECURITY DEFINER`` and a fixed ``search_path``, which
Postgres 15 neither inlines nor keeps a plan for: its statement of four inserts was
planned again at every call, ~0.5 ms of the server's CPU. In PL/pgSQL the same statement
is planned once a session and kept (``RETURN QUERY``). The statement is 0010's, word for
word (read from that frozen revision); ``#variable_conflict use_column`` keeps a name the
statement shares with the function's result columns (``event_id``, ``run_id``) a column.

Only the language changes: the signature, the result, the owner's rights, the search_path,
the grants (EXECUTE for motir_engine only) and the callers bound to it stay, so the previous
release keeps working against this schema and nothing is to contract later. Measured on the
machine's Postgres (``.delay()``'s one statement, flushed, 2,000 calls): 1,140-1,580 us wall
and 0.65-0.94 ms of executor time before, 625-760 us and 0.25-0.36 ms after.
"""
from alembic import context, op
from sqlalchemy import text

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def in_plpgsql(sql_function: str) -> str:
    """A ``LANGUAGE sql`` function of one statement, the same function in PL/pgSQL."""
    head, rest = sql_function.split("AS $$", 1)
    statement = rest.rsplit("$$", 1)[0].strip()
    return (head.replace("LANGUAGE sql", "LANGUAGE plpgsql", 1) + "AS $$\n#variable_conflict use_column\nBEGIN\n"
            f"  RETURN QUERY\n  {statement};\nEND\n$$\n")


def _write_direct_of_0010() -> str:
    return str(context.script.get_revision("0010").module.WRITE_DIRECT)


def upgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute(in_plpgsql(_write_direct_of_0010()).replace("{schema}", schema))


def downgrade() -> None:
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute(_write_direct_of_0010().replace("{schema}", schema))
