"""The engine follows Django's test database: created, migrated, flushed and dropped with it.

Django's test runner (``manage.py test``, and pytest-django, which calls the same
``setup_databases``) creates ``test_<NAME>``, points ``DATABASES[alias]["NAME"]`` and the open
connection at it, migrates it, runs the tests and drops it. motir's URLs were derived from (or
checked against, ``motir.W001``) the development database at start-up; from the moment Django's
connection reaches another database, they name that one instead:

* **followed** (``connection_created``): every ``MOTIR_*_DATABASE_URL`` that named the database
  Django was on now names the one it is on (same login, host and options), motir's settings are
  read again and the pools of the old database closed. Parallel test processes (``--parallel``)
  follow their own clone the same way. Nothing reaches the development database.
* **migrated** (``post_migrate`` of this app, right after Django's own migrations there):
  ``alembic upgrade head`` on the test database, once per process; a clone copies the tables.
  Each later ``post_migrate`` there — Django's flush after a ``TransactionTestCase`` sends one —
  empties motir's tables, as Django's own were emptied.
* **dropped**: before Django opens its maintenance connection to create or drop a database, the
  engine's pooled connections are closed, so ``DROP DATABASE`` finds no session of ours.

**Inside a ``TestCase``.** Django holds each ``TestCase`` test in a transaction it rolls back. Code
under test that is not inside an ``atomic()`` of its own runs in production in autocommit; here it
is treated the same way (as Django's ``durable=True`` check does): the engine's writes, and the
eager execution of what they publish, go on the test's own connection (``store/lent.py``: each
of the engine's transactions a savepoint), so a run written there can run there at once
(``task_always_eager``), its result is read there, and the test's rollback takes every row.
Code inside an ``atomic()`` of its own keeps production's behaviour: its runs are published on
commit — in a ``TestCase``, when ``captureOnCommitCallbacks(execute=True)`` runs them.
"""

from __future__ import annotations

import os
import threading
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from motir_celery.contrib.django import conf
from motir_celery.settings import reset_settings
from motir_celery.store.db import dispose_engines
from motir_celery.store.lent import LentPool, in_open_transaction

__all__ = ["start", "follow", "migrate_or_flush", "lend", "only_test_case_atomics", "database_of", "test_database"]

#: The URLs that follow Django's database (when they named the one Django was on).
URL_NAMES = ("MOTIR_DATABASE_URL", "MOTIR_APP_DATABASE_URL", "MOTIR_ADMIN_DATABASE_URL", "MOTIR_MIGRATE_DATABASE_URL")


class Following:
    """The database Django was on at start-up, the one motir follows now, those migrated here."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started: str | None = None
        self.current: str | None = None
        self.migrated: set[str] = set()

    @property
    def testing(self) -> bool:
        """Whether Django has moved to another database than its own (a test database)."""
        return self.started is not None and self.current != self.started


_following = Following()


def database_of(url: str) -> str:
    """The database name a ``postgresql://`` URL names."""
    return unquote(urlsplit(url).path.lstrip("/"))


def _renamed(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + quote(name, safe="")))


def test_database() -> str | None:
    """The test database the engine follows now, or None while it is on the one Django started on."""
    return _following.current if _following.testing else None


def start() -> None:
    """At ``ready()``: the database Django's connection names now is the one motir's URLs reach."""
    from django.db import connections

    name = str(connections[conf.alias()].settings_dict.get("NAME") or "")
    with _following.lock:
        _following.started = _following.current = name


def follow(sender: Any = None, connection: Any = None, **_: Any) -> None:
    """``connection_created``: Django's connection reaches another database — motir follows it."""
    from django.db.backends.base.base import NO_DB_ALIAS

    if connection is None:
        return
    if connection.alias == NO_DB_ALIAS:
        # Django's maintenance connection: it is about to create or drop a database (the test
        # database at the end of the run): none of our sessions may be on it then.
        if _following.testing:
            dispose_engines()
        return
    if connection.alias != conf.alias():
        return
    name = str(connection.settings_dict.get("NAME") or "")
    with _following.lock:
        before = _following.current
        if before is None or name == before or not name:
            return
        for var in URL_NAMES:
            url = os.environ.get(var, "").strip()
            if url and database_of(url) == before:
                os.environ[var] = _renamed(url, name)
        _following.current = name
    reset_settings()
    dispose_engines()


def migrate_or_flush(sender: Any = None, using: str | None = None, **_: Any) -> None:
    """``post_migrate`` of this app: motir's tables on a test database (first), emptied (after)."""
    from motir_celery.core.current import current
    from motir_celery.store.migrate import upgrade
    from motir_celery.store.sql import testing as testing_sql

    if not _following.testing or (using or "default") != conf.alias():
        return
    name = _following.current or ""
    settings = current().settings
    if name not in _following.migrated:
        upgrade(settings.migrate_database_url or settings.require_database_url())
        _following.migrated.add(name)
        return
    with current().sql_engine().begin() as conn:
        testing_sql.empty_tables(conn)


def only_test_case_atomics(wrapper: Any) -> bool:
    """Whether every atomic block open on ``wrapper`` is one a ``TestCase`` opened around the test.
    (``_from_testcase`` is Django's own mark on them, the one ``atomic(durable=True)`` reads.)"""
    blocks = list(getattr(wrapper, "atomic_blocks", []) or [])
    return bool(blocks) and all(getattr(block, "_from_testcase", False) for block in blocks)


def lend() -> LentPool | None:
    """The engine's connection while a ``TestCase`` test runs code outside an ``atomic()`` of its own:
    the test's (the module docstring); else None (the engine's pools)."""
    if not _following.testing:
        return None
    from django.db import connections

    wrapper = connections[conf.alias()]
    if not wrapper.in_atomic_block or not only_test_case_atomics(wrapper):
        return None
    raw = wrapper.connection
    return LentPool(raw) if in_open_transaction(raw) else None
