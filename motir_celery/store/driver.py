"""How a catalogued statement reaches Postgres: through psycopg, on a connection of either kind.

``store/sql/`` holds the SQL, one module per audience; this module only sends it
(``rows``, ``first``; ``rows_async`` for an asyncio connection), inside whatever
transaction the connection is in (the runner's is in autocommit: one statement, one
transaction, one round trip), and hands back rows read by column name. A ``Conn`` is
the engine's own (``store/pg.py``'s ``PooledConnection``) or a caller's SQLAlchemy
``Connection`` (a ``Session``'s). Errors come out as that connection's kind raises
them: psycopg's own on the engine's, SQLAlchemy's ``DBAPIError`` family on a
SQLAlchemy one. A connection the error left unusable is invalidated first, so its pool
replaces it (and every older one): ``pg.ConnectionLost`` on the engine's,
``exc.connection_invalidated`` on SQLAlchemy's.

Hazard of server-side prepared statements (on by default): a prepared statement lives in
the server session, so a transaction pooler (PgBouncer in transaction mode) hands it to the
wrong client. Each engine finds such a pooler itself and prepares nothing there
(store/pooler.py: a probe at its first connection; a statement refused for a prepared name
is sent again unprepared); settings with ``prepared_statements=False`` turn preparing off
everywhere, psycopg's automatic preparation of every other statement with it (db.py).
"""

from __future__ import annotations

import re
import sys
import uuid
import zlib
from typing import TYPE_CHECKING, Any, NamedTuple

import psycopg
from psycopg import pq
from psycopg.adapt import Transformer
from psycopg.types.json import JsonbLoader, JsonLoader

from motir_celery.store import pooler
from motir_celery.store.pg import ConnectionLost, PooledConnection

if TYPE_CHECKING:  # callers bring SQLAlchemy's: a worker never imports it (its memory; store/pg.py)
    from typing import TypeAlias

    from sqlalchemy import Connection
    from sqlalchemy.ext.asyncio import AsyncConnection

    #: A connection a statement is sent on: the engine's own, or a caller's SQLAlchemy one.
    Conn: TypeAlias = "PooledConnection | Connection"

__all__ = ["Statement", "rows", "first", "rows_async", "plan", "through_libpq_prepared", "database_errors",
           "integrity_errors"]


def database_errors() -> tuple[type[BaseException], ...]:
    """What a statement fails with: psycopg's errors on the engine's connections, and
    SQLAlchemy's ``DBAPIError`` on a SQLAlchemy one (when SQLAlchemy is imported at all)."""
    sa = sys.modules.get("sqlalchemy.exc")
    return (psycopg.Error,) if sa is None else (psycopg.Error, sa.DBAPIError)


def integrity_errors() -> tuple[type[BaseException], ...]:
    """What a statement a constraint refused fails with, on either kind of connection (as
    ``database_errors``): psycopg's ``IntegrityError``, and SQLAlchemy's when it is imported."""
    sa = sys.modules.get("sqlalchemy.exc")
    return (psycopg.IntegrityError,) if sa is None else (psycopg.IntegrityError, sa.IntegrityError)


class Statement(NamedTuple):
    """One catalogued statement: its name, what it does in one line, its SQL
    (psycopg ``%(name)s`` placeholders; each predicate's reason in a comment).

    ``prepare=False``: never prepared server-side, so every call is planned for its own
    values. For a statement with optional predicates (``CAST(%(x)s AS text) IS NULL OR
    col = %(x)s``): after five calls Postgres may switch a prepared one to a generic plan,
    which cannot use the filter's index (a filtered list of 300,000 runs went from 1 ms
    to 50 ms)."""

    name: str
    doc: str
    sql: str
    prepare: bool = True
    #: Sent through libpq itself when prepared (``through_libpq_prepared``): for the statements a run
    #: sends per step (each parameter cast in the SQL: it is sent as text).
    libpq: bool = False


