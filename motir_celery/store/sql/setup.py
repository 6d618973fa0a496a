"""Setting up databases: create and drop one (the test kit, the embedded services, the benches).

An identifier cannot be a bound parameter, so these are small builders that quote it
with psycopg (never by hand), on a connection in autocommit (CREATE DATABASE cannot
run inside a transaction).
"""

from __future__ import annotations

from psycopg import sql
from sqlalchemy import Connection

AUDIENCE = "setup"
ROLES = ("owner",)


def create_database(conn: Connection, name: str) -> None:
    """``CREATE DATABASE name`` (``conn`` in autocommit)."""
    raw = conn.connection.driver_connection
    conn.exec_driver_sql(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)).as_string(raw))


def drop_database(conn: Connection, name: str) -> None:
    """``DROP DATABASE IF EXISTS name WITH (FORCE)``: its sessions are ended first (``conn`` in autocommit)."""
    raw = conn.connection.driver_connection
    conn.exec_driver_sql(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)).as_string(raw))
