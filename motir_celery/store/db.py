"""Engines, sessions and the workspace context.

Two ways in:

* ``engine_connection()`` — the engine role: dispatcher, claim, step writes,
  settle, sweeper. It may see every tenant's rows (a policy of its own, see
  ``models.py``), because a worker must claim whatever run its message names.
* ``workspace_session(workspace_id, admin=...)`` — the app role with row-level
  security enforced (``motir_admin``, a member of it, for admin reads). CLI
  reads, the dashboard and user code go through it.

The workspace context is set with ``set_config(..., true)``: transaction-local,
so it cannot leak to the next borrower of a pooled connection.

The reading URLs may name a hot standby: a workspace session runs only what a
read-only transaction may (``set_config`` of the ``motir.*`` settings and SELECTs),
and every write goes through the engine URL, the primary. ``primary_wal_lsn`` is the
primary's WAL position after such a write, for a reader that waits to see it.

Engines are created lazily per process and per URL (``forks.per_process``), so
a prefork child never shares a socket with its parent.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterator

import psycopg
from psycopg import pq
from sqlalchemy import Connection, Engine, create_engine
from sqlalchemy.orm import Session

from motir_celery.errors import ConfigurationError, WorkspaceError
from motir_celery.forks import per_process
from motir_celery.settings import Settings, get_settings
from motir_celery.store import pooler
from motir_celery.store.rls import ADMIN_ROLE
from motir_celery.store.sql import session

__all__ = [
    "get_engine",
    "attempt_connection",
    "engine_connection",
    "workspace_session",
    "set_workspace_context",
    "dispose_engines",
    "side_engine",
    "size_pool_for",
    "validate_workspace_id",
    "caller_workspace",
    "in_workspace",
    "reader_login",
    "primary_wal_lsn",
]

class _Engines:
    """This process's engines by URL (``forks.per_process``: a forked child starts
    with none, and its parent's pooled sockets are neither used nor closed there)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_url: dict[str, Engine] = {}


_engines = per_process(_Engines)


def get_engine(url: str | None = None, *, settings: Settings | None = None) -> Engine:
    settings = settings or get_settings()
    url = url or settings.require_database_url()
    engines = _engines()
    engine = engines.by_url.get(url)
    if engine is None:
        with engines.lock:
            engine = engines.by_url.get(url)
            if engine is None:
                size = max(settings.pool_size, _runs_per_process)
                engine = create_engine(
                    url,
                    # A run holds one connection while it runs (and briefly a second for a
                    # wait's transaction or a step's send_event): `size` covers one per
                    # concurrent run of this process, the overflow the rest.
                    pool_size=size,
                    max_overflow=size,
                    # No ping on checkout (SQLAlchemy's default): a socket a database restart
                    # left dead fails its first statement, SQLAlchemy invalidates the pool, and
                    # the runner claims once more on a fresh one (runner.execute). Pinging
                    # bought nothing the ablation could measure (docs/performance.md) and
                    # would cost every run a round trip. Every timestamp is timestamptz
                    # compared with now(); the session TimeZone only changes how values print.
                    connect_args=_connect_args(settings),
                )
                pooler.install(engine, settings)  # behind a transaction pooler: nothing prepared
                engines.by_url[url] = engine
    return engine


def _connect_args(settings: Settings) -> dict[str, Any]:
    args: dict[str, Any] = {"application_name": "motir-celery"}
    if not settings.prepared_statements:
        # Behind a transaction pooler: psycopg must not prepare anything on its own either.
        args["prepare_threshold"] = None
    return args


#: Concurrent runs in one process (Celery's threads pool: its concurrency), set by the adapter.
_runs_per_process = 1


def size_pool_for(runs: int) -> None:
    """This process runs up to ``runs`` runs at once: size engines made from now on for them."""
    global _runs_per_process
    _runs_per_process = max(1, runs)


