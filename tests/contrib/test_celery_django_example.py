"""Celery's own Django example, cut over (examples/celery_django): real Postgres, broker and worker.

The project is Celery's ``examples/django`` after docs/tasks-to-jobs.md's "Cutting over": its
tasks module changed its decorators and imports only. Django runs in processes of its own
(``manage.py``, scripts that set Django up), the worker is a real ``celery -A proj worker``,
the database is this session's (``DATABASE_URL``; motir's URL derived from ``DATABASES``).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
from sqlalchemy import make_url, text
from sqlalchemy.engine import Engine

from tests.conftest import ROOT, celery_worker, wait_for

PROJECT = ROOT / "examples" / "celery_django"

#: Celery's demoapp/tasks.py as it was: each task's signature and body (what must not change).
CELERY_TASKS = {
    "add": ("x, y", "return x + y"),
    "mul": ("x, y", "return x * y"),
    "xsum": ("numbers", "return sum(numbers)"),
    "count_widgets": ("", "return Widget.objects.count()"),
    "rename_widget": ("widget_id, name", "w = Widget.objects.get(id=widget_id)\nw.name = name\nw.save()"),
    "error_task": ("self", "raise Exception('Test error')"),
    "error_backoff_test": ("self", "raise Exception('Test error')"),
}


@pytest.fixture(scope="module")
def django_env(database_url: str, broker_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOTIR_", "DJANGO_", "CELERY_"))}
    env.update({
        "DATABASE_URL": make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False),
        "CELERY_BROKER_URL": broker_url,
        "CELERY_TASK_DEFAULT_QUEUE": os.environ["MOTIR_QUEUE"],
        "DJANGO_SETTINGS_MODULE": "proj.settings",
        "PYTHONPATH": f"{PROJECT}{os.pathsep}{ROOT}",
    })
    proc = subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=PROJECT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return env


def script(env: dict[str, str], code: str) -> Any:
    """``code`` in a process that set Django up; its last stdout line, as JSON."""
    proc = subprocess.run([sys.executable, "-c", "import django, json\ndjango.setup()\n" + code], cwd=PROJECT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def worker(django_env: dict[str, str], broker_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    env = {k: django_env[k] for k in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE", "PYTHONPATH",
                                      "CELERY_TASK_DEFAULT_QUEUE")}
    env.update({"MOTIR_DATABASE_URL": "", "MOTIR_IMPORTS": ""})
    with celery_worker(tmp_path_factory.mktemp("celery-django"), broker=broker_url, app="proj", env=env,
                       name="demo") as w:
        yield w


@pytest.fixture(autouse=True)
def _empty_queue(broker_url: str) -> None:
    redis.Redis.from_url(broker_url).delete(os.environ["MOTIR_QUEUE"])


def test_the_tasks_module_changed_its_decorators_and_imports_only() -> None:
    tree = ast.parse((PROJECT / "demoapp" / "tasks.py").read_text())
    imports = [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert imports == ["from demoapp.models import Widget", "from motir_celery import RetryPolicy, define_job"]
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert {f.name: (ast.unparse(f.args), "\n".join(ast.unparse(s) for s in f.body)) for f in functions} == CELERY_TASKS
    for f in functions:
        (decorator,) = f.decorator_list
        assert isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "define_job"


def test_each_job_keeps_the_task_name_celery_gave_it(django_env: dict[str, str]) -> None:
    names = script(django_env, "from proj.celery import app\nimport demoapp.tasks as t\n"
                               "print(json.dumps(sorted(n for n in app.tasks if 'demoapp' in n)))")
    assert [n for n in names if not n.startswith("motir.")] == sorted(f"demoapp.tasks.{n}" for n in CELERY_TASKS)
    assert "motir.demoapp.add" in names   # the alias of earlier releases still lands


def test_delay_on_commit_inside_atomic_a_rollback_writes_nothing_and_a_commit_makes_one_run(
        django_env: dict[str, str], worker: Any, engine: Engine) -> None:
    out = script(django_env, """
from django.db import transaction
from demoapp.tasks import add
from motir_celery import RunNotCommitted
try:
    with transaction.atomic():
        rolled_back = str(add.delay_on_commit(1, 2).id)
        raise RuntimeError("the view failed")
except RuntimeError:
    pass
with transaction.atomic():
    handle = add.delay_on_commit(2, 3)
    try:
        handle.get(timeout=5)
        inside = "waited"
    except RunNotCommitted as exc:
        inside = str(exc)
print(json.dumps({"rolled_back": rolled_back, "committed": str(handle.id), "inside": inside,
                  "result": handle.get(timeout=30)}))
""")
    assert out["result"] == 5 and "has not committed" in out["inside"]   # refused at once, not waited out
    with engine.connect() as conn:
        runs = {str(r.id): r for r in conn.execute(text("SELECT id, state, result FROM job_queue")).all()}
    assert out["rolled_back"] not in runs and list(runs) == [out["committed"]]
    assert runs[out["committed"]].state == "succeeded"


def test_celerys_readme_the_orm_tasks_and_celery_call_on_the_cut_over_project(
        django_env: dict[str, str], worker: Any, engine: Engine, tmp_path: Path) -> None:
    out = script(django_env, """
from demoapp.models import Widget
from demoapp.tasks import add, count_widgets, error_task, mul, rename_widget
widget = Widget.objects.create(name="old")
result = {"readme": add.delay_on_commit(2, 3).get(timeout=30),           # Celery's README, as it is
          "mul": mul.apply_async((3, 4), countdown=1).get(timeout=30),
          "count": count_widgets.delay().get(timeout=30)}
rename_widget.delay(widget.id, "new").get(timeout=30)
widget.refresh_from_db()
result["renamed"] = widget.name
failing = error_task.delay()
import time
deadline = time.monotonic() + 30
while failing.state != "RETRY" and time.monotonic() < deadline:
    time.sleep(0.1)
result["error_task"] = failing.state
print(json.dumps(result))
""")
    assert out == {"readme": 5, "mul": 12, "count": out["count"], "renamed": "new", "error_task": "RETRY"}
    assert out["count"] >= 1
    call = subprocess.run([sys.executable, "-m", "celery", "-A", "proj", "call", "demoapp.tasks.xsum",
                           "--args=[[1, 2, 3]]", f"--queue={os.environ['MOTIR_QUEUE']}"], cwd=PROJECT, env=django_env,
                          capture_output=True, text=True, timeout=120)
    assert call.returncode == 0, call.stderr
    task_id = call.stdout.strip().splitlines()[-1]
    assert uuid.UUID(task_id)
    fresh = script(django_env, f"from proj.celery import app\nprint(json.dumps(app.AsyncResult({task_id!r}).get(timeout=30)))")
    assert fresh == 6
    wait_for(lambda: f"adopted message {task_id}" in worker.output(), what="the adoption's log line")
