"""How the hot statements reach Postgres: the psycopg connection under a SQLAlchemy one.

``queue`` holds the SQL; this module only sends it. Two ways, both inside
whatever transaction the SQLAlchemy ``Connection`` is in, all raising
SQLAlchemy's ``DBAPIError`` family as ``conn.execute`` would (a connection the
error left unusable is invalidated first, so the pool replaces it):

* ``hot`` (``hot_rows``): one statement, prepared, its first row (every row);
  the caller waits for it.
* ``Pipe``: an attempt's fenced writes, each its own transaction, sent now and
  answered later (steps.py says when the answers are read).
"""

from __future__ import annotations

import re
import select
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import psycopg
from psycopg import pq
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

__all__ = ["Pipe", "Prepared", "hot", "hot_rows", "translated"]


def hot(conn: Connection, sql: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
    """One hot statement as a server-side prepared statement on the driver
    connection, inside whatever transaction ``conn`` is in; its first row.

    Errors come out as SQLAlchemy's ``DBAPIError`` family, as from
    ``conn.execute``; a connection the error left unusable (the server went
    away) is invalidated first, so the pool replaces it and
    ``exc.connection_invalidated`` tells the runner to claim on a new one.
    """
    rows = hot_rows(conn, sql, params)
    return rows[0] if rows else None


def hot_rows(conn: Connection, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """``hot``, with every row."""
    raw = conn.connection.driver_connection
    try:
        with raw.cursor() as cursor:
            return cursor.execute(sql, params, prepare=True).fetchall()
    except psycopg.Error as exc:
        raise translated(conn, raw, sql, params, exc) from exc


def translated(conn: Connection, raw: Any, sql: str, params: dict[str, Any], exc: psycopg.Error) -> DBAPIError:
    broken = raw.closed or raw.broken
    if broken:
        conn.invalidate(exc)
    return DBAPIError.instance(sql, params, exc, psycopg.Error, connection_invalidated=broken)


_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


@dataclass(frozen=True)
class Prepared:
    """A hot statement as libpq wants it: ``$n`` placeholders, its parameter names in order."""

    name: bytes
    sql: bytes
    params: tuple[str, ...]

    @classmethod
    def of(cls, name: str, sql: str) -> "Prepared":
        names: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match.group(1) not in names:
                names.append(match.group(1))
            return f"${names.index(match.group(1)) + 1}"

        return cls(name.encode(), _PLACEHOLDER.sub(number, sql).encode(), tuple(names))

    def values(self, params: dict[str, Any], encoding: str) -> list[bytes | None]:
        # Text format, types inferred by the server from the statement (uuid, jsonb, float8, bool),
        # in the connection's client encoding.
        return [None if v is None else b"t" if v is True else b"f" if v is False else str(v).encode(encoding)
                for v in (params[n] for n in self.params)]


class Pipe:
    """The attempt's fenced writes, sent without waiting for their answers.

    The attempt's connection enters libpq's pipeline mode for its first write;
    each write is followed by a Sync, so it is still its own transaction and its
    own commit (an autocommit statement, as in ``hot``), and the server runs
    them in the order sent. Answers are read later, in that order: at once when
    they have already arrived (``answers(block=False)``), or waiting for all of
    them (``answers(block=True)``), which also leaves pipeline mode, so the
    connection is an ordinary one again. Nothing else may use the connection
    while a write is in flight; ``Step`` drains the pipe before any other statement.
    """

    def __init__(self, conn: Connection, prepared: Sequence[str]) -> None:
        self._conn = conn
        self._raw = conn.connection.driver_connection
        #: Tags of the writes sent and not answered yet, with when each was sent (monotonic).
        self._in_flight: deque[tuple[Any, float]] = deque()
        #: The statements prepared on this session (read by the claim: see there).
        self._prepared = {name.encode() for name in prepared}

    @property
    def idle(self) -> bool:
        return not self._in_flight

    def lagging(self, seconds: float) -> bool:
        """Whether a write sent more than ``seconds`` ago is still unanswered."""
        return bool(self._in_flight) and time.monotonic() - self._in_flight[0][1] > seconds

    def send(self, statement: Prepared, params: dict[str, Any], tag: Any) -> None:
        pg = self._raw.pgconn
        try:
            if pg.pipeline_status == 0:
                pg.enter_pipeline_mode()
            if statement.name not in self._prepared:
                pg.send_prepare(statement.name, statement.sql)
                pg.pipeline_sync()
                self._in_flight.append((_Prepare(statement.name), time.monotonic()))
                self._prepared.add(statement.name)
            pg.send_query_prepared(statement.name, statement.values(params, self._raw.info.encoding))
            pg.pipeline_sync()
            self._in_flight.append((tag, time.monotonic()))
            while pg.flush():  # (a nonblocking connection: send what did not fit in the socket)
                select.select([], [pg.socket], [])
        except psycopg.Error as exc:
            raise translated(self._conn, self._raw, statement.sql.decode(), params, exc) from exc

    def answers(self, *, block: bool) -> list[tuple[Any, float, tuple[Any, ...] | None]]:
        """(tag, when sent, first row or None) of each write answered so far, in the order sent;
        with ``block``, of every write in flight. A write the server refused with an
        error is raised once every write in flight is answered (the writes after it
        still ran: each is its own transaction), so the connection is out of
        pipeline mode and usable for what the caller does about it (a failure's settle)."""
        pg = self._raw.pgconn
        out: list[tuple[Any, float, tuple[Any, ...] | None]] = []
        error: psycopg.Error | None = None
        try:
            while self._in_flight:
                results = self._results(pg, block or error is not None)
                if results is None:
                    break
                tag, sent = self._in_flight.popleft()
                result = results[0]
                if isinstance(tag, _Prepare):
                    if result.status != pq.ExecStatus.FATAL_ERROR or result.error_field(
                            pq.DiagnosticField.SQLSTATE) == b"42P05":  # duplicate_prepared_statement: there already
                        continue
                    self._prepared.discard(tag.name)  # prepared again on the next use
                if result.status == pq.ExecStatus.FATAL_ERROR:
                    error = error or psycopg.errors.error_from_result(result, encoding=self._raw.info.encoding)
                    continue
                out.append((tag, sent, self._row(result)))
            if not self._in_flight and pg.pipeline_status != 0:
                pg.exit_pipeline_mode()
            if error is not None:
                raise error
        except psycopg.Error as exc:
            raise translated(self._conn, self._raw, "(pipelined write)", {}, exc) from exc
        return out

    def _results(self, pg: Any, block: bool) -> list[Any] | None:
        """The results of the next write and its Sync; None (nothing consumed) when
        not all of them are in yet and ``block`` is off."""
        pending: list[Any] = []
        ends = 0
        while True:
            pg.consume_input()
            while not pg.is_busy():
                result = pg.get_result()
                if result is None:  # the end of one statement's results
                    ends += 1
                    if ends > 1:  # libpq has nothing more to give: we lost count of what was sent
                        raise psycopg.InterfaceError("pipelined writes out of step with their answers")
                    continue
                if result.status == pq.ExecStatus.PIPELINE_SYNC:
                    return pending
                pending.append(result)
            if not block and not pending:
                return None
            select.select([pg.socket], [], [])

    def _row(self, result: Any) -> tuple[Any, ...] | None:
        if result.status != pq.ExecStatus.TUPLES_OK or result.ntuples == 0:
            return None
        return tuple(result.get_value(0, i) for i in range(result.nfields))

    def abandon(self) -> None:
        """The attempt ended with writes in flight (an exception escaped): the
        connection cannot go back to the pool in pipeline mode."""
        if self._in_flight or self._raw.pgconn.pipeline_status != 0:
            self._in_flight.clear()
            self._conn.invalidate()


@dataclass(frozen=True)
class _Prepare:
    """The tag of a prepare sent ahead of a statement's first use on a connection."""

    name: bytes