def side_engine(settings: Settings | None = None) -> Engine:
    """The engine of the worker's side duties (heartbeats, sweeps): one connection of its
    own per process, so a busy run pool cannot starve them. Pinged before use (once a
    second at most, so the cost is nothing)."""
    settings = settings or get_settings()
    url = settings.require_database_url()
    engines = _engines()
    engine = engines.by_url.get("side:" + url)
    if engine is None:
        with engines.lock:
            engine = engines.by_url.get("side:" + url)
            if engine is None:
                engine = create_engine(url, pool_size=1, max_overflow=0, pool_pre_ping=True,
                                       connect_args=_connect_args(settings))
                pooler.install(engine, settings)
                engines.by_url["side:" + url] = engine
    return engine


@dataclass
class _Slot:
    conn: Connection
    busy: bool = False


@dataclass
class _Held:
    """Each thread's attempt connection per engine (``attempt_connection``), and all of them."""

    local: threading.local = field(default_factory=threading.local)
    lock: threading.Lock = field(default_factory=threading.Lock)
    slots: list[_Slot] = field(default_factory=list)
    generation: int = 0


_held = per_process(_Held)


@contextmanager
def attempt_connection(engine: Engine) -> Iterator[Connection]:
    """A connection to ``engine`` in autocommit for one attempt (the runner's: one statement, one
    transaction, one commit), kept checked out by this thread between its attempts.

    Checking a connection out of the pool, switching it to autocommit and back and returning
    it cost a pool child ~0.1 ms a run (docs/performance.md, "Where a run's CPU goes"); a thread
    runs one attempt at a time, so it keeps one. Before each attempt the kept one is checked
    (no round trip): one that is closed, invalidated, or not idle (an attempt that ended in
    mid-statement, from a signal handler's exception) is dropped and a new one checked out.
    An attempt inside another of the same thread (eager mode: a run published from a run)
    gets a pooled connection of its own, returned after it. ``dispose_engines`` returns them all.
    """
    held = _held()
    if getattr(held.local, "generation", None) != held.generation:
        held.local.slots, held.local.generation = {}, held.generation
    mine: dict[Engine, _Slot] = held.local.slots
    slot = mine.get(engine)
    if slot is not None and slot.busy:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            yield conn
        return
    if slot is not None and not _idle(slot.conn):
        _drop(held, slot)
        slot = None
    if slot is None:
        slot = mine[engine] = _Slot(engine.connect().execution_options(isolation_level="AUTOCOMMIT"))
        with held.lock:
            held.slots.append(slot)
    slot.busy = True
    try:
        yield slot.conn
    finally:
        slot.busy = False


def _idle(conn: Connection) -> bool:
    if conn.closed or conn.invalidated or conn.in_transaction():
        return False
    raw = conn.connection.driver_connection
    return not isinstance(raw, psycopg.Connection) or (
        not raw.closed and not raw.broken and raw.info.transaction_status == pq.TransactionStatus.IDLE)


def _drop(held: _Held, slot: _Slot) -> None:
    with held.lock:
        if slot in held.slots:
            held.slots.remove(slot)
    try:
        if not slot.conn.closed and not slot.conn.invalidated:
            slot.conn.invalidate()  # whatever state it is in, it is not handed out again
        slot.conn.close()
    except Exception:  # noqa: BLE001 — a connection being dropped may be broken in any way
        pass


def dispose_engines() -> None:
    """Drop every pooled connection of this process, the attempts' kept ones too (at
    shutdown, and in tests)."""
    held = _held()
    with held.lock:
        slots, held.slots = held.slots, []
        held.generation += 1
    for slot in slots:
        try:
            slot.conn.close()
        except Exception:  # noqa: BLE001 — returned to a pool that is being disposed anyway
            pass
    engines = _engines()
    with engines.lock:
        for engine in engines.by_url.values():
            engine.dispose()
        engines.by_url.clear()


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


