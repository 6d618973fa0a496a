"""Old producers keep their results through a workers-first switch (docs/operations.md, "Results during the switch").

Two versions of one small project, as a team has them on the day of the switch: ``oldproj`` (plain
Celery: ``@app.task``, a result backend of its own, here SQLite as in Celery's Django example) and
``newproj`` (the same task names as durable jobs, ``motir_celery.attach(app)``, the same result
backend still configured). The worker is a real ``celery -A newproj worker``; the producer is a
process of the old code that never imports motir-celery. Its ``AsyncResult(id).get()`` answers
because the worker copies each durable run's final state into the app's own backend; with
``motir_copy_results = False`` (the step after the switch) it does not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, celery_worker

OLD = '''
import os
from celery import Celery

app = Celery("proj", broker=os.environ["CELERY_BROKER_URL"], backend=os.environ["RESULTS"])
app.conf.task_default_queue = os.environ["MOTIR_QUEUE"]


@app.task(name="proj.add")
def add(x, y):
    return x + y


@app.task(name="proj.check")
def check(n):
    if n < 0:
        raise ValueError(f"negative: {n}")
    return n
'''

NEW = '''
import os
from celery import Celery

import motir_celery
from motir_celery import define_job

app = Celery("proj", broker=os.environ["CELERY_BROKER_URL"], backend=os.environ["RESULTS"])
app.conf.task_default_queue = os.environ["MOTIR_QUEUE"]
app.conf.motir_copy_results = os.environ.get("COPY", "1") == "1"
motir_celery.attach(app)


@define_job("proj.add", bind=False, name="proj.add")
def add(x, y):
    return x + y


@define_job("proj.check", bind=False, name="proj.check", retry_policy="none")
def check(n):
    if n < 0:
        raise ValueError(f"negative: {n}")
    return n
'''

PRODUCER = '''
import json, sys
import celery.exceptions
import oldproj

out = {}
for name, call in (("add", lambda: oldproj.add.delay(2, 3)), ("check", lambda: oldproj.check.delay(-1))):
    result = call()
    try:
        out[name] = ["ok", result.get(timeout=float(sys.argv[1]))]
    except celery.exceptions.TimeoutError:
        out[name] = ["timeout", None]
    except Exception as exc:
        out[name] = ["raised", f"{type(exc).__name__}: {exc}"]
    out[name + "_id"] = result.id
out["motir_imported"] = any(m.startswith("motir_celery") for m in sys.modules)
print(json.dumps(out))
'''


@pytest.fixture
def project(tmp_path: Path, broker_url: str, database_url: str) -> dict[str, str]:
    (tmp_path / "oldproj.py").write_text(OLD)
    (tmp_path / "newproj.py").write_text(NEW)
    (tmp_path / "producer.py").write_text(PRODUCER)
    return {"RESULTS": f"db+sqlite:///{tmp_path / 'results.sqlite'}", "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
            "MOTIR_IMPORTS": "newproj", "CELERY_BROKER_URL": broker_url, "MOTIR_QUEUE": os.environ["MOTIR_QUEUE"]}


def produce(tmp_path: Path, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """The old code's producer, in a process of its own (no motir-celery in it)."""
    child = {k: v for k, v in os.environ.items() if not k.startswith("MOTIR_")}
    child.update(env)
    proc = subprocess.run([sys.executable, "producer.py", str(timeout)], cwd=tmp_path, env=child,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_plain_celery_producer_reads_the_durable_runs_result_from_its_own_backend(
        tmp_path: Path, project: dict[str, str], engine: Any) -> None:
    with celery_worker(tmp_path, broker=project["CELERY_BROKER_URL"], app="newproj", env=project) as worker:
        out = produce(tmp_path, project, timeout=30)
        assert "adopted message" in worker.output()
    assert out["motir_imported"] is False
    assert out["add"] == ["ok", 5]
    assert out["check"][0] == "raised" and out["check"][1] == "ValueError: negative: -1"   # the job's own exception
    from sqlalchemy import text
    with engine.connect() as conn:   # and the durable runs are there, under the producer's task ids
        states = dict(conn.execute(text("SELECT id::text, state FROM job_queue")).all())
    assert states == {out["add_id"]: "succeeded", out["check_id"]: "failed"}


def test_with_the_copy_turned_off_the_old_producer_waits_in_vain(
        tmp_path: Path, project: dict[str, str], engine: Any) -> None:
    env = {**project, "COPY": "0"}
    with celery_worker(tmp_path, broker=project["CELERY_BROKER_URL"], app="newproj", env=env):
        out = produce(tmp_path, env, timeout=4)
    assert out["add"] == ["timeout", None] and out["check"] == ["timeout", None]
