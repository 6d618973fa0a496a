"""Connections, sessions and the workspace context.

Two ways in:

* ``get_pool(settings)`` / ``engine_connection(settings)`` — the engine role: dispatcher, claim, step
  writes, settle, sweeper. It may see every tenant's rows (a policy of its own, see
  ``models.py``), because a worker must claim whatever run its message names. Its
  connections are psycopg's in psycopg's own pool (``store/pg.py``): a worker imports no
  SQLAlchemy.
* ``workspace_session(workspace_id, admin=...)`` — the app role with row-level
  security enforced (``motir_admin``, a member of it, for admin reads). CLI
  reads, the dashboard and user code go through it: a SQLAlchemy ``Session`` over
  ``get_engine(settings)``.

The workspace context is set with ``set_config(..., true)``: transaction-local,
so it cannot leak to the next borrower of a pooled connection.

The reading URLs may name a hot standby: a workspace session runs only what a
read-only transaction may (``set_config`` of the ``motir.*`` settings and SELECTs),
and every write goes through the engine URL, the primary. ``primary_wal_lsn`` is the
primary's WAL position after such a write, for a reader that waits to see it.

Pools and engines are created lazily per process and per URL (``forks.per_process``),
so a prefork child never shares a socket with its parent. Every function is handed the
settings it works with (the engine's, ``core/engine.py``): none reads the environment.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

from motir_celery.errors import ConfigurationError, WorkspaceError
from motir_celery.forks import per_process
from motir_celery.settings import Settings
from motir_celery.store import pooler
from motir_celery.store.listen import Listener
from motir_celery.store.pg import Pool, PooledConnection
from motir_celery.store.rls import ADMIN_ROLE, APP_ROLE
from motir_celery.store.sql import session

if TYPE_CHECKING:
    from sqlalchemy import Connection, Engine
    from sqlalchemy.orm import Session

__all__ = [
    "get_pool",
    "get_engine",
    "engine_connection",
    "workspace_session",
    "set_workspace_context",
    "dispose_engines",
    "side_engine",
    "validate_workspace_id",
    "caller_workspace",
    "in_workspace",
    "reader_login",
    "primary_wal_lsn",
    "get_listener",
]

T = TypeVar("T")


class _Engines:
    """This process's pools and SQLAlchemy engines by URL (``forks.per_process``: a forked
    child starts with none, and its parent's pooled sockets are neither used nor closed there)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pools: dict[str, Pool] = {}
        self.by_url: dict[str, Engine] = {}
        self.listeners: dict[str, Listener] = {}

    def once(self, table: dict[str, T], key: str, make: Callable[[], T]) -> T:
        """``table[key]``, made by ``make()`` the first time (once, whatever the threads)."""
        found = table.get(key)
        if found is None:
            with self.lock:
                found = table.get(key)
                if found is None:
                    found = table[key] = make()
        return found


_engines = per_process(_Engines)


def get_pool(settings: Settings, url: str | None = None, *, runs: int = 1) -> Pool:
    """The engine role's connections to ``url`` (the engine URL): psycopg, no SQLAlchemy. ``runs``:
    how many runs this process runs at once (Celery's threads pool: its concurrency), when the
    pool is made."""
    url = url or settings.require_database_url()

    def make() -> Pool:
        size = max(settings.pool_size, runs)
        # A run holds one connection while it runs (and briefly a second for a wait's transaction
        # or a step's send_event): `size` covers one per concurrent run of this process, the
        # overflow the rest; none is opened before it is asked for. No ping on checkout: a socket a database restart left dead fails its
        # first statement, the pool replaces every older one (driver.rows), and the runner claims
        # once more on a fresh one (runner.execute). Pinging bought nothing the ablation could
        # measure (docs/performance.md) and would cost every run a round trip. Every timestamp is
        # timestamptz compared with now(); the session TimeZone only changes how values print.
        pool = Pool(url, size=size, overflow=size, connect_args=_connect_args(settings))
        pooler.install(pool, settings)  # behind a transaction pooler: nothing prepared
        return pool

    engines = _engines()
    return engines.once(engines.pools, _key(url, settings), make)


def get_engine(settings: Settings, url: str | None = None) -> Engine:
    """A SQLAlchemy engine for ``url`` (the engine URL by default): for ORM sessions (the
    RLS-enforced reads) and operator tools. The engine's own statements use ``get_pool``."""
    url = url or settings.require_database_url()

    def make() -> Engine:
        # Imported here, not with the module: SQLAlchemy is ~13 MB of a process's memory, and a
        # worker never opens one (store/pg.py).
        from sqlalchemy import create_engine

        size = settings.pool_size
        engine = create_engine(url, pool_size=size, max_overflow=size, connect_args=_connect_args(settings))
        pooler.install(engine, settings)  # behind a transaction pooler: nothing prepared
        return engine

    engines = _engines()
    return engines.once(engines.by_url, _key(url, settings), make)