#: The workspace the calling code acts for: what a read by run id alone (``AsyncResult(id)``
#: through the result backend) may see. Set by ``in_workspace`` and, per request, by Django's
#: ``WorkspaceMiddleware``. None: system runs only.
_caller: ContextVar[str | None] = ContextVar("motir_caller_workspace", default=None)


def caller_workspace() -> str | None:
    """The workspace the calling code acts for (``in_workspace``), None outside one."""
    return _caller.get()


@contextmanager
def in_workspace(workspace_id: str | None) -> Iterator[None]:
    """Act for ``workspace_id`` inside the block: ``AsyncResult(id)`` reads that workspace's runs
    (and only those) under the app role. A contextvar: it follows threads' and tasks' contexts."""
    token = _caller.set(validate_workspace_id(workspace_id))
    try:
        yield
    finally:
        _caller.reset(token)


def set_workspace_context(conn: Connection | Session, workspace_id: str | None, *, admin: bool = False) -> None:
    """Scope the current transaction to one workspace (and optionally system rows).

    ``set_config(..., true)`` is the transaction-local form of SET LOCAL, usable
    with bound parameters; the setting vanishes at COMMIT or ROLLBACK.
    """
    workspace_id = validate_workspace_id(workspace_id)
    session.workspace_context(conn.connection() if isinstance(conn, Session) else conn, workspace_id, admin=admin)


def reader_login(settings: Settings, *, admin: bool) -> tuple[str, str | None]:
    """Where an RLS-enforced session logs in: (URL, role to ``SET LOCAL ROLE`` to, or None).

    * workspace sessions: ``MOTIR_APP_DATABASE_URL`` (a login of ``motir_app``), else
      the engine URL dropping to ``motir_app`` for the transaction (development);
    * admin sessions: ``MOTIR_ADMIN_DATABASE_URL`` (a login that is a member of
      ``motir_admin``), else — only without an app URL — the engine URL dropping to
      ``motir_admin``. With an app URL but no admin URL there is no admin login:
      refused, because the app login must not be able to act as admin.

    Dropping a role with SET LOCAL ROLE is development mode: the login can RESET
    ROLE, so it contains mistakes, not an attacker (``motir doctor`` says FAIL). It only
    happens on the engine URL, the primary; either reader URL may name a hot standby.
    """
    if admin:
        if settings.admin_database_url:
            return settings.admin_database_url, None
        if settings.app_database_url:
            raise ConfigurationError(
                "admin reads need MOTIR_ADMIN_DATABASE_URL: a login that is a member of "
                f"{ADMIN_ROLE} (the app login of MOTIR_APP_DATABASE_URL must not be one)")
        return settings.require_database_url(), ADMIN_ROLE
    if settings.app_database_url:
        return settings.app_database_url, None
    return settings.require_database_url(), settings.app_role


def primary_wal_lsn(settings: Settings | None = None) -> str:
    """The engine's server's current WAL write position: every transaction committed
    before the call is before it (``reads.replayed`` tells when a standby shows it)."""
    with engine_connection(settings) as conn:
        return session.primary_wal_lsn(conn)


@contextmanager
def workspace_session(
    workspace_id: str | None, *, admin: bool = False, settings: Settings | None = None
) -> Iterator[Session]:
    """A Session under the app role, scoped to ``workspace_id``; commits on success.

    ``admin=True`` is the cross-workspace escape hatch of admin tooling (seed
    001): it shows system rows (NULL workspace) *and every workspace's rows*,
    whatever ``workspace_id`` says — through a login of ``motir_admin``
    (``reader_login``), since the policies ignore ``motir.system_admin`` for
    anyone else. Without it, ``workspace_id=None`` sees nothing.
    """
    settings = settings or get_settings()
    url, role = reader_login(settings, admin=admin)
    engine = get_engine(url, settings=settings)
    with Session(engine) as orm, orm.begin():
        if role is not None:
            # Same login as the engine: drop to the reading role for this transaction only.
            session.reader_role(orm.connection(), role)
        set_workspace_context(orm, workspace_id, admin=admin)
        yield orm
