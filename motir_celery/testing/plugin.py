"""The pytest plugin (entry point ``pytest11: motir``): a migrated database per test session, the ``motir`` fixture.

* ``motir_database_url`` (session): a database of its own on the server
  ``MOTIR_DATABASE_URL`` names — or, with none configured, on the embedded Postgres
  ``make test`` uses (the ``embedded`` extra; started if it is not running) — migrated
  from empty and dropped at the end. Each pytest-xdist worker is a session of its own,
  so it gets a database of its own. The variable then names that database for the
  session, so the code under test (and any engine built from the environment) uses it.
* ``motir`` (function): a ``Motir`` kit over it, from empty tables, crash injection
  installed (``kit.py``).

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
        return embedded.env_exports({**os.environ})["MOTIR_DATABASE_URL"]
    except embedded.EmbeddedServiceError as exc:
        pytest.exit(f"motir_celery.testing: no MOTIR_DATABASE_URL, and the embedded Postgres: {exc}", returncode=3)


@pytest.fixture(scope="session")
def motir_database_url() -> Iterator[str]:
    """A migrated database of this session's own (see the module docstring); its URL."""
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
def motir(motir_database_url: str) -> Iterator[Motir]:
    """Jobs run in this process against the session's database: run, send_event, drain,
    crash_after / crash_before, advance, steps, attempts, dlq (docs/testing.md)."""
    kit = Motir(settings=motir_settings.Settings.from_env())
    kit.reset()
    kit.install()
    try:
        yield kit
    finally:
        kit.uninstall()
