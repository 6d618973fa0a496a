"""The engine role's own connections: psycopg in psycopg's own pool, with no SQLAlchemy in between.

The engine sends only catalogued statements (``driver.py``), so it needs a pool, transactions
and invalidation, not an SQL toolkit. SQLAlchemy's core is ~13 MB of every worker process's
memory, and its checkout a share of each run's CPU (docs/performance.md, "Where a run's CPU
goes"). SQLAlchemy stays what a caller brings (a
``Session``, an ``AsyncSession``), the models and migrations, and the RLS-enforced reads.

``Pool`` and ``PooledConnection`` offer the part of SQLAlchemy's ``Engine`` and ``Connection``
the engine's code uses — ``connect()``, ``begin()``, ``execution_options(isolation_level=
"AUTOCOMMIT")``, ``invalidate()``, ``dispose()`` — with the same meaning, so one store function
serves a connection of either kind, over ``psycopg_pool.ConnectionPool`` (a pool of our own
measured no faster: docs/performance.md, "Tried and did not pay"). Errors are psycopg's own; a
connection a statement found broken is invalidated and the statement raises ``ConnectionLost``
(``driver.rows``), and every older connection of its pool is replaced (``drain``).

Hazards, psycopg_pool's as configured here: a connection is not pinged when lent (the side
pool's are: ``check_connection``), so a socket a restart killed fails its first statement. New
connections are made by the pool's worker threads (three, and its scheduler: per process, a
child making its own after a fork): while Postgres cannot be reached a checkout waits up to the
pool's timeout (30 s) for one and then raises ``PoolTimeout``, the reason in the pool's WARNINGs,
where a connect of the caller's own would fail at once. None is opened before it is asked for
(``min_size`` 0); one left idle beyond what a process uses is closed after ``max_idle`` (10 min),
and each is replaced after ``max_lifetime`` (1 h). One its borrower never closes is never taken
back. A connection comes back rolled back and out of autocommit; session state a borrower set
with ``SET`` (not ``set_config(..., true)``) would stay, and no statement of the engine's does that.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Callable, Iterator
from urllib.parse import SplitResult, urlsplit, urlunsplit

import psycopg
from psycopg import pq
from psycopg_pool import ConnectionPool
from psycopg_pool import PoolTimeout as LibraryTimeout

__all__ = ["Pool", "PooledConnection", "BorrowedConnection", "Transaction", "ConnectionLost", "PoolTimeout",
           "conninfo", "hide_password"]

#: Listener of a new connection (``"connect"``: raw, None) or of each checkout (``"checkout"``:
#: raw, None, None): the signatures of SQLAlchemy's pool events, so store/pooler.py serves both.
Listener = Callable[..., None]


class ConnectionLost(psycopg.OperationalError):
    """A statement found its connection broken (a database restart, a killed backend): the
    connection is invalidated and every older one of its pool replaced at its next checkout."""


class PoolTimeout(psycopg.OperationalError):
    """No connection came free within the pool's timeout (every one is checked out)."""


def conninfo(url: str) -> str:
    """libpq's URI for a SQLAlchemy-style URL (``postgresql+psycopg://…``: the dialect dropped)."""
    parts = urlsplit(url)
    if not parts.scheme.startswith(("postgresql", "postgres")):
        raise ValueError(f"not a PostgreSQL URL: {hide_password(url)}")
    return urlunsplit(parts._replace(scheme="postgresql"))


