"""The examples' own test suites pass in a plain pytest run with no worker and no broker (issue 29).

Each runs in a pytest process of its own, as a user runs it from the repository root,
with the broker URL pointing at a port nobody listens on: the test kit
(motir_celery.testing) must need nothing but the database. The plain Celery shop's kit
makes a database of its own on ``MOTIR_DATABASE_URL``'s server; the Django shop is a
project as its team has it — ``DATABASE_URL`` names its development database (here the
session's) and nothing of motir's is set — under pytest-django with no conftest: its tests
run on Django's test database, which the engine follows.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from sqlalchemy import make_url

from tests.conftest import ROOT


def _server(database_url: str) -> str:
    """The ``postgres`` database of the session's server (the kit makes a database of its own there)."""
    server = database_url.rsplit("/", 1)[0] + "/postgres"
    if "?" in database_url:  # the embedded Postgres: its socket folder rides in the query
        path, query = database_url.split("?", 1)
        server = path.rsplit("/", 1)[0] + "/postgres?" + query
    return server


def _env(suite: str, database_url: str) -> dict[str, str]:
    env = {**os.environ, "CELERY_BROKER_URL": "redis://127.0.0.1:1/0", "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)
    if "django" not in suite:
        return {**env, "MOTIR_DATABASE_URL": _server(database_url)}
    env = {k: v for k, v in env.items() if not k.startswith(("MOTIR_", "DJANGO_"))}
    env["DATABASE_URL"] = make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)
    return env


@pytest.mark.parametrize("suite, count", [("examples/plain_celery/tests", 3), ("examples/django_project/tests", 4)])
def test_an_examples_suite_passes_with_the_kit_alone(suite: str, count: int, database_url: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", suite, "-q", "-p", "no:cacheprovider"], cwd=ROOT,
                          env=_env(suite, database_url), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"{count} passed" in done.stdout, done.stdout[-2000:]
