"""A connection its owner keeps, lent for every checkout: each of the borrower's transactions a savepoint.

What an engine works on while a framework's test holds the whole test in one transaction that
is rolled back at its end (Django's ``TestCase``; contrib/django/testdb.py): every statement of
the engine — a run's write, its claim, each step record, the settle, a result read — goes on
the test's own connection, inside that transaction, so it sees the test's rows, the test sees
its rows, and the rollback at the test's end takes all of them. ``begin()`` is a savepoint
(psycopg's nested ``transaction()``): a block that fails rolls back to it and leaves the
test's transaction usable; ``execution_options(isolation_level="AUTOCOMMIT")`` changes nothing
(a statement outside ``begin()`` is simply part of the owner's transaction). Nothing here
commits, rolls back the owner's transaction, or closes the connection.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from types import TracebackType
from typing import Any, Iterator

import psycopg
from psycopg import pq

from motir_celery.store.pg import BorrowedConnection, PooledConnection, Transaction

__all__ = ["LentPool", "SavepointConnection", "in_open_transaction"]


def in_open_transaction(raw: psycopg.Connection[Any] | None) -> bool:
    """Whether ``raw`` is inside a transaction that has begun on the server (one a savepoint can nest in)."""
    return raw is not None and not raw.closed and raw.info.transaction_status == pq.TransactionStatus.INTRANS


class _Savepoint(Transaction):
    """A savepoint for a ``with`` block: released at its end, rolled back to on an error."""

    def __init__(self, raw: psycopg.Connection[Any]) -> None:
        super().__init__(raw, owned=False)
        self._block: AbstractContextManager[Any] | None = raw.transaction()
        self._block.__enter__()

    def commit(self) -> None:
        block, self._block = self._block, None
        if block is not None:
            block.__exit__(None, None, None)

    def rollback(self) -> None:
        block, self._block = self._block, None
        if block is not None:
            exc = psycopg.Rollback()
            block.__exit__(type(exc), exc, None)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.commit()
        else:
            self.rollback()


class SavepointConnection(BorrowedConnection):
    """The owner's connection, in its open transaction: ``begin()`` is a savepoint."""

    def execution_options(self, *, isolation_level: str) -> PooledConnection:
        return self  # the owner's transaction holds every statement; nothing commits on its own

    def begin(self) -> Transaction:
        return _Savepoint(self.raw)

    def in_transaction(self) -> bool:
        return True


class LentPool:
    """``Pool``'s ``connect()`` / ``begin()`` over one connection its owner keeps (the module docstring)."""

    def __init__(self, raw: psycopg.Connection[Any]) -> None:
        self.raw = raw

    def connect(self) -> SavepointConnection:
        return SavepointConnection(self.raw)

    @contextmanager
    def begin(self) -> Iterator[SavepointConnection]:
        conn = self.connect()
        with conn.begin():
            yield conn
