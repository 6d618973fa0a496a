"""Row-level security: the roles, the policies, and their drift detection.

Three roles (DESIGN.md invariant 8):

* the **owner** — whoever runs ``motir migrate``; owns the tables and, since
  RLS is ENABLEd but not FORCEd, is not filtered by it. Migrations only.
* ``motir_app`` — RLS enforced. CLI reads, the dashboard and user code.
* ``motir_engine`` — dispatcher, claim, step writes, sweeper. It has a policy
  of its own that admits every row: a worker must claim whatever run its
  message names, whichever tenant it belongs to.

The first migration creates both roles as NOLOGIN when they do not exist (that
needs CREATEROLE); a DBA may create them beforehand, with LOGIN and passwords,
and the migration then only grants. REJECTED: ``BYPASSRLS`` for the engine —
granting it needs a superuser, and a policy says the same thing in the schema
where drift detection can see it.

Policies are declared here, stored on the tables' ``info``, created by the
migrations from the same declarations, and compared against ``pg_policies`` by
an Alembic comparator, so ``alembic check`` reports a dropped or altered
policy (or RLS switched off) exactly like a dropped index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from sqlalchemy import MetaData, text
from sqlalchemy.engine import Connection

__all__ = [
    "APP_ROLE",
    "ENGINE_ROLE",
    "Policy",
    "declare_workspace_policies",
    "policies_of",
    "create_roles_sql",
    "grant_sql",
    "enable_sql",
    "create_policy_sql",
    "drop_policy_sql",
]

APP_ROLE = "motir_app"
ENGINE_ROLE = "motir_engine"

# missing_ok=true: a transaction with no workspace context sees nothing rather
# than failing. Admin is the cross-workspace escape hatch and the only way to see
# system rows (NULL workspace_id never equals anything, so the first arm hides them).
WORKSPACE_PREDICATE = (
    "(workspace_id = current_setting('motir.workspace_id', true)) "
    "OR (current_setting('motir.system_admin', true) = 'true')"
)


@dataclass(frozen=True)
class Policy:
    table: str
    name: str
    role: str
    using: str
    check: str


def declare_workspace_policies(metadata: MetaData, tables: Iterable[str]) -> None:
    # On metadata.info, not table.info: Alembic would render table.info into revisions.
    declared = metadata.info.setdefault("rls_policies", {})
    for name in tables:
        assert name in metadata.tables, name
        declared[name] = (
            Policy(name, f"{name}_workspace", APP_ROLE, WORKSPACE_PREDICATE, WORKSPACE_PREDICATE),
            Policy(name, f"{name}_engine", ENGINE_ROLE, "true", "true"),
        )


def policies_of(metadata: MetaData) -> dict[str, tuple[Policy, ...]]:
    return dict(metadata.info.get("rls_policies", {}))


# --- DDL, used by the migrations and by the comparator's renderer -----------------


def create_roles_sql() -> str:
    return "\n".join(
        f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') "
        f"THEN CREATE ROLE {role} NOLOGIN; END IF; END $$;"
        for role in (APP_ROLE, ENGINE_ROLE)
    )


def grant_sql(table: str) -> str:
    return f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {APP_ROLE}, {ENGINE_ROLE}"


def enable_sql(table: str, enabled: bool = True) -> str:
    return f"ALTER TABLE {table} {'ENABLE' if enabled else 'DISABLE'} ROW LEVEL SECURITY"


def create_policy_sql(p: Policy, name: str | None = None) -> str:
    return (
        f"CREATE POLICY {name or p.name} ON {p.table} AS PERMISSIVE FOR ALL TO {p.role} "
        f"USING ({p.using}) WITH CHECK ({p.check})"
    )


def drop_policy_sql(table: str, name: str) -> str:
    return f"DROP POLICY IF EXISTS {name} ON {table}"


# --- drift detection ----------------------------------------------------------------

_LIVE_POLICIES = text(
    """
    SELECT p.tablename, p.policyname, p.permissive, p.cmd, p.roles::text[] AS roles,
           p.qual, p.with_check
    FROM pg_policies p
    WHERE p.schemaname = current_schema() AND p.tablename = ANY(:tables)
    """
)
_RLS_FLAGS = text(
    "SELECT relname, relrowsecurity FROM pg_class "
    "WHERE relnamespace = current_schema()::regnamespace AND relname = ANY(:tables)"
)


def _shape(row: Any) -> tuple[Any, ...]:
    return (row.permissive, row.cmd, tuple(sorted(row.roles)), row.qual, row.with_check)


def _normalised(conn: Connection, policy: Policy) -> tuple[Any, ...]:
    """Let Postgres deparse the declared policy: create it under a probe name in
    a savepoint, read it back, roll back. Comparing our text with pg_policies
    directly would report drift for every difference in parentheses."""
    probe = "motir_drift_probe"
    with conn.begin_nested() as sp:
        conn.execute(text(create_policy_sql(policy, name=probe)))
        rows = conn.execute(_LIVE_POLICIES, {"tables": [policy.table]}).all()
        sp.rollback()
    (match,) = [r for r in rows if r.policyname == probe]
    return _shape(match)


def compare_policies(conn: Connection, metadata: MetaData) -> list[tuple[str, Any]]:
    """Differences between declared and live RLS, as alembic-style diff tuples."""
    declared = policies_of(metadata)
    tables = list(declared)
    existing = set(conn.execute(text("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")).scalars())
    live = {(r.tablename, r.policyname): r for r in conn.execute(_LIVE_POLICIES, {"tables": tables})}
    flags = dict(conn.execute(_RLS_FLAGS, {"tables": tables}).all())
    diffs: list[tuple[str, Any]] = []
    for table, policies in declared.items():
        if table not in existing:
            continue  # the table itself is missing: alembic reports that; its migration adds RLS.
        if not flags.get(table):
            diffs.append(("enable_rls", table))
        for p in policies:
            row = live.pop((table, p.name), None)
            if row is None:
                diffs.append(("add_policy", p))
            elif _shape(row) != _normalised(conn, p):
                diffs.append(("change_policy", p))
    for (table, name) in live:
        diffs.append(("remove_policy", (table, name)))
    return diffs
