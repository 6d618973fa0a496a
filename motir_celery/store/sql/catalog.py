"""Statements that read the system catalogue: what the schema holds, for drift detection and probes.

``rls.py`` (policies, table grants), ``routines.py`` (functions, triggers),
``migrate.py`` (partial-index predicates) and ``schema.py`` (which later
migrations' objects exist) compare or probe with these. Nothing here reads a
tenant's row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from motir_celery.store.driver import Statement, first, rows

if TYPE_CHECKING:
    from motir_celery.store.driver import Conn

AUDIENCE = "catalog"
ROLES = ("owner", "motir_engine")

SCHEMA_TABLES = Statement(
    "schema_tables",
    "The tables of the current schema.",
    "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()",
)

LIVE_POLICIES = Statement(
    "live_policies",
    "The row-level security policies on some tables of the current schema, as Postgres deparses them.",
    """
    SELECT p.tablename, p.policyname, p.permissive, p.cmd, p.roles::text[] AS roles,
           p.qual, p.with_check
    FROM pg_policies p
    WHERE p.schemaname = current_schema()        -- this schema's
      AND p.tablename = ANY(%(tables)s)          -- the tables asked about
    """,
)

RLS_FLAGS = Statement(
    "rls_flags",
    "Whether row-level security is enabled on some tables of the current schema.",
    "SELECT relname, relrowsecurity FROM pg_class "
    "WHERE relnamespace = current_schema()::regnamespace AND relname = ANY(%(tables)s)",
)

# Table and column privileges of the declared roles and of PUBLIC (grantee 0), from
# the ACLs themselves: information_schema shows only what the current user may see.
LIVE_GRANTS = Statement(
    "live_grants",
    "Table and column privileges of the given roles and PUBLIC on some tables, read from the ACLs.",
    """
    SELECT c.relname AS table, coalesce(r.rolname, 'PUBLIC') AS role, a.privilege_type AS privilege,
           NULL::text AS column
    FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
    LEFT JOIN pg_roles r ON r.oid = a.grantee
    WHERE c.relnamespace = current_schema()::regnamespace AND c.relname = ANY(%(tables)s)
      AND (a.grantee = 0 OR r.rolname = ANY(%(roles)s))   -- PUBLIC, or a role we declare
    UNION ALL
    SELECT c.relname, coalesce(r.rolname, 'PUBLIC'), a.privilege_type, att.attname::text
    FROM pg_class c JOIN pg_attribute att ON att.attrelid = c.oid AND att.attacl IS NOT NULL
    CROSS JOIN LATERAL aclexplode(att.attacl) a
    LEFT JOIN pg_roles r ON r.oid = a.grantee
    WHERE c.relnamespace = current_schema()::regnamespace AND c.relname = ANY(%(tables)s)
      AND (a.grantee = 0 OR r.rolname = ANY(%(roles)s))
    """,
)

INDEX_PREDICATE = Statement(
    "index_predicate",
    "The WHERE of a partial index of the current schema, as Postgres deparses it.",
    "SELECT pg_get_expr(i.indpred, i.indrelid) AS predicate FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
    "WHERE c.relname = %(name)s AND c.relnamespace = current_schema()::regnamespace",
)

PROBE_PREDICATE = Statement(
    "probe_predicate",
    "The WHERE of the probe index migrate.py builds on a temporary table (the model's predicate, deparsed).",
    "SELECT pg_get_expr(indpred, indrelid) AS predicate FROM pg_index WHERE indexrelid = 'motir_probe_ix'::regclass",
)

LIVE_ROUTINES = Statement(
    "live_routines",
    "The schema's motir_* functions: identity, body digest, owner's rights, search_path, who may execute them.",
    """
    SELECT p.proname AS name, pg_get_function_identity_arguments(p.oid) AS named_args,
           oidvectortypes(p.proargtypes) AS args, md5(p.prosrc) AS digest, p.prosecdef AS definer,
           coalesce(EXISTS (SELECT 1 FROM unnest(p.proconfig) c WHERE c LIKE 'search_path=%%pg_temp'), false)
             AS fixed_path,
           ARRAY(SELECT coalesce(r.rolname, 'PUBLIC') FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
                 LEFT JOIN pg_roles r ON r.oid = a.grantee
                 WHERE a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner) AS executors
    FROM pg_proc p
    WHERE p.pronamespace = current_schema()::regnamespace   -- this schema's
      AND p.proname LIKE 'motir\\_%%'                         -- ours, by name
    """,
)
LIVE_TRIGGERS = Statement(
    "live_triggers",
    "The schema's motir_* triggers: name, table, function, a digest of when they fire, whether enabled.",
    """
    SELECT t.tgname AS name, c.relname AS table, p.proname AS function,
           -- when it fires: timing, events and row/statement (tgtype), UPDATE OF's columns (tgattr),
           -- and its WHEN clause as Postgres prints it (between FOR EACH and EXECUTE; no schema name)
           md5(t.tgtype::text || ':' || t.tgattr::text || ':'
               || coalesce(substring(pg_get_triggerdef(t.oid) from ' FOR EACH (.*) EXECUTE '), '')) AS digest,
           t.tgenabled <> 'D' AS enabled                       -- ALTER TABLE ... DISABLE TRIGGER is drift too
    FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_proc p ON p.oid = t.tgfoid
    WHERE NOT t.tgisinternal                                -- not a constraint's own trigger
      AND c.relnamespace = current_schema()::regnamespace AND t.tgname LIKE 'motir\\_%%'
    """,
)

# --- motir doctor's probes of the server (as the engine login) ----------------------------------

SERVER_VERSION = Statement(
    "server_version",
    "The server's PostgreSQL version (doctor's first line: the database answers).",
    "SELECT current_setting('server_version') AS version",
)


def server_version(conn: Conn) -> str:
    row = first(conn, SERVER_VERSION, {})
    assert row is not None
    return str(row["version"])

PRESENT_ROLES = Statement(
    "present_roles",
    "Which of some roles exist on the server (motir migrate creates them).",
    "SELECT rolname FROM pg_roles WHERE rolname = ANY(%(roles)s)",
)


def present_roles(conn: Conn, roles: Sequence[str]) -> set[str]:
    return {r["rolname"] for r in rows(conn, PRESENT_ROLES, {"roles": list(roles)})}

SERVER_PORT = Statement(
    "server_port",
    "The port the server sees this connection on (NULL over a Unix socket): a pooler in between shows up here.",
    "SELECT inet_server_port() AS port",
)


def server_port(conn: Conn) -> int | None:
    row = first(conn, SERVER_PORT, {})
    assert row is not None
    port: int | None = row["port"]
    return port


def rls_flags(conn: Conn, tables: Sequence[str]) -> dict[str, bool]:
    """``RLS_FLAGS`` by table: whether row-level security is enabled on it."""
    return {r["relname"]: bool(r["relrowsecurity"]) for r in rows(conn, RLS_FLAGS, {"tables": list(tables)})}


def policy_names(conn: Conn, tables: Sequence[str]) -> set[str]:
    """``LIVE_POLICIES`` as ``table.policy`` names."""
    return {f"{r['tablename']}.{r['policyname']}" for r in rows(conn, LIVE_POLICIES, {"tables": list(tables)})}