def hide_password(url: str) -> str:
    """``url`` with its password shown as ``***`` (for logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(SplitResult(parts.scheme, f"{user}:***@{netloc[1]}", parts.path, parts.query, parts.fragment))


class Pool:
    """Up to ``size + overflow`` psycopg connections to one URL, in psycopg's own pool
    (``psycopg_pool.ConnectionPool``): made on demand by its worker threads, kept idle between
    uses and closed after ``max_idle`` unused beyond ``min_size`` (0). Thread-safe; made per
    process (``store/db.py``): its threads do not survive a fork, and a child makes its own."""

    def __init__(self, url: str, *, size: int, overflow: int, connect_args: dict[str, Any],
                 pre_ping: bool = False, timeout: float = 30.0) -> None:
        self.url = url
        self.where = hide_password(url)
        self.conninfo = conninfo(url)
        self.connect_args = dict(connect_args)
        self.size, self.overflow, self.pre_ping, self.timeout = size, overflow, pre_ping, timeout
        self._listeners: dict[str, list[Listener]] = {"connect": [], "checkout": []}
        self._lock = threading.Lock()
        self._pool: ConnectionPool[Any] | None = None
        self._lent = 0  # connections checked out now (psycopg_pool counts those being made with them)

    def _library(self) -> ConnectionPool[Any]:
        pool = self._pool
        if pool is None:
            with self._lock:
                pool = self._pool
                if pool is None:
                    pool = self._pool = ConnectionPool(
                        self.conninfo, kwargs=self.connect_args, min_size=0, max_size=self.size + self.overflow,
                        timeout=self.timeout, configure=self._configure, name=f"motir {self.where}",
                        check=ConnectionPool.check_connection if self.pre_ping else None, open=True)
        return pool

    def _configure(self, raw: psycopg.Connection[Any]) -> None:
        for listener in self._listeners["connect"]:
            listener(raw, None)

    def listen(self, name: str, listener: Listener) -> None:
        """Call ``listener`` at each new connection (``"connect"``) or each checkout (``"checkout"``)."""
        self._listeners[name].append(listener)

    def unlisten(self, name: str, listener: Listener) -> None:
        """Stop calling ``listener`` (``listen``'s)."""
        self._listeners[name].remove(listener)

    def connect(self) -> PooledConnection:
        """A connection of the pool, checked out until its ``close()`` (or its ``with`` block's end)."""
        library = self._library()
        try:
            raw = library.getconn()
        except LibraryTimeout as exc:
            raise PoolTimeout(f"no connection to {self.where} came free in {self.timeout:g}s "
                              f"({self.checkedout()} checked out)") from exc
        try:
            for listener in self._listeners["checkout"]:
                listener(raw, None, None)
        except BaseException:
            library.putconn(raw)
            raise
        with self._lock:
            self._lent += 1
        return PooledConnection(self, raw, library)

    @contextmanager
    def begin(self) -> Iterator[PooledConnection]:
        """A connection in a transaction that commits at the block's end (rolls back on an error)."""
        with self.connect() as conn, conn.begin():
            yield conn

    def dispose(self) -> None:
        """Close every idle connection; those checked out are closed when they come back."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def invalidate_older(self) -> None:
        """Every connection made until now is replaced at its next checkout (a restart killed them all)."""
        pool = self._pool
        if pool is not None:
            pool.drain()

    def checkedout(self) -> int:
        """Connections lent now (SQLAlchemy's pool says the same with ``checkedout()``)."""
        return self._lent

    def checkin(self, raw: psycopg.Connection[Any], library: ConnectionPool[Any]) -> None:
        """``raw`` back from its borrower: rolled back, out of autocommit, and back to its pool (which
        drops a broken one, or one made before a ``dispose`` or an ``invalidate_older``)."""
        if not (raw.closed or raw.broken):
            try:
                if raw.info.transaction_status != pq.TransactionStatus.IDLE:
                    raw.rollback()  # as SQLAlchemy's reset on return: nothing leaks to the next borrower
                if raw.autocommit:
                    raw.autocommit = False
            except psycopg.Error:
                raw.close()
        try:
            library.putconn(raw)
        finally:
            with self._lock:
                self._lent -= 1


class PooledConnection:
    """One connection checked out of a ``Pool``: SQLAlchemy ``Connection``'s ``begin()``,
    ``execution_options(isolation_level=…)``, ``invalidate()``, ``close()`` and ``in_transaction()``."""

    def __init__(self, pool: Pool | None, raw: psycopg.Connection[Any], library: ConnectionPool[Any] | None) -> None:
        #: The pool it goes back to (None: a ``BorrowedConnection``, nobody's).
        self.engine = pool
        self.raw = raw
        self._library = library
        self._closed = False

    def execution_options(self, *, isolation_level: str) -> PooledConnection:
        """``"AUTOCOMMIT"``: each statement its own transaction; any other level: transactions."""
        self.raw.autocommit = isolation_level == "AUTOCOMMIT"
        if isolation_level != "AUTOCOMMIT":
            self.raw.isolation_level = psycopg.IsolationLevel[isolation_level.replace(" ", "_")]
        return self

    def begin(self) -> Transaction:
        """A transaction for a ``with`` block. In autocommit, as with SQLAlchemy, it groups nothing:
        each statement in it commits on its own."""
        if not self.raw.autocommit and self.raw.info.transaction_status != pq.TransactionStatus.IDLE:
            raise RuntimeError("a transaction is already begun on this connection")
        return Transaction(self.raw)

    def in_transaction(self) -> bool:
        return self.raw.info.transaction_status != pq.TransactionStatus.IDLE

    def invalidate(self) -> None:
        """Close the connection: it goes back to no one (the pool makes a new one)."""
        self.raw.close()

    def close(self) -> None:
        if not self._closed and self.engine is not None and self._library is not None:
            self._closed = True
            self.engine.checkin(self.raw, self._library)

    def __enter__(self) -> PooledConnection:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class BorrowedConnection(PooledConnection):
    """A psycopg connection its owner keeps (Django's, inside ``transaction.atomic()``): statements
    go on it in whatever transaction it is in, and its owner alone ends that transaction and the
    connection — ``begin()`` groups nothing, ``close()`` and ``invalidate()`` leave it be."""

    def __init__(self, raw: psycopg.Connection[Any]) -> None:
        super().__init__(None, raw, None)

    def execution_options(self, *, isolation_level: str) -> PooledConnection:
        raise RuntimeError("a borrowed connection's transaction is its owner's")

    def begin(self) -> Transaction:
        return Transaction(self.raw, owned=False)

    def invalidate(self) -> None:
        pass

    def close(self) -> None:
        pass


class Transaction:
    """``PooledConnection.begin()``'s transaction: commits at its block's end, rolls back on an error
    (or when ``rollback()`` is called in it)."""

    def __init__(self, raw: psycopg.Connection[Any], *, owned: bool = True) -> None:
        self._raw = raw
        self._done = not owned  # a borrowed connection's transaction: its owner ends it

    def commit(self) -> None:
        if not self._done:
            self._done = True
            if not self._raw.autocommit:
                self._raw.commit()

    def rollback(self) -> None:
        if not self._done:
            self._done = True
            if not self._raw.autocommit and not self._raw.broken and not self._raw.closed:
                self._raw.rollback()

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.commit()
        else:
            self.rollback()
