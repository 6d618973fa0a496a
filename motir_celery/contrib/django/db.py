"""motir's writes on Django's own connection, in Django's transaction.

The choice: **a SQLAlchemy Connection over Django's DBAPI connection**, so the core
(``core/events.write_event``, ``store/statements``, ``store/driver``: all of which
take a SQLAlchemy ``Connection`` and reach the psycopg connection under it) runs
unchanged on it. The engine behind it (one per Django alias and process) has

* a ``creator`` that hands out this thread's ``connections[alias].connection`` —
  the psycopg 3 connection Django holds, whatever Django did to it (pool,
  reconnect, ``CONN_MAX_AGE``);
* a dialect, psycopg's, whose begin/commit/rollback/close do nothing
  (``DjangoOwnedDialect``): the transaction and the connection's life are Django's.
  SQLAlchemy rolls back whatever it believes it began when a Connection closes,
  and after reading the server version on its first connect: on Django's
  connection that would be the user's transaction. No ``on_connect`` either
  (Django configured the connection; a notice handler per checkout would pile up);
* ``NullPool`` with ``pool_reset_on_return=None``: nothing is kept, nothing reset.

REJECTED: teaching ``store/driver`` to take a raw psycopg connection — every
statement function, ``write_event``'s own query and the other writers would change
type, for one caller. REJECTED: ``StaticPool`` — it keeps the first connection it
saw, and Django replaces its connection (per thread, per request by default).

On Django's connection, Django's cursor (client-side binding by default) is used:
nothing is prepared server-side there whatever ``MOTIR_PREPARED_STATEMENTS`` says
(safe behind PgBouncer, as Django's own default is), and ``jsonb`` comes back as
text (Django's loader). The write path reads neither.

``join`` is the hook ``core/events.join_transactions`` is given (apps.py):

* inside ``transaction.atomic()`` (on ``MOTIR_DATABASE_ALIAS``): the rows go on
  Django's connection, in an ``atomic(savepoint=False)`` block (no extra round
  trips; a failed statement marks the whole transaction for rollback, as Postgres
  has aborted it anyway), and the messages are published on
  ``transaction.on_commit`` — after the commit, never after a rollback;
* outside one (autocommit): None — motir's own engine, autocommit, as usual;
* under Django's manual transaction management (``set_autocommit(False)``): refused
  (``on_commit`` cannot work there, and a write on another connection would commit
  without the user's data).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, ContextManager, Iterator

from sqlalchemy import Engine, create_engine
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.pool import NullPool

from motir_celery.contrib.django import conf
from motir_celery.contrib.django.middleware import request_workspace
from motir_celery.core.producer.events import Joined
from motir_celery.errors import ConfigurationError
from motir_celery.store.db import set_workspace_context

__all__ = ["DjangoOwnedDialect", "join", "connection_for", "engine_for"]


class DjangoOwnedDialect(PGDialect_psycopg):
    """psycopg on a connection Django owns: SQLAlchemy never ends its transaction or closes it."""

    supports_statement_cache = True

    def on_connect(self) -> None:
        return None

    def do_begin(self, dbapi_connection: Any) -> None:
        pass  # psycopg begins implicitly; Django's atomic() decides when the transaction ends

    def do_commit(self, dbapi_connection: Any) -> None:
        pass

    def do_rollback(self, dbapi_connection: Any) -> None:
        pass

    def do_close(self, dbapi_connection: Any) -> None:
        pass

    def do_terminate(self, dbapi_connection: Any) -> None:
        pass


registry.register("postgresql.motir_django", __name__, "DjangoOwnedDialect")

_engines: dict[str, Engine] = {}
_lock = threading.Lock()


def engine_for(db_alias: str) -> Engine:
    """The engine whose connections are this thread's Django connection ``db_alias``."""
    engine = _engines.get(db_alias)
    if engine is None:
        with _lock:
            engine = _engines.get(db_alias)
            if engine is None:
                def creator() -> Any:
                    from django.db import connections

                    wrapper = connections[db_alias]
                    wrapper.ensure_connection()
                    return wrapper.connection

                engine = create_engine("postgresql+motir_django://", creator=creator, poolclass=NullPool,
                                       pool_reset_on_return=None, use_native_hstore=False)
                _engines[db_alias] = engine
    return engine


def connection_for(db_alias: str | None = None) -> ContextManager[Any]:
    """A SQLAlchemy Connection on Django's connection ``db_alias``, in whatever transaction it is in."""
    return engine_for(db_alias or conf.alias()).connect()


def join(workspace_id: str | None) -> ContextManager[Joined] | None:
    """``core/events``' hook: Django's transaction when one is open, else None (see the module doc)."""
    from django.db import connections

    db_alias = conf.alias()
    wrapper = connections[db_alias]
    if wrapper.in_atomic_block:
        return _joined(db_alias, workspace_id)
    if wrapper.connection is not None and not wrapper.get_autocommit():
        raise ConfigurationError(
            "a motir write (job.delay(), .apply_async(), .delay_on_commit(), send_event(), ...) under Django's "
            "manual transaction management (set_autocommit(False)): motir cannot publish after a commit it "
            "is not told of; use transaction.atomic(), whose on_commit publishes the runs after the commit")
    return None


@contextmanager
def _joined(db_alias: str, workspace_id: str | None) -> Iterator[Joined]:
    from django.db import transaction

    def on_commit(fn: Callable[[], None]) -> None:
        transaction.on_commit(fn, using=db_alias)

    with transaction.atomic(using=db_alias, savepoint=False), connection_for(db_alias) as conn:
        # The request's workspace (WorkspaceMiddleware), else the event's: row-level
        # security checks the rows against it when Django logs in as the app role.
        scope = request_workspace()
        if scope is not None or workspace_id is not None:
            set_workspace_context(conn, scope if scope is not None else workspace_id)
        yield conn, on_commit


def scope_transaction(workspace_id: str | None = None, *, using: str | None = None) -> None:
    """Set ``motir.workspace_id`` for the rest of the current Django transaction (for your own
    reads of motir's tables under the app role): ``workspace_id``, else the request's."""
    with connection_for(using) as conn:
        set_workspace_context(conn, workspace_id if workspace_id is not None else request_workspace())
