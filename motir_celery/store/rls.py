"""Row-level security and grants: the roles, what each may do, and their drift detection.

Four roles (DESIGN.md invariant 8; docs/security.md is the threat model):

* the **owner** — whoever runs ``motir migrate``; owns the tables and, since
  RLS is ENABLEd but not FORCEd, is not filtered by it. Migrations only.
* ``motir_app`` — RLS enforced. Reads (CLI, dashboard, user code): SELECT on
  the five tables, and nothing else on any table. What a user's own transaction
  writes (``send_event(session=…)``, ``.delay()`` in Django's ``atomic()``) goes
  through the checked functions ``motir_enqueue_event`` / ``_events`` /
  ``_direct`` (migration 0008; ``routines.py``), which write only in the
  transaction's workspace and choose state, claim, attempts and slot themselves.
  No UPDATE or DELETE anywhere, no write to steps, the ledger or the DLQ: the
  history a worker wrote cannot be rewritten by the role user code holds.
* ``motir_admin`` — a member of ``motir_app`` (its grants and policies), and the
  only role for which ``motir.system_admin = 'true'`` means anything: the
  policy's admin arm asks ``pg_has_role(current_user, 'motir_admin', 'MEMBER')``,
  so an app-role connection that sets the GUC itself still sees only its
  workspace. Granted by the DBA to the logins of admin tooling.
* ``motir_engine`` — dispatcher, claim, step writes, sweeper, operator actions.
  A policy of its own admits every row: a worker must claim whatever run its
  message names, whichever tenant it belongs to.

The migrations create the roles as NOLOGIN when they do not exist (that needs
CREATEROLE); a DBA may create them beforehand, with LOGIN and passwords, and the
migration then only grants. Not ``BYPASSRLS`` for the engine: granting it
needs a superuser, and a policy says the same thing in the schema where drift
detection can see it.

Policies and grants are declared here, stored on the metadata's ``info``, and
compared against ``pg_policies`` and the tables' ACLs by an Alembic comparator,
so ``alembic check`` reports a dropped or altered policy, RLS switched off, or a
hand-made ``GRANT DELETE … TO motir_app`` exactly like a dropped index.
Migrations state their own DDL (a revision is frozen): they never call this
module at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from motir_celery.store.driver import rows
from motir_celery.store.sql import catalog

if TYPE_CHECKING:  # the models and Alembic's comparator bring them; a worker reads only the role names
    from sqlalchemy import MetaData
    from sqlalchemy.engine import Connection

__all__ = [
    "APP_ROLE",
    "ADMIN_ROLE",
    "ENGINE_ROLE",
    "ROLES",
    "APP_INSERTS",
    "PRIVILEGES",
    "Policy",
    "Grant",
    "declare_workspace_policies",
    "declare_engine_only",
    "policies_of",
    "grants_of",
    "enable_sql",
    "create_policy_sql",
    "drop_policy_sql",
    "grant_sql",
    "revoke_sql",
    "compare_policies",
    "compare_grants",
]

APP_ROLE = "motir_app"
ADMIN_ROLE = "motir_admin"
ENGINE_ROLE = "motir_engine"
ROLES = (APP_ROLE, ADMIN_ROLE, ENGINE_ROLE)

#: Tables the app role may INSERT into directly: none since 0009 (it writes through
#: the checked functions of routines.py; 0005 to 0008 allowed job_event and job_queue).
APP_INSERTS: frozenset[str] = frozenset()
#: Table privileges drift detection looks at (all of them but MAINTAIN, which PG 17 added).
PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")

# missing_ok=true: a transaction with no workspace context sees nothing rather
# than failing. Admin is the cross-workspace escape hatch and the only way to see
# system rows (NULL workspace_id never equals anything, so the first arm hides
# them) — honoured only for members of motir_admin, so that setting the GUC is
# not enough: the session's role must have been granted the admin role.
WORKSPACE_PREDICATE = (
    "(workspace_id = current_setting('motir.workspace_id', true)) "
    "OR ((current_setting('motir.system_admin', true) = 'true') "
    f"AND pg_has_role(current_user, '{ADMIN_ROLE}', 'MEMBER'))"
)


@dataclass(frozen=True)
class Policy:
    table: str
    name: str
    role: str
    using: str
    check: str


@dataclass(frozen=True)
class Grant:
    """One table privilege of one role; ``column`` for a column-level grant (never declared)."""

    table: str
    role: str
    privilege: str
    column: str | None = None


def _table_grants(table: str) -> tuple[Grant, ...]:
    app = ("SELECT", "INSERT") if table in APP_INSERTS else ("SELECT",)
    engine = ("SELECT", "INSERT", "UPDATE", "DELETE")
    # motir_admin holds nothing of its own: it inherits motir_app's grants by membership.
    return tuple(Grant(table, APP_ROLE, p) for p in app) + tuple(Grant(table, ENGINE_ROLE, p) for p in engine)


def declare_workspace_policies(metadata: MetaData, tables: Iterable[str]) -> None:
    # On metadata.info, not table.info: Alembic would render table.info into revisions.
    declared = metadata.info.setdefault("rls_policies", {})
    grants = metadata.info.setdefault("rls_grants", {})
    for name in tables:
        assert name in metadata.tables, name
        declared[name] = (
            Policy(name, f"{name}_workspace", APP_ROLE, WORKSPACE_PREDICATE, WORKSPACE_PREDICATE),
            Policy(name, f"{name}_engine", ENGINE_ROLE, "true", "true"),
        )
        grants[name] = _table_grants(name)


def declare_engine_only(metadata: MetaData, table: str, privileges: Iterable[str]) -> None:
    """A table of the engine's own bookkeeping (no tenant rows, so no policies): only
    the engine role holds ``privileges`` on it; any other grant is drift."""
    assert table in metadata.tables, table
    metadata.info.setdefault("rls_grants", {})[table] = tuple(Grant(table, ENGINE_ROLE, p) for p in privileges)


def policies_of(metadata: MetaData) -> dict[str, tuple[Policy, ...]]:
    return dict(metadata.info.get("rls_policies", {}))


def grants_of(metadata: MetaData) -> dict[str, tuple[Grant, ...]]:
    return dict(metadata.info.get("rls_grants", {}))


# --- DDL, used by the comparator's renderer -------------------------------------------


def enable_sql(table: str, enabled: bool = True) -> str:
    return f"ALTER TABLE {table} {'ENABLE' if enabled else 'DISABLE'} ROW LEVEL SECURITY"


def create_policy_sql(p: Policy, name: str | None = None) -> str:
    return (
        f"CREATE POLICY {name or p.name} ON {p.table} AS PERMISSIVE FOR ALL TO {p.role} "
        f"USING ({p.using}) WITH CHECK ({p.check})"
    )


def drop_policy_sql(table: str, name: str) -> str:
    return f"DROP POLICY IF EXISTS {name} ON {table}"


def _grantee(role: str) -> str:
    return "PUBLIC" if role == "PUBLIC" else f'"{role}"'


def grant_sql(g: Grant) -> str:
    column = f" ({g.column})" if g.column else ""
    return f"GRANT {g.privilege}{column} ON {g.table} TO {_grantee(g.role)}"


def revoke_sql(g: Grant) -> str:
    column = f" ({g.column})" if g.column else ""
    return f"REVOKE {g.privilege}{column} ON {g.table} FROM {_grantee(g.role)}"


# --- drift detection ----------------------------------------------------------------

def _shape(row: Any) -> tuple[Any, ...]:
    return (row["permissive"], row["cmd"], tuple(sorted(row["roles"])), row["qual"], row["with_check"])


def _normalised(conn: Connection, policy: Policy) -> tuple[Any, ...]:
    """Let Postgres deparse the declared policy: create it under a probe name in
    a savepoint, read it back, roll back. Comparing our text with pg_policies
    directly would report drift for every difference in parentheses."""
    probe = "motir_drift_probe"
    with conn.begin_nested() as sp:
        conn.exec_driver_sql(create_policy_sql(policy, name=probe))  # DDL built from the declaration
        found = rows(conn, catalog.LIVE_POLICIES, {"tables": [policy.table]})
        sp.rollback()
    (match,) = [r for r in found if r["policyname"] == probe]
    return _shape(match)


def _existing_tables(conn: Connection) -> set[str]:
    return {r["tablename"] for r in rows(conn, catalog.SCHEMA_TABLES, {})}


def compare_policies(conn: Connection, metadata: MetaData) -> list[tuple[str, Any]]:
    """Differences between declared and live RLS, as alembic-style diff tuples."""
    declared = policies_of(metadata)
    tables = list(declared)
    existing = _existing_tables(conn)
    live = {(r["tablename"], r["policyname"]): r for r in rows(conn, catalog.LIVE_POLICIES, {"tables": tables})}
    flags: dict[str, bool] = {r["relname"]: r["relrowsecurity"] for r in rows(conn, catalog.RLS_FLAGS, {"tables": tables})}
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


def compare_grants(conn: Connection, metadata: MetaData) -> list[tuple[str, Grant]]:
    """Privileges of the declared roles (and PUBLIC) that differ from the declaration:
    ``("grant", g)`` for one missing, ``("revoke", g)`` for one nobody declared —
    a hand-made ``GRANT DELETE ON job_step TO motir_app`` is the second kind."""
    declared = {g for grants in grants_of(metadata).values() for g in grants}
    tables = [t for t in grants_of(metadata) if t in _existing_tables(conn)]
    if not tables:
        return []
    live = {Grant(r["table"], r["role"], r["privilege"], r["column"])
            for r in rows(conn, catalog.LIVE_GRANTS, {"tables": tables, "roles": list(ROLES)})
            if r["privilege"] in PRIVILEGES}
    wanted = {g for g in declared if g.table in tables}
    order = lambda g: (g.table, g.role, g.privilege, g.column or "")  # noqa: E731 — stable diffs
    return ([("grant", g) for g in sorted(wanted - live, key=order)]
            + [("revoke", g) for g in sorted(live - wanted, key=order)])
