"""Django's own test runner and pytest-django on a project written for it (examples/django_testing).

The project is shaped like a real one: models, a view that calls ``delay_on_commit`` inside
``atomic()``, a Celery ``beat_schedule``, jobs in ``loans/tasks.py`` (found by Celery's
autodiscovery: no ``MOTIR_IMPORTS``), ``TestCase`` and ``TransactionTestCase`` tests that run jobs
eagerly and through the kit. Its development database is this session's (Django's and motir's
tables, some rows in both); ``python manage.py test`` and ``python -m pytest`` (pytest-django, no
conftest) run in processes of their own against it, and must leave every table of it as it was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from sqlalchemy import make_url, text
from sqlalchemy.engine import Engine

from tests.conftest import ROOT

PROJECT = ROOT / "examples" / "django_testing"


@pytest.fixture(scope="module")
def project_env(database_url: str, broker_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOTIR_", "DJANGO_", "CELERY_"))}
    env.update({
        "DATABASE_URL": make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False),
        "CELERY_BROKER_URL": broker_url,
        "LIBRARY_QUEUE": f"{os.environ['MOTIR_QUEUE']}-library",
        "PYTHONPATH": f"{PROJECT}{os.pathsep}{ROOT}",
    })
    manage(env, "migrate", "--noinput")
    return env


def development_rows(env: dict[str, str]) -> None:
    """The development database has rows of its own: a book, a loan, a run of the receipt job."""
    script(env, "from loans.models import Book, Loan\nfrom loans.tasks import send_receipt\n"
                "loan = Loan.objects.create(book=Book.objects.create(title='Dev'), reader='dev')\n"
                "print(json.dumps(str(send_receipt.delay(loan.pk).id)))")


def manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "manage.py", *args], cwd=PROJECT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"manage.py {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def script(env: dict[str, str], code: str) -> Any:
    proc = subprocess.run([sys.executable, "-c", "import django, json\ndjango.setup()\n" + code], cwd=PROJECT,
                          env={**env, "DJANGO_SETTINGS_MODULE": "library.settings"}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def row_counts(engine: Engine) -> dict[str, int]:
    """Every table of the development database (public schema) and its row count."""
    with engine.connect() as conn:
        tables = conn.execute(text("SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1")).scalars()
        return {t: conn.execute(text(f'SELECT count(*) FROM "{t}"')).scalar_one() for t in list(tables)}


def databases(engine: Engine) -> set[str]:
    """Django's test databases on the server (``test_<NAME>``): the other pytest sessions' own come
    and go meanwhile."""
    with engine.connect() as conn:
        return set(conn.execute(text("SELECT datname FROM pg_database WHERE datname LIKE 'test\\_%'")).scalars())


def test_manage_py_test_is_green_and_leaves_the_development_database_untouched(
        project_env: dict[str, str], engine: Engine) -> None:
    development_rows(project_env)
    before, dbs = row_counts(engine), databases(engine)
    assert before["job_queue"] == 1 and before["loans_loan"] >= 1   # the development rows are there to be seen
    proc = manage(project_env, "test", "-v", "2")
    output = proc.stdout + proc.stderr
    assert "Ran 9 tests" in output and "\nOK\n" in output, output
    assert "Creating test database for alias 'default'" in output
    assert row_counts(engine) == before
    assert databases(engine) == dbs   # the test database (and motir's tables in it) dropped with it


def test_pytest_django_with_no_conftest_is_green_and_leaves_the_development_database_untouched(
        project_env: dict[str, str], engine: Engine) -> None:
    assert not list(PROJECT.rglob("conftest.py"))
    development_rows(project_env)
    before, dbs = row_counts(engine), databases(engine)
    assert before["job_queue"] == 1
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q"], cwd=PROJECT, env=project_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 passed" in proc.stdout
    assert row_counts(engine) == before
    assert databases(engine) == dbs


def test_manage_py_motir_jobs_lists_every_job_without_motir_imports(project_env: dict[str, str]) -> None:
    assert "\nMOTIR_IMPORTS" not in (PROJECT / "library" / "settings.py").read_text()
    proc = manage(project_env, "motir", "jobs", "--json")
    jobs = {j["id"]: j["task"] for j in json.loads(proc.stdout) if not j["id"].startswith("system.")}
    assert jobs == {"loans.send-receipt": "loans.tasks.send_receipt", "loans.flag-overdue": "loans.tasks.flag_overdue",
                    "loans.count": "loans.tasks.count_loans"}


def test_a_web_process_knows_every_job_without_motir_imports(project_env: dict[str, str]) -> None:
    """``django.setup()`` alone, as a web process (runserver, gunicorn) has it: no worker started, so
    nobody ran Celery's autodiscovery; the Django app's ready() imported each app's tasks module."""
    jobs = script(project_env, "from motir_celery.core.jobs import all_jobs\n"
                               "print(json.dumps(sorted(j.id for j in all_jobs() if not j.id.startswith('system.'))))")
    assert jobs == ["loans.count", "loans.flag-overdue", "loans.send-receipt"]
