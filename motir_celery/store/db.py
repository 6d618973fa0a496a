"""Engines, sessions and the workspace context.

Two ways in:

* ``engine_connection()`` — the engine role: dispatcher, claim, step writes,
  settle, sweeper. It may see every tenant's rows (a policy of its own, see
  ``models.py``), because a worker must claim whatever run its message names.
* ``workspace_session(workspace_id, admin=...)`` — the app role with row-level
  security enforced. CLI reads, the dashboard and user code go through it.

The workspace context is set with ``set_config(..., true)``: transaction-local,
so it cannot leak to the next borrower of a pooled connection.

Engines are created lazily per process and per URL, and disposed after a fork
(Celery's prefork pool) so a child never shares a socket with its parent.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy import event as sa_event
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session

from motir_celery.errors import WorkspaceError
from motir_celery.settings import Settings, get_settings

__all__ = [
    "get_engine",
    "engine_connection",
    "workspace_session",
    "set_workspace_context",
    "dispose_engines",
    "validate_workspace_id",
]

_engines: dict[tuple[str, int], Engine] = {}
_lock = threading.Lock()


def get_engine(url: str | None = None, *, settings: Settings | None = None) -> Engine:
    settings = settings or get_settings()
    url = url or settings.require_database_url()
    key = (url, os.getpid())
    engine = _engines.get(key)
    if engine is None:
        with _lock:
            engine = _engines.get(key)
            if engine is None:
                engine = create_engine(
                    url,
                    pool_size=settings.pool_size,
                    max_overflow=settings.pool_size,
                    # Not pool_pre_ping: that is one more round trip on every checkout,
                    # i.e. on every run. `_ping_when_idle` tests only a connection that
                    # sat unused in the pool, where a database restart leaves dead sockets.
                    # Every timestamp is timestamptz compared with now(); the session
                    # TimeZone only changes how values print, never what they mean.
                    connect_args={"application_name": "motir-celery"},
                )
                _ping_when_idle(engine)
                _engines[key] = engine
    return engine


#: A pooled connection idle for longer than this is pinged before it is handed out.
PING_AFTER_IDLE_SECONDS = 1.0


def _ping_when_idle(engine: Engine) -> None:
    """Pessimistic disconnect handling, paid only where it can matter.

    A connection checked in less than ``PING_AFTER_IDLE_SECONDS`` ago answered a
    statement a moment ago; a busy worker (a run every few milliseconds) never
    pings. One that sat longer is pinged on checkout, and if the ping fails the
    pool replaces it (``DisconnectionError`` makes the pool connect afresh),
    just as ``pool_pre_ping`` would. A restart inside that second surfaces as
    a disconnect on the first statement: SQLAlchemy then invalidates the whole
    pool, and the runner claims again on a new socket (``runner._claim``).
    """

    @sa_event.listens_for(engine, "checkin")
    def _checked_in(dbapi_connection: Any, record: Any) -> None:
        record.info["motir_idle_since"] = time.monotonic()

    @sa_event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        since = record.info.pop("motir_idle_since", None)
        if since is None or time.monotonic() - since < PING_AFTER_IDLE_SECONDS:
            return  # new, or in use a moment ago
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as exc:  # noqa: BLE001 — any failure means: not this socket
            raise DisconnectionError(f"pooled connection failed its ping: {exc}") from exc


def dispose_engines() -> None:
    """Drop every pooled connection of this process (call after fork, and at shutdown)."""
    with _lock:
        for (url, pid), engine in list(_engines.items()):
            # close=False: after a fork the parent still owns these sockets.
            engine.dispose(close=pid == os.getpid())
            del _engines[(url, pid)]


_inherited: list[Engine] = []


def _after_fork_in_child() -> None:
    # The parent's pooled sockets must be neither used nor closed here (closing
    # one would end the parent's session): keep the engines referenced so they
    # are never garbage-collected, and start from an empty cache.
    global _lock
    _inherited.extend(_engines.values())
    _engines.clear()
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextmanager
def engine_connection(settings: Settings | None = None) -> Iterator[Connection]:
    """A connection in a transaction that commits on success, as the engine role."""
    with get_engine(settings=settings).begin() as conn:
        yield conn


def validate_workspace_id(workspace_id: object) -> str | None:
    """Workspace ids are opaque strings; reject what would be a bug upstream."""
    if workspace_id is None:
        return None
    if not isinstance(workspace_id, str):
        raise WorkspaceError(f"workspace_id must be a string or None, got {type(workspace_id).__name__}")
    if not workspace_id or len(workspace_id) > 200 or not workspace_id.isprintable() or workspace_id != workspace_id.strip():
        raise WorkspaceError(f"workspace_id {workspace_id!r} is empty, too long, padded or not printable")
    return workspace_id


def set_workspace_context(conn: Connection | Session, workspace_id: str | None, *, admin: bool = False) -> None:
    """Scope the current transaction to one workspace (and optionally system rows).

    ``set_config(..., true)`` is the transaction-local form of SET LOCAL, usable
    with bound parameters; the setting vanishes at COMMIT or ROLLBACK.
    """
    workspace_id = validate_workspace_id(workspace_id)
    conn.execute(
        text("SELECT set_config('motir.workspace_id', :ws, true), set_config('motir.system_admin', :admin, true)"),
        {"ws": workspace_id or "", "admin": "true" if admin else "false"},
    )


@contextmanager
def workspace_session(
    workspace_id: str | None, *, admin: bool = False, settings: Settings | None = None
) -> Iterator[Session]:
    """A Session under the app role, scoped to ``workspace_id``; commits on success.

    ``admin=True`` is the cross-workspace escape hatch of admin tooling (seed
    001): it shows system rows (NULL workspace) *and every workspace's rows*,
    whatever ``workspace_id`` says. Without it, ``workspace_id=None`` sees nothing.
    """
    settings = settings or get_settings()
    engine = get_engine(settings.app_database_url or settings.require_database_url(), settings=settings)
    with Session(engine) as session, session.begin():
        if not settings.app_database_url:
            # Same login as the engine: drop to the app role for this transaction only.
            session.execute(text(f'SET LOCAL ROLE "{settings.app_role}"'))
        set_workspace_context(session, workspace_id, admin=admin)
        yield session