def rows(conn: Conn, statement: Statement, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Every row of ``statement``, each a dict by column name: prepared on the server where it may
    be (``_prepares``), and sent through libpq (the per-step statements) or psycopg's cursor; a
    failure raised as the connection's kind raises it (``_failed``)."""
    raw = conn.raw if isinstance(conn, PooledConnection) else conn.connection.driver_connection
    if not isinstance(raw, psycopg.Connection):
        # A sync Connection over an asyncio driver (AsyncConnection.run_sync): SQLAlchemy sends it.
        assert not isinstance(conn, PooledConnection)
        result = conn.exec_driver_sql(statement.sql, params)
        return [dict(r) for r in result.mappings()] if result.returns_rows else []
    prepare = _prepares(conn, raw, statement)
    try:
        return _send(raw, statement, params, prepare)
    except psycopg.Error as exc:
        if prepare and pooler.refused(conn, raw, exc):
            # A transaction pooler the engine's probe missed (store/pooler.py): nothing of the
            # statement ran, and this connection prepares nothing any more. Once more, unprepared.
            return rows(conn, statement, params)
        failure = _failed(conn, raw, statement, params, exc)
        if failure is exc:
            raise
        raise failure from exc


def _prepares(conn: Conn, raw: psycopg.Connection[Any], statement: Statement) -> bool:
    """Whether ``statement`` is prepared on ``raw``'s server: not on a connection made with
    ``prepare_threshold=None`` (the engine found a transaction pooler; doctor's one-shot
    connections), nor on one lent by its owner (Django's, whose preparing is its own: a
    ``BorrowedConnection`` has no pool)."""
    borrowed = isinstance(conn, PooledConnection) and conn.engine is None
    prepare = statement.prepare and not borrowed and raw.prepare_threshold is not None
    if prepare and pooler.found(conn.engine):  # a connection made before the pooler was found
        pooler.unprepared(raw)
        return False
    return prepare


def _send(raw: psycopg.Connection[Any], statement: Statement, params: dict[str, Any],
          prepare: bool) -> list[dict[str, Any]]:
    kept = _kept_with(raw)
    if prepare and statement.libpq and raw.autocommit:
        # (Only in autocommit: psycopg begins a transaction when its cursor sends the first
        # statement, and a statement sent past it would run, and commit, outside the caller's.)
        found = through_libpq_prepared(raw, statement, params, kept)
        if found is not None:
            return found
    cursor = kept.cursor
    cursor.execute(statement.sql, params, prepare=prepare)
    answer = cursor.pgresult
    if answer is None or answer.status != pq.ExecStatus.TUPLES_OK:
        return []
    names = _columns.get(statement.sql)
    if names is None or len(names) != answer.nfields:
        names = _columns[statement.sql] = tuple(column.name for column in cursor.description or ())
    return [dict(zip(names, values)) for values in cursor.fetchall()]


def _failed(conn: Conn, raw: psycopg.Connection[Any], statement: Statement, params: dict[str, Any],
            exc: psycopg.Error) -> BaseException:
    """What a failed statement raises: psycopg's error on the engine's connection, ``ConnectionLost``
    when it left the connection broken (that one dropped, every older one of its pool replaced: a
    restart killed them all); SQLAlchemy's ``DBAPIError`` on a SQLAlchemy connection, invalidated
    as SQLAlchemy does for a disconnect when broken."""
    broken = raw.closed or raw.broken or raw.pgconn.status == pq.ConnStatus.BAD
    if isinstance(conn, PooledConnection):
        if not broken:
            return exc
        if conn.engine is not None:
            conn.engine.invalidate_older()
        conn.invalidate()
        return ConnectionLost(f"{statement.name}: {exc}")
    from sqlalchemy.exc import DBAPIError  # a SQLAlchemy connection: imported already (it made it)

    if broken:
        conn.invalidate(exc)
        conn.engine.dispose(close=False)  # every older connection replaced (those lent: when returned)
    return DBAPIError.instance(statement.sql, params, exc, psycopg.Error, connection_invalidated=broken)


class Kept:
    """What the driver keeps with one psycopg connection while it is open.

    Its cursor: making one per statement (its adapters, its row maker) was a tenth of a pool
    child's CPU (docs/performance.md, "Where a run's CPU goes"). A pooled connection serves one
    caller at a time, so its cursor does too; it holds its last result until the next statement.
    Its loaders and its statements prepared through libpq (``through_libpq_prepared``)."""

    __slots__ = ("cursor", "loaders", "prepared")

    def __init__(self, raw: psycopg.Connection[Any]) -> None:
        self.cursor = raw.cursor()
        # JSON as psycopg loads it, whatever the connection's owner registered for itself (Django
        # loads jsonb as text on its connection): the cursor's loaders are its own copy.
        self.cursor.adapters.register_loader("jsonb", JsonbLoader)
        self.cursor.adapters.register_loader("json", JsonLoader)
        #: psycopg's own loaders for this connection (its adapters, its time zone).
        self.loaders = Transformer(raw)
        #: The statements prepared under a name of ours on this connection, by SQL.
        self.prepared: dict[str, Prepared] = {}


#: By connection. Not a WeakKeyDictionary: a cursor refers to its connection, which would then
#: never be collected; a closed connection's entry is dropped when a new connection is first seen.
_kept: dict[psycopg.Connection[Any], Kept] = {}


def _kept_with(raw: psycopg.Connection[Any]) -> Kept:
    kept = _kept.get(raw)
    if kept is None or kept.cursor.closed:
        for old in [c for c in list(_kept) if c.closed]:
            _kept.pop(old, None)
        kept = _kept[raw] = Kept(raw)
    return kept


#: Each statement's column names, read from its first result (a statement's columns are fixed).
_columns: dict[str, tuple[str, ...]] = {}


# --- the per-step statements, through libpq ------------------------------------------------
#
# psycopg's cursor spends ~30 us of Python on each statement around libpq's own work (its
# query conversion, parameter dumpers and generators); a run sends four whose answer is a
# count or a flag (three step records, the settle). Those (``libpq=True``) are prepared under
# a name of ours on each connection and sent with PQexecPrepared, their parameters as text
# (the server infers each one's type from the statement: cast it there), their columns read by
# psycopg's own loaders (``Kept.loaders``: the values its cursor would give). PQexecPrepared
# blocks in C with the GIL released: other threads run, and a signal's Python handler (a soft
# time limit) runs when the statement has returned, not while it waits. Errors come back as
# psycopg's. Only on a connection in autocommit (the runner's), where each statement is its
# own transaction.

class Prepared(NamedTuple):
    """One statement prepared on one connection under a name of ours."""

    name: bytes
    params: tuple[str, ...]  #: the parameters' names, in $1, $2... order
    columns: tuple[str, ...]  #: the result's column names


_PARAM = re.compile(r"%\((\w+)\)s")


def through_libpq_prepared(raw: psycopg.Connection[Any], statement: Statement, params: dict[str, Any],
                           kept: Kept | None = None) -> list[dict[str, Any]] | None:
    """The statement's rows, sent prepared with PQexecPrepared; None: the cursor must send it."""
    kept = kept or _kept_with(raw)
    entry = kept.prepared.get(statement.sql) or _prepare(raw, statement, kept.prepared)
    values = [_text(params[k]) for k in entry.params]
    if any(v is _NOT_TEXT for v in values):
        return None
    answer = raw.pgconn.exec_prepared(entry.name, values)  # type: ignore[arg-type]
    if answer.status == pq.ExecStatus.TUPLES_OK:
        # psycopg's own loaders (the connection's adapters, its time zone): the values its cursor gives.
        kept.loaders.set_pgresult(answer)
        return [dict(zip(entry.columns, values)) for values in kept.loaders.load_rows(0, answer.ntuples, tuple)]
    if answer.status == pq.ExecStatus.COMMAND_OK:
        return []
    raise _error(raw, answer)


def _prepare(raw: psycopg.Connection[Any], statement: Statement, prepared: dict[str, Prepared]) -> Prepared:
    order: list[str] = []

    def number(m: re.Match[str]) -> str:
        if m[1] not in order:
            order.append(m[1])
        return f"${order.index(m[1]) + 1}"

    sql = _PARAM.sub(number, statement.sql).replace("%%", "%")
    # One name per statement and SQL, the same on every connection: a pooler that handed one client's
    # session to another (store/pooler.py) can only clash by name, never run another statement.
    name = f"motir_{statement.name}_{zlib.crc32(sql.encode()):08x}".encode()
    made = raw.pgconn.prepare(name, sql.encode(), None)
    if made.status != pq.ExecStatus.COMMAND_OK:
        raise _error(raw, made)
    described = raw.pgconn.describe_prepared(name)
    if described.status != pq.ExecStatus.COMMAND_OK:
        raise _error(raw, described)
    columns = tuple((described.fname(i) or b"").decode() for i in range(described.nfields))
    entry = prepared[statement.sql] = Prepared(name, tuple(order), columns)
    return entry


class _NotText:
    pass


_NOT_TEXT = _NotText()


def _text(value: Any) -> bytes | None | _NotText:
    """A parameter as Postgres reads it in text, the server inferring its type from the statement."""
    if value is None:
        return None
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, (str, uuid.UUID)):
        return str(value).encode()
    if isinstance(value, (int, float)):
        return repr(value).encode()
    return _NOT_TEXT


