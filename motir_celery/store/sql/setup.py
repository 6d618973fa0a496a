"""Setting up databases and logins: create and drop one (the test kit, the embedded services, the benches),
a role's login password (``motir migrate --set-role-passwords``).

An identifier cannot be a bound parameter, so these are small builders that quote it
with psycopg (never by hand), on a connection in autocommit (CREATE DATABASE cannot
run inside a transaction).
"""

from __future__ import annotations

import psycopg
from psycopg import sql
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from motir_celery.store.driver import Statement, first

AUDIENCE = "setup"
ROLES = ("owner",)


# Templates, not bound statements: ``{name}`` / ``{role}`` / ``{password}`` are filled by
# psycopg.sql (Identifier, Literal) in the builders below; nothing else is ever spliced in.

CREATE_DATABASE = Statement(
    "create_database",
    "Create a database (DDL template: the name is quoted by psycopg.sql; in autocommit).",
    "CREATE DATABASE {name}",
)


def _ddl(conn: Connection, statement: Statement, **parts: sql.Composable) -> None:
    """Send a DDL template with its parts quoted by psycopg.sql (``conn`` in autocommit)."""
    raw = conn.connection.driver_connection
    conn.exec_driver_sql(sql.SQL(statement.sql).format(**parts).as_string(raw))


def create_database(conn: Connection, name: str) -> None:
    """``CREATE DATABASE name`` (``conn`` in autocommit)."""
    _ddl(conn, CREATE_DATABASE, name=sql.Identifier(name))


DROP_DATABASE = Statement(
    "drop_database",
    "Drop a database if it exists, ending its sessions first (DDL template: the name is quoted by psycopg.sql).",
    "DROP DATABASE IF EXISTS {name} WITH (FORCE)",
)


def drop_database(conn: Connection, name: str) -> None:
    """``DROP DATABASE IF EXISTS name WITH (FORCE)``: its sessions are ended first (``conn`` in autocommit)."""
    _ddl(conn, DROP_DATABASE, name=sql.Identifier(name))


DATABASE_EXISTS = Statement(
    "database_exists",
    "Whether a database of this name exists on the server (the embedded Postgres creates its own once).",
    "SELECT 1 AS found FROM pg_database WHERE datname = %(name)s",
)


def database_exists(conn: Connection, name: str) -> bool:
    return first(conn, DATABASE_EXISTS, {"name": name}) is not None


MAX_CONNECTIONS = Statement(
    "max_connections",
    "The server's connection slots (the embedded Postgres raises them once: dev/embedded.py).",
    "SELECT current_setting('max_connections')::int AS slots",
)


def max_connections(conn: Connection) -> int:
    row = first(conn, MAX_CONNECTIONS, {})
    return int(row["slots"]) if row is not None else 0


SET_MAX_CONNECTIONS = Statement(
    "set_max_connections",
    "Set the server's connection slots for its next start (DDL template: the number is a psycopg.sql Literal; in autocommit).",
    "ALTER SYSTEM SET max_connections = {slots}",
)


def set_max_connections(conn: Connection, slots: int) -> None:
    """``ALTER SYSTEM SET max_connections`` (read at the server's next start; ``conn`` in autocommit)."""
    _ddl(conn, SET_MAX_CONNECTIONS, slots=sql.Literal(int(slots)))


LOGIN_PASSWORD = Statement(
    "login_password",
    "Let a role log in with a password (motir migrate --set-role-passwords; DDL template quoted by psycopg.sql).",
    "ALTER ROLE {role} LOGIN PASSWORD {password}",
)


def set_login_password(conn: Connection, role: str, password: str) -> None:
    """``ALTER ROLE role LOGIN PASSWORD '…'`` (needs CREATEROLE). Sent on the driver's own cursor,
    so an error names the template, never the password (SQLAlchemy's would quote the statement)."""
    raw = conn.connection.driver_connection
    assert raw is not None
    statement = sql.SQL(LOGIN_PASSWORD.sql).format(role=sql.Identifier(role), password=sql.Literal(password))
    try:
        with raw.cursor() as cursor:
            cursor.execute(statement)
    except psycopg.Error as exc:
        raise DBAPIError.instance(LOGIN_PASSWORD.sql, None, exc, psycopg.Error) from exc
