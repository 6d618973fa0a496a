"""``self.update_state`` in a durable Celery task: the run's progress, in Postgres (issue 45).

tests/fixtures/durable_tasks.py's ``counts`` reports ``{"done": i}`` as Celery code does, then waits to be
released; meanwhile ``AsyncResult(id)`` in this process and in another one says ``PROGRESS`` and the
last meta. The report is stored with the run (``job_progress``), not in the app's Redis backend; a plain
task's ``update_state``, a direct call's and an eager one's stay Celery's own.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import pytest
import redis
from sqlalchemy import text
from sqlalchemy.engine import Engine

from tests.conftest import ROOT, celery_worker, wait_for

APP = "tests.fixtures.durable_tasks"


@pytest.fixture
def tasks(broker_url: str, database_url: str) -> Iterator[ModuleType]:
    yield importlib.import_module(APP)


def released(engine: Engine, key: str) -> None:
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO test.side_effect (run_id, step) VALUES (:k, 'release')"), {"k": key})


def reported(engine: Engine, key: str) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(text("SELECT count(*) FROM test.side_effect WHERE run_id = :k AND step = 'reported'"),
                                 {"k": key}).scalar())


def elsewhere(task_id: str) -> dict[str, Any]:
    """AsyncResult(task_id) as another process reads it."""
    out = subprocess.run([sys.executable, "-m", "tests.fixtures.result_reader", task_id], cwd=ROOT, check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_update_state_of_a_durable_task_is_read_from_postgres_by_another_process(
        tmp_path: Path, tasks: ModuleType, engine: Engine, broker_url: str) -> None:
    key, n = uuid.uuid4().hex, 7
    with celery_worker(tmp_path, broker=broker_url, app=APP, env={"CELERY_TASK_TRACK_STARTED": "1"}):
        result = tasks.counts.delay(key, n)
        wait_for(lambda: reported(engine, key), timeout=30, what="the task to report")
        assert result.state == "PROGRESS" and result.info == {"done": n}   # this process
        assert elsewhere(result.id) == {"state": "PROGRESS", "info": {"done": n}}   # another one
        with engine.connect() as conn:
            row = conn.execute(text("SELECT state, meta, attempt FROM job_progress WHERE run_id = :r"),
                               {"r": result.id}).one()
        assert tuple(row) == ("PROGRESS", {"done": n}, 1)                  # stored with the run
        assert b"PROGRESS" not in (redis.Redis.from_url(broker_url).get(f"celery-task-meta-{result.id}") or b"")
        released(engine, key)
        assert result.get(timeout=30) == n
    assert result.state == "SUCCESS" and elsewhere(result.id)["state"] == "SUCCESS"


def test_update_state_of_a_plain_task_a_direct_call_and_an_eager_one_stays_celerys(
        tmp_path: Path, tasks: ModuleType, engine: Engine, broker_url: str) -> None:
    key = uuid.uuid4().hex
    with celery_worker(tmp_path, broker=broker_url, app=APP):
        result = tasks.plain_counts.delay(key, 3)
        wait_for(lambda: reported(engine, key), timeout=30, what="the plain task to report")
        assert result.state == "PROGRESS" and result.info == {"done": 3}   # the app's Redis backend
        released(engine, key)
        assert result.get(timeout=30) == 3
    direct = uuid.uuid4().hex
    released(engine, direct)
    for task in (tasks.counts, tasks.plain_counts):    # a direct call: Celery's own, which has no task id
        with pytest.raises(ValueError, match="task_id must not be empty"):
            task(direct, 2)
    eager = tasks.counts.apply(args=(direct, 2))       # eager: Celery's, into the app's backend
    assert eager.get() == 2 and tasks.app.AsyncResult(eager.id).info == {"done": 2}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM job_progress")).scalar() == 0
