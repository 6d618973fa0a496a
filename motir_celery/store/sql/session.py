"""A transaction's context: its workspace, the reading role it drops to, the primary's WAL position.

``set_config(..., true)`` is the transaction-local form of SET LOCAL, usable with
bound parameters; every value vanishes at COMMIT or ROLLBACK, so nothing leaks to
the next borrower of a pooled connection. ``role`` is SET LOCAL ROLE's own setting:
Postgres checks the membership exactly as for the command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from motir_celery.store.driver import Statement, first, rows

if TYPE_CHECKING:
    from motir_celery.store.driver import Conn

AUDIENCE = "session"
ROLES = ("motir_engine", "motir_app", "motir_admin")

WORKSPACE_CONTEXT = Statement(
    "workspace_context",
    "Scope the transaction to one workspace (and, for members of motir_admin, every workspace and system rows).",
    "SELECT set_config('motir.workspace_id', %(ws)s, true) AS workspace_id, "
    "set_config('motir.system_admin', %(admin)s, true) AS system_admin",
)


def workspace_context(conn: Conn, workspace_id: str | None, *, admin: bool) -> None:
    rows(conn, WORKSPACE_CONTEXT, {"ws": workspace_id or "", "admin": "true" if admin else "false"})


READER_ROLE = Statement(
    "reader_role",
    "Development mode: drop the engine login to the reading role (motir_app / motir_admin) for this transaction.",
    "SELECT set_config('role', %(role)s, true) AS role",
)


def reader_role(conn: Conn, role: str) -> None:
    rows(conn, READER_ROLE, {"role": role})


PRIMARY_WAL_LSN = Statement(
    "primary_wal_lsn",
    "The primary's current WAL write position (a standby reader waits until it has replayed it).",
    "SELECT pg_current_wal_lsn()::text AS lsn",
)


def primary_wal_lsn(conn: Conn) -> str:
    row = first(conn, PRIMARY_WAL_LSN, {})
    assert row is not None
    lsn: str = row["lsn"]
    return lsn
