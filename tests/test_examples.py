"""The examples' own test suites pass in a plain pytest run with no worker and no broker (issue 29).

Each runs in a pytest process of its own, as a user runs it from the repository root,
with the broker URL pointing at a port nobody listens on: the test kit
(motir_celery.testing) must need nothing but the database.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("suite, count", [("examples/plain_celery/tests", 3), ("examples/django_project/tests", 4)])
def test_an_examples_suite_passes_with_the_kit_alone(suite: str, count: int, database_url: str) -> None:
    server = database_url.rsplit("/", 1)[0] + "/postgres"  # the kit makes a database of its own there
    if "?" in database_url:  # the embedded Postgres: its socket folder rides in the query
        path, query = database_url.split("?", 1)
        server = path.rsplit("/", 1)[0] + "/postgres?" + query
    env = {**os.environ, "MOTIR_DATABASE_URL": server, "CELERY_BROKER_URL": "redis://127.0.0.1:1/0",
           "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run([sys.executable, "-m", "pytest", suite, "-q", "-p", "no:cacheprovider"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"{count} passed" in done.stdout, done.stdout[-2000:]