def _error(raw: psycopg.Connection[Any], answer: pq.abc.PGresult) -> psycopg.Error:
    """libpq's error as the exception psycopg raises for it (its class by SQLSTATE, its diagnostics)."""
    if raw.pgconn.status == pq.ConnStatus.BAD:
        return psycopg.OperationalError((raw.pgconn.error_message or b"the connection was lost").decode(errors="replace"))
    sqlstate = answer.error_field(pq.DiagnosticField.SQLSTATE)
    try:
        cls: type[psycopg.Error] = psycopg.errors.lookup(sqlstate.decode()) if sqlstate else psycopg.DatabaseError
    except KeyError:  # a SQLSTATE psycopg has no class for
        cls = psycopg.DatabaseError
    return cls(answer.error_message.decode(errors="replace").strip(), info=answer)


def first(conn: Conn, statement: Statement, params: dict[str, Any]) -> dict[str, Any] | None:
    """The first row of ``statement``, or None."""
    found = rows(conn, statement, params)
    return found[0] if found else None


async def rows_async(conn: AsyncConnection, statement: Statement, params: dict[str, Any]) -> list[dict[str, Any]]:
    """``rows`` over an asyncio connection (core/producer/aio.py): the same SQL, rows by column name."""
    result = await conn.exec_driver_sql(statement.sql, params)
    return [dict(r) for r in result.mappings().all()] if result.returns_rows else []


def plan(conn: Conn, statement: Statement, params: dict[str, Any], *, analyze: bool = False) -> Any:
    """Postgres's plan of ``statement`` with these parameters (``EXPLAIN (FORMAT JSON)``; with
    ``analyze``, run too: inside a transaction the caller rolls back, for a write)."""
    options = "ANALYZE, BUFFERS, WAL, FORMAT JSON" if analyze else "FORMAT JSON"
    explained = Statement(f"explain {statement.name}", statement.doc, f"EXPLAIN ({options}) {statement.sql}",
                          statement.prepare)
    (found,) = rows(conn, explained, params)
    return found["QUERY PLAN"]