def _connect_args(settings: Settings) -> dict[str, Any]:
    args: dict[str, Any] = {"application_name": "motir-celery"}
    if not settings.prepared_statements:
        # Behind a transaction pooler: psycopg must not prepare anything on its own either.
        args["prepare_threshold"] = None
    return args


def side_engine(settings: Settings) -> Pool:
    """The pool of the worker's side duties (heartbeats, sweeps): one connection of its own
    per process, so a busy run pool cannot starve them. Pinged before each use (a round trip
    once a second at most: the cost is nothing)."""
    url = settings.require_database_url()

    def make() -> Pool:
        pool = Pool(url, size=1, overflow=0, pre_ping=True, connect_args=_connect_args(settings))
        pooler.install(pool, settings)
        return pool

    engines = _engines()
    return engines.once(engines.pools, "side:" + _key(url, settings), make)


def get_listener(settings: Settings) -> Listener | None:
    """This process's LISTEN connection for stream followers (store/listen.py), on the engine URL
    (the primary: a standby cannot LISTEN, and notifications are not replicated) — or None when a
    transaction pooler stands in front of it (PgBouncer in transaction mode: the followers poll)."""
    pool = get_pool(settings)
    if not pooler.decided(pool):
        with pool.connect():  # the engine's first connection: the pooler probe runs now
            pass
    if pooler.found(pool):
        return None
    url = settings.require_database_url()
    engines = _engines()
    return engines.once(engines.listeners, _key(url, settings),
                        lambda: Listener(pool.conninfo, _connect_args(settings)))


def _key(url: str, settings: Settings) -> str:
    """A pool is made per URL and per way of sending statements (two engines of one process on one
    URL, one preparing and one not, do not share connections)."""
    return f"{url} prepare={settings.prepared_statements} probe={settings.detect_pooler}"


def dispose_engines() -> None:
    """Drop every pooled connection of this process (at shutdown, and in tests)."""
    engines = _engines()
    with engines.lock:
        for pool in engines.pools.values():
            pool.dispose()
        for engine in engines.by_url.values():
            engine.dispose()
        for listener in engines.listeners.values():
            listener.close()
        engines.pools.clear()
        engines.by_url.clear()
        engines.listeners.clear()


@contextmanager
def engine_connection(settings: Settings) -> Iterator[PooledConnection]:
    """A connection in a transaction that commits on success, as the engine role."""
    with get_pool(settings).begin() as conn:
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


def set_workspace_context(conn: Connection | PooledConnection | Session, workspace_id: str | None, *,
                          admin: bool = False) -> None:
    """Scope the current transaction to one workspace (and optionally system rows).

    ``set_config(..., true)`` is the transaction-local form of SET LOCAL, usable
    with bound parameters; the setting vanishes at COMMIT or ROLLBACK.
    """
    workspace_id = validate_workspace_id(workspace_id)
    # A Session (known without importing the ORM: there is none before it is imported) runs on its connection().
    orm = sys.modules.get("sqlalchemy.orm")
    on = conn.connection() if orm is not None and isinstance(conn, orm.Session) else conn
    session.workspace_context(on, workspace_id, admin=admin)  # type: ignore[arg-type]  # not a Session any more


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
    return settings.require_database_url(), APP_ROLE


def primary_wal_lsn(settings: Settings) -> str:
    """The engine's server's current WAL write position: every transaction committed
    before the call is before it (``reads.replayed`` tells when a standby shows it)."""
    with engine_connection(settings) as conn:
        return session.primary_wal_lsn(conn)


@contextmanager
def workspace_session(
    workspace_id: str | None, *, settings: Settings, admin: bool = False
) -> Iterator[Session]:
    """A Session under the app role, scoped to ``workspace_id``; commits on success.

    ``admin=True`` is the cross-workspace escape hatch of admin tooling (seed
    001): it shows system rows (NULL workspace) *and every workspace's rows*,
    whatever ``workspace_id`` says — through a login of ``motir_admin``
    (``reader_login``), since the policies ignore ``motir.system_admin`` for
    anyone else. Without it, ``workspace_id=None`` sees nothing.
    """
    url, role = reader_login(settings, admin=admin)
    engine = get_engine(settings, url)
    # Imported here, not with the module: the ORM is ~6 MB of every worker process's memory,
    # and no worker path opens a Session.
    from sqlalchemy.orm import Session

    with Session(engine) as orm, orm.begin():
        if role is not None:
            # Same login as the engine: drop to the reading role for this transaction only.
            session.reader_role(orm.connection(), role)
        set_workspace_context(orm, workspace_id, admin=admin)
        yield orm
