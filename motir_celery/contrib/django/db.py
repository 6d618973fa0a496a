"""motir's writes on Django's own connection, in Django's transaction.

The choice: **the psycopg connection Django holds, lent to the store as it is**
(``store/pg.py``'s ``BorrowedConnection``): ``core/events.write_event``, the store's
statements and ``store/driver`` take it like the engine's own connections, and it stays
Django's — ``connection_for`` hands out this thread's ``connections[alias].connection``
whatever Django did to it (pool, reconnect, ``CONN_MAX_AGE``); nothing of motir begins,
commits, rolls back or closes it; no SQLAlchemy is imported (a Django-hosted worker's
memory).

On Django's connection, Django's cursor class (client-side binding by default) is used:
nothing is prepared server-side there, whatever the engine does on its own connections (safe
behind PgBouncer, as Django's own default is), and ``jsonb`` comes back as text
(Django's loader). The write path reads neither.

``join`` is what the engine is given to join Django's transactions (``Engine.join_transactions``,
in apps.py):

* inside ``transaction.atomic()`` (on ``MOTIR_DATABASE_ALIAS``): the rows go on
  Django's connection, in an ``atomic(savepoint=False)`` block (no extra round
  trips; a failed statement marks the whole transaction for rollback, as Postgres
  has aborted it anyway), and the messages are published on
  ``transaction.on_commit`` — after the commit, never after a rollback;
* outside one (autocommit): None — motir's own engine, autocommit, as usual; so is code inside
  nothing but a ``TestCase``'s own transaction, which the engine then writes in (testdb.py);
* under Django's manual transaction management (``set_autocommit(False)``): refused
  (``on_commit`` cannot work there, and a write on another connection would commit
  without the user's data).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, ContextManager, Iterator

from motir_celery.contrib.django import conf, testdb
from motir_celery.contrib.django.middleware import request_workspace
from motir_celery.core.engine import Joined
from motir_celery.errors import ConfigurationError
from motir_celery.store.db import set_workspace_context
from motir_celery.store.pg import BorrowedConnection

__all__ = ["join", "connection_for", "scope_transaction"]


def connection_for(db_alias: str | None = None) -> BorrowedConnection:
    """Django's connection ``db_alias`` (this thread's), lent to the store in whatever transaction it is in."""
    from django.db import connections

    wrapper = connections[db_alias or conf.alias()]
    wrapper.ensure_connection()
    return BorrowedConnection(wrapper.connection)


def join(workspace_id: str | None) -> ContextManager[Joined] | None:
    """The transaction a motir write joins: Django's when one is open, else None (see the module doc)."""
    from django.db import connections

    db_alias = conf.alias()
    wrapper = connections[db_alias]
    if wrapper.in_atomic_block and not testdb.only_test_case_atomics(wrapper):
        return _joined(db_alias, workspace_id)
    if wrapper.in_atomic_block:
        return None  # a TestCase's own transaction: the code under test is in autocommit (testdb.py)
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
