"""The engine role's own connections: psycopg in a pool of ours, with no SQLAlchemy in between.

The engine sends only catalogued statements (``driver.py``), so it needs a pool, transactions
and invalidation, not an SQL toolkit. SQLAlchemy's core is ~13 MB of every worker process's
memory, and its checkout a share of each run's CPU (docs/performance.md, "Where a run's CPU
goes"). SQLAlchemy stays what a caller brings (a
``Session``, an ``AsyncSession``), the models and migrations, and the RLS-enforced reads.

``Pool`` and ``PooledConnection`` offer the part of SQLAlchemy's ``Engine`` and ``Connection``
the engine's code uses — ``connect()``, ``begin()``, ``execution_options(isolation_level=
"AUTOCOMMIT")``, ``invalidate()``, ``dispose()`` — with the same meaning, so one store function
serves a connection of either kind. Errors are psycopg's own; a connection a statement found
broken is invalidated and the statement raises ``ConnectionLost`` (``driver.rows``).

Hazards, as with SQLAlchemy's pool configured as store/db.py did: a connection is not pinged
when lent (the side pool's are), so a socket a restart killed fails its first statement; a
connection is kept however old it is; one its borrower never closes is never taken back. A
connection comes back rolled back and out of autocommit; session state a borrower set with
``SET`` (not ``set_config(..., true)``) would stay, and no statement of the engine's does that.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Callable, Iterator
from urllib.parse import SplitResult, urlsplit, urlunsplit

import psycopg
from psycopg import pq

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
    """Up to ``size + overflow`` psycopg connections to one URL, ``size`` of them kept idle
    between uses (last used, first reused). Thread-safe; made per process (``store/db.py``)."""

    def __init__(self, url: str, *, size: int, overflow: int, connect_args: dict[str, Any],
                 pre_ping: bool = False, timeout: float = 30.0) -> None:
        self.url = url
        self.where = hide_password(url)
        self.conninfo = conninfo(url)
        self.connect_args = dict(connect_args)
        self.size, self.overflow, self.pre_ping, self.timeout = size, overflow, pre_ping, timeout
        self._cond = threading.Condition()
        self._idle: list[tuple[psycopg.Connection[Any], float]] = []  # (connection, made at)
        self._count = 0  # connections in existence: idle and checked out
        #: Connections made before this moment are closed at their next checkout or checkin
        #: (``invalidate_older``, ``dispose``).
        self._epoch = 0.0
        self._listeners: dict[str, list[Listener]] = {"connect": [], "checkout": []}

    def listen(self, name: str, listener: Listener) -> None:
        """Call ``listener`` at each new connection (``"connect"``) or each checkout (``"checkout"``)."""
        self._listeners[name].append(listener)

    def unlisten(self, name: str, listener: Listener) -> None:
        """Stop calling ``listener`` (``listen``'s)."""
        self._listeners[name].remove(listener)

    def connect(self) -> PooledConnection:
        """A connection of the pool, checked out until its ``close()`` (or its ``with`` block's end)."""
        raw, made = self._checkout()
        return PooledConnection(self, raw, made)

    @contextmanager
    def begin(self) -> Iterator[PooledConnection]:
        """A connection in a transaction that commits at the block's end (rolls back on an error)."""
        with self.connect() as conn, conn.begin():
            yield conn

    def dispose(self) -> None:
        """Close every idle connection; those checked out are closed when they come back."""
        with self._cond:
            self._epoch = time.monotonic()
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._cond.notify_all()
        for raw, _ in idle:
            raw.close()

    def invalidate_older(self) -> None:
        """Every connection made until now is replaced at its next checkout (a restart killed them all)."""
        with self._cond:
            self._epoch = time.monotonic()

    def checkedout(self) -> int:
        """Connections lent now (SQLAlchemy's pool says the same with ``checkedout()``)."""
        with self._cond:
            return self._count - len(self._idle)

    # --- checkout and checkin -------------------------------------------------------------

    def _checkout(self) -> tuple[psycopg.Connection[Any], float]:
        deadline = time.monotonic() + self.timeout
        while True:
            with self._cond:
                while not self._idle and self._count >= self.size + self.overflow:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise PoolTimeout(f"no connection to {self.where} came free in {self.timeout:g}s "
                                          f"({self._count} checked out)")
                    self._cond.wait(left)
                if self._idle:
                    raw, made = self._idle.pop()
                else:
                    raw, made = None, 0.0
                    self._count += 1
            if raw is None:
                return self._new(), time.monotonic()
            if made < self._epoch or raw.closed or (self.pre_ping and not _answers(raw)):
                self._discard(raw)
                continue
            for listener in self._listeners["checkout"]:
                listener(raw, None, None)
            return raw, made

    def _new(self) -> psycopg.Connection[Any]:
        raw = None
        try:
            raw = psycopg.connect(self.conninfo, **self.connect_args)
            for listener in self._listeners["connect"]:
                listener(raw, None)
            for listener in self._listeners["checkout"]:
                listener(raw, None, None)
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            if raw is not None:
                raw.close()
            raise
        return raw

    def _discard(self, raw: psycopg.Connection[Any]) -> None:
        with self._cond:
            self._count -= 1
            self._cond.notify()
        raw.close()

    def checkin(self, raw: psycopg.Connection[Any], made: float) -> None:
        """``raw`` back from its borrower: rolled back, out of autocommit, and kept or closed."""
        if raw.closed or raw.broken or made < self._epoch:
            self._discard(raw)
            return
        try:
            if raw.info.transaction_status != pq.TransactionStatus.IDLE:
                raw.rollback()  # as SQLAlchemy's reset on return: nothing leaks to the next borrower
            if raw.autocommit:
                raw.autocommit = False
        except psycopg.Error:
            self._discard(raw)
            return
        with self._cond:
            if len(self._idle) < self.size and made >= self._epoch:
                self._idle.append((raw, made))
                self._cond.notify()
                return
        self._discard(raw)


def _answers(raw: psycopg.Connection[Any]) -> bool:
    """The side pool's ping: a round trip before the connection is lent."""
    try:
        raw.execute("SELECT 1")
        if not raw.autocommit:
            raw.rollback()
        return True
    except psycopg.Error:
        return False


class PooledConnection:
    """One connection checked out of a ``Pool``: SQLAlchemy ``Connection``'s ``begin()``,
    ``execution_options(isolation_level=…)``, ``invalidate()``, ``close()`` and ``in_transaction()``."""

    def __init__(self, pool: Pool | None, raw: psycopg.Connection[Any], made: float) -> None:
        #: The pool it goes back to (None: a ``BorrowedConnection``, nobody's).
        self.engine = pool
        self.raw = raw
        self._made = made
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
        if not self._closed and self.engine is not None:
            self._closed = True
            self.engine.checkin(self.raw, self._made)

    def __enter__(self) -> PooledConnection:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class BorrowedConnection(PooledConnection):
    """A psycopg connection its owner keeps (Django's, inside ``transaction.atomic()``): statements
    go on it in whatever transaction it is in, and its owner alone ends that transaction and the
    connection — ``begin()`` groups nothing, ``close()`` and ``invalidate()`` leave it be."""

    def __init__(self, raw: psycopg.Connection[Any]) -> None:
        super().__init__(None, raw, 0.0)

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
