"""The pytest plugin (entry point ``pytest11: motir``): a migrated database per test session, the ``motir`` fixture.

* ``motir_database_url`` (session): a database of its own on the server
  ``MOTIR_DATABASE_URL`` names — or, with none configured, on the embedded Postgres
  ``make test`` uses (the ``embedded`` extra; started if it is not running) — migrated
  from empty and dropped at the end. Each pytest-xdist worker is a session of its own,
  so it gets a database of its own. The variable then names that database for the
  session, so the code under test (and any engine built from the environment) uses it.
* ``motir`` (function): a ``Motir`` kit over it, from empty tables, crash injection
  installed (``kit.py``).

**With pytest-django**, in a project whose ``INSTALLED_APPS`` has ``motir_celery.contrib.django``,
the database is Django's test database (``django_db_setup``: created, migrated — motir's tables
too — and dropped by Django; the engine follows it, contrib/django/testdb.py), and a test that
asks for ``motir`` is marked ``django_db(transaction=True)`` when it is collected: pytest-django
then sets up the test database even when no other test asks for it, and the kit's runs commit, as
a worker's would. No conftest is needed. The kit never runs on the database Django started on:
when Django is not on a test database by the time ``motir`` is asked for (a ``django_db_setup`` of
the project's own that keeps it there), the session stops with that reason.

**Embedded Postgres.** When this run started the embedded Postgres (no ``MOTIR_DATABASE_URL``, none
running under ``MOTIR_DATA_DIR`` before), the run stops it at its end; one that was running
already is left running.

Loaded by every pytest run once the package is installed; it does nothing until a test
asks for one of its fixtures.
"""

from __future__ import annotations

import os
import uuid
from typing import Iterator

import pytest
from sqlalchemy import create_engine, make_url
from sqlalchemy.pool import NullPool

from motir_celery import settings as motir_settings
from motir_celery.store.db import dispose_engines
from motir_celery.store.migrate import upgrade
from motir_celery.store.sql import setup as setup_sql
from motir_celery.testing.kit import Motir

__all__ = ["motir_database_url", "motir"]


def _server_url() -> str:
    configured = motir_settings.Settings.from_env().database_url
    if configured:
        return configured
    from motir_celery.dev import embedded

    try:
        # The database only: the kit needs no broker.
        return embedded.env_exports({**os.environ, "CELERY_BROKER_URL": "unused"})["MOTIR_DATABASE_URL"]
    except embedded.EmbeddedServiceError as exc:
        pytest.exit(f"motir_celery.testing: no MOTIR_DATABASE_URL, and the embedded Postgres: {exc}", returncode=3)


_EMBEDDED_BEFORE = pytest.StashKey[bool]()


def _embedded_running() -> bool | None:
    """Whether the embedded Postgres of ``MOTIR_DATA_DIR`` runs (None: a database is configured,
    the embedded one is none of this run's business)."""
    if motir_settings.Settings.from_env().database_url:
        return None
    from motir_celery.dev import embedded

    return (embedded.data_dir() / "pg" / "postmaster.pid").exists()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the run's own process (pytest-xdist's controller)
        running = _embedded_running()
        if running is not None:
            config.stash[_EMBEDDED_BEFORE] = running


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop the embedded Postgres this run started (the module docstring)."""
    if config.stash.get(_EMBEDDED_BEFORE, True) is False and _embedded_running():
        from motir_celery.dev import embedded

        embedded.stop_postgres(embedded.data_dir())


def _django_project(config: pytest.Config) -> bool:
    """Whether pytest-django runs a Django project that installs motir's Django app."""
    if not config.pluginmanager.hasplugin("django"):
        return False
    from django.conf import settings

    if not settings.configured:
        return False
    from django.apps import apps

    return bool(apps.ready and apps.is_installed("motir_celery.contrib.django"))


#: What a test that asks for ``motir`` is, in a Django project (the module docstring).
_KIT_IN_DJANGO = pytest.mark.django_db(transaction=True)


def pytest_itemcollected(item: pytest.Item) -> None:
    """A test that asks for ``motir`` in a Django project needs Django's test database: said by
    its marker, which pytest-django reads to choose the databases it sets up and the order of the tests."""
    if "motir" in getattr(item, "fixturenames", ()) and _django_project(item.config):
        item.add_marker(_KIT_IN_DJANGO)


@pytest.fixture(scope="session")
def motir_database_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A migrated database of this session's own (see the module docstring); its URL."""
    if _django_project(request.config):
        from motir_celery.contrib.django import testdb

        request.getfixturevalue("django_db_setup")  # Django's test database, which the engine follows
        if testdb.test_database() is None:
            pytest.exit("motir_celery.testing: Django is still on the database it started on after django_db_setup; "
                        "the kit empties its tables, so it runs on a test database only", returncode=3)
        yield motir_settings.Settings.from_env().require_database_url()
        return
    server = make_url(_server_url())
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    name = f"motir_kit_{worker}_{uuid.uuid4().hex[:8]}"
    owner = create_engine(server, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with owner.connect() as conn:
            setup_sql.create_database(conn, name)
    except Exception as exc:  # noqa: BLE001 — say which server refused, then stop the session
        pytest.exit(f"motir_celery.testing: cannot create a test database on "
                    f"{server.render_as_string()}: {exc}", returncode=3)
    url = server.set(database=name).render_as_string(hide_password=False)
    before = os.environ.get("MOTIR_DATABASE_URL")
    os.environ["MOTIR_DATABASE_URL"] = url
    motir_settings.reset_settings()
    upgrade(url)
    try:
        yield url
    finally:
        dispose_engines()
        if before is None:
            os.environ.pop("MOTIR_DATABASE_URL", None)
        else:
            os.environ["MOTIR_DATABASE_URL"] = before
        motir_settings.reset_settings()
        with owner.connect() as conn:
            setup_sql.drop_database(conn, name)
        owner.dispose()


@pytest.fixture
def motir(request: pytest.FixtureRequest, motir_database_url: str) -> Iterator[Motir]:
    """Jobs run in this process against the session's database: run, send_event, drain,
    crash_after / crash_before, advance, steps, attempts, dlq (docs/testing.md)."""
    if _django_project(request.config):
        # The kit's runs commit, as a worker's would: pytest-django's transactional database (the
        # test carries the marker since its collection: pytest_itemcollected).
        request.getfixturevalue("transactional_db")
    kit = Motir(settings=motir_settings.Settings.from_env())
    kit.reset()
    kit.install()
    try:
        yield kit
    finally:
        kit.uninstall()
