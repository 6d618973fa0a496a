"""Behind a transaction pooler with no setting: found at an engine's first connection, and nothing prepared there.

Server-side prepared statements (``driver.rows`` prepares the catalogued statements; psycopg
prepares any other one it sees five times) live in the server session. A transaction pooler
(PgBouncer in ``transaction`` or ``statement`` mode, and the like) hands that session to
another client after each transaction, so one client's ``_pg3_0`` is missing, clashes by name,
or — names and parameters matching — is run with another client's parameters.

``install`` makes each engine **probe** its URL when
its pool opens its first connection, before anything is sent on it (``probe``): two
connections of ours ask for their server process's pid in turn, three times each. Directly or
through a session pooler each keeps its own session: two pids, one each. Through a
transaction pooler one of them sees two pids, or both see the same one. Found, every
connection of that engine prepares nothing (``prepare_threshold = None``), and one WARNING
says so. A probe that could not connect leaves preparing on and is tried again at the engine's
next new connection; one still waiting for a server session after ``PROBE_SECONDS`` is taken
for a transaction pooler whose sessions a busy fleet keeps in use (a session pooler whose
clients hold every session gets unprepared statements then: correct, a little slower).
Cost: two short-lived connections per engine and process, once.

The backstop (``refused``): a statement refused for one of psycopg's statement names (the
pooler missed by the probe: its two connections happened to keep a server session each)
turns the engine's preparing off the same way, with the same one WARNING, and — when it was a
statement of its own in autocommit, as every statement of a run is, so that nothing of it ran
and no attempt is charged — ``driver.rows`` sends it again unprepared. What no detector can
see: a statement sent under another client's name with the same parameter types runs that
client's statement. That is why the probe runs before the first statement, not after an error.

Not a setting (docs/settings.md): a pooler that keeps each client's statements apart
(PgBouncer 1.21+ with ``max_prepared_statements``) is taken for one that does not, and gets
unprepared statements — correct, a little slower. A program may still build settings with
``prepared_statements=False`` (nothing prepared, no probe: a benchmark's "off") or
``detect_pooler=False`` (prepared, no probe: a test of the probe itself).
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import psycopg
from psycopg import errors, pq

from motir_celery.settings import Settings
from motir_celery.store.pg import Pool, PooledConnection, conninfo

if TYPE_CHECKING:  # a worker's connections are Pool's: it never imports SQLAlchemy (store/pg.py)
    from sqlalchemy import Connection, Engine

#: What a statement's connection came from: the engine's ``Pool``, or a SQLAlchemy ``Engine``.
Source = Union[Pool, "Engine"]

__all__ = ["install", "decided", "probe", "probe_url", "describe", "found", "refused", "unprepared", "mode", "PROBE_SECONDS"]

log = logging.getLogger("motir_celery.pooler")

#: How long the probe waits for its answers (a pooler whose every server session is busy queues it).
PROBE_SECONDS = 5.0
#: Refusals of a prepared name: its Parse (42P05), its Bind (26000), or a Bind whose
#: parameters fit another client's statement of that name (08P01).
_REFUSALS = (errors.DuplicatePreparedStatement, errors.InvalidSqlStatementName, errors.ProtocolViolation)
#: The names statements are prepared under: psycopg's own, and driver.py's for the per-step ones.
PREPARED_NAMES = ('"_pg3_', '"motir_')


@dataclass
class _State:
    """What an engine knows of its URL: ``pooled`` None until a probe decided."""

    detect: bool
    pooled: bool | None = None
    warned: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


_states: "weakref.WeakKeyDictionary[Source, _State]" = weakref.WeakKeyDictionary()


def install(engine: Source, settings: Settings) -> None:
    """Decide, at ``engine``'s first connection, whether its connections prepare statements."""
    if not settings.prepared_statements:
        return  # db.py's connect_args: prepare_threshold=None on every connection already
    state = _states[engine] = _State(detect=settings.detect_pooler)
    if not state.detect:
        return  # detect_pooler=False: prepared, whatever sits in between
    args, kwargs = _connect_args(engine)
    where = _where(engine)

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        if state.pooled is None:
            with state.lock:
                if state.pooled is None:
                    state.pooled = probe(*args, **kwargs)
                    if state.pooled:
                        _warn(state, where, "two of its connections shared one server session, or "
                                            f"waited over {PROBE_SECONDS:g} s for one")
        if state.pooled:
            unprepared(dbapi_connection)

    def on_checkout(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        if state.pooled:  # found after this connection was made (the backstop)
            unprepared(dbapi_connection)

    if isinstance(engine, Pool):
        engine.listen("connect", on_connect)
        engine.listen("checkout", on_checkout)
        return
    from sqlalchemy import event  # a SQLAlchemy engine: SQLAlchemy is imported already

    event.listen(engine, "connect", on_connect)
    event.listen(engine, "checkout", on_checkout)


def _connect_args(engine: Source) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """psycopg.connect's arguments for ``engine``'s URL."""
    if isinstance(engine, Pool):
        return (engine.conninfo,), dict(engine.connect_args)
    args, kwargs = engine.dialect.create_connect_args(engine.url)
    kwargs.pop("context", None)
    return tuple(args), dict(kwargs)


def _where(engine: Source) -> str:
    """``engine``'s URL with its password hidden, for the WARNING."""
    return engine.where if isinstance(engine, Pool) else engine.url.render_as_string(hide_password=True)


def found(engine: Source | None) -> bool:
    """A transaction pooler was found in front of ``engine``'s URL (probe or backstop); None: a
    connection someone else owns (Django's), whose preparing is theirs."""
    state = None if engine is None else _states.get(engine)
    return state is not None and state.pooled is True


def decided(engine: Source) -> bool:
    """Whether ``found(engine)`` is final: the probe ran (or nothing is probed for this engine)."""
    state = _states.get(engine)
    return state is None or not state.detect or state.pooled is not None


def probe(*args: Any, timeout: float = PROBE_SECONDS, **kwargs: Any) -> bool | None:
    """Whether the server at these psycopg connect arguments is reached through a pooler that
    hands one server session to several clients; None when the probe could not connect."""
    found: list[bool] = []

    def ask() -> None:
        options = {**kwargs, "autocommit": True, "prepare_threshold": None,
                   "connect_timeout": kwargs.get("connect_timeout") or max(1, int(timeout))}
        with psycopg.connect(*args, **options) as one, psycopg.connect(*args, **options) as two:
            seen: tuple[set[int], set[int]] = (set(), set())
            for _ in range(3):
                for conn, pids in zip((one, two), seen):
                    row = conn.execute("SELECT pg_backend_pid()").fetchone()
                    pids.add(int(row[0]) if row else 0)
        # Directly or in session pooling, a connection has one server process of its own.
        found.append(len(seen[0]) > 1 or len(seen[1]) > 1 or bool(seen[0] & seen[1]))

    def guarded() -> None:
        try:
            ask()
        except Exception as exc:  # noqa: BLE001 — undecided: prepared as before, probed again later
            log.debug("pooler probe failed: %s", exc)

    thread = threading.Thread(target=guarded, name="motir-pooler-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        # Still waiting for a server session: a transaction pooler whose sessions a busy fleet keeps
        # in use (each is freed at a commit), or a session pooler whose clients hold them all. Taken
        # for the first: nothing prepared is correct behind either (a little slower behind the
        # second); prepared behind the first is not (a statement could run another client's).
        log.debug("pooler probe: no answer within %.0fs; taken for a transaction pooler", timeout)
        return True
    return found[0] if found else None


def probe_url(url: str, *, timeout: float = PROBE_SECONDS) -> bool | None:
    """``probe`` for a SQLAlchemy-style URL (``motir doctor``)."""
    return probe(conninfo(url), timeout=timeout)


def describe(settings: Settings, pooled: bool | None) -> str:
    """The statement mode ``settings`` give a URL that ``probe`` found ``pooled``, in words."""
    if not settings.prepared_statements:
        return "statements sent unprepared (prepared_statements=False)"
    if not settings.detect_pooler:
        return "statements prepared (detect_pooler=False)"
    if pooled:
        return "statements sent unprepared: a transaction pooler was found (no setting needed)"
    if pooled is False:
        return "statements prepared: no transaction pooler found"
    return "statements prepared unless a transaction pooler is found (the probe could not connect)"


def refused(conn: PooledConnection | Connection, raw: psycopg.Connection[Any], exc: psycopg.Error) -> bool:
    """After ``exc`` refused a prepared statement on ``raw``: if it is a pooler's doing (one of
    our names: psycopg's or driver.py's), prepare nothing more on this engine; True when the statement may be
    sent again unprepared (it was a transaction of its own: nothing of it ran)."""
    if not isinstance(exc, _REFUSALS) or not any(name in str(exc) for name in PREPARED_NAMES):
        return False
    state = None if conn.engine is None else _states.get(conn.engine)
    if conn.engine is None or state is None or not state.detect:
        return False  # not ours to decide: detect_pooler=False said prepare, or someone else's connection
    with state.lock:
        state.pooled = True
        _warn(state, _where(conn.engine),
              f"a statement was refused for a name the pooler gave another client ({type(exc).__name__})")
    unprepared(raw)
    return raw.info.transaction_status == pq.TransactionStatus.IDLE


def mode(engine: Source) -> str:
    """What ``engine``'s connections do now, for ``motir doctor`` and logs."""
    state = _states.get(engine)
    if state is None:
        return "unprepared (prepared_statements=False)"
    if not state.detect:
        return "prepared (detect_pooler=False)"
    if state.pooled:
        return "unprepared (a transaction pooler was found)"
    return "prepared (no transaction pooler found)" if state.pooled is False else "prepared (not probed yet)"


def _warn(state: _State, where: str, why: str) -> None:
    if state.warned:
        return
    state.warned = True
    log.warning("%s reaches Postgres through a transaction pooler (%s): this process's connections to it "
                "send every statement unprepared from now on, as a transaction pooler needs (no setting "
                "is needed: docs/operations.md, Behind PgBouncer)", where, why)


def unprepared(dbapi_connection: Any) -> None:
    """Nothing prepared on this connection from now on (psycopg's own preparing too)."""
    raw = getattr(dbapi_connection, "driver_connection", None) or dbapi_connection
    if isinstance(raw, (psycopg.Connection, psycopg.AsyncConnection)):
        raw.prepare_threshold = None
