"""The way back as a command, rolled back and forward twice (docs/operations.md, "Rolling back to plain Celery").

Two versions of one project share a broker queue and the session's database: ``oldwork`` (a plain
Celery task ``work.record``) and ``newwork`` (the same task name as a durable job). Each piece of
work ``n`` records itself in ``test.side_effect`` (slowly: one worker process, 0.3 s each), so at
every switch some work is queued and one piece is running. The switches are what a team does:
stop the workers (a warm shutdown finishes what runs), ``motir rollback --all`` on the way back,
start the other version's worker; producers of the version in place send more work meanwhile.
Every piece of work must have happened exactly once at the end, and no old worker may have been
handed a run's message.
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import signal
import subprocess
import sys
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import make_url, text

import motir_celery
from motir_celery.adapter.rollback import RESENT, roll_back
from motir_celery.core.jobs import job_for_task
from tests.conftest import ROOT, celery_worker, run_state, wait_for

BODY = '''
import os, time
import psycopg


def record(n):
    time.sleep(0.3)
    with psycopg.connect(os.environ["LEDGER_URL"], autocommit=True) as conn:
        conn.execute("INSERT INTO test.side_effect (run_id, step) VALUES (%s, 'record')", (str(n),))
    return n
'''

OLD = BODY + '''
from celery import Celery

app = Celery("work", broker=os.environ["CELERY_BROKER_URL"])
app.conf.task_default_queue = os.environ["MOTIR_QUEUE"]
app.task(name="work.record")(record)
'''

NEW = BODY + '''
from celery import Celery
import motir_celery
from motir_celery import define_job

app = Celery("work", broker=os.environ["CELERY_BROKER_URL"])
app.conf.task_default_queue = os.environ["MOTIR_QUEUE"]
motir_celery.attach(app)
define_job("work.record", bind=False, name="work.record", retry_policy="transient")(record)
'''


def send(tmp: Path, env: dict[str, str], module: str, numbers: range) -> None:
    code = f"import {module}\nfor n in {list(numbers)!r}:\n    {module}.app.send_task('work.record', (n,))" \
        if module == "oldwork" else \
        f"import {module}\nfrom motir_celery.core.jobs import get_job\nfor n in {list(numbers)!r}:\n    get_job('work.record').delay(n)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def ledger(engine: Any) -> list[int]:
    with engine.connect() as conn:
        return sorted(int(r) for r in conn.execute(text("SELECT run_id FROM test.side_effect WHERE step = 'record'")).scalars())


def warm_shutdown(w: Any) -> None:
    """What a deploy does: SIGTERM to the worker's main process, which finishes what its pool runs."""
    os.kill(w.proc.pid, signal.SIGTERM)
    w.proc.wait(timeout=60)


def pending(engine: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM job_queue WHERE state = 'queued'")).scalar_one())


def running(engine: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM job_queue WHERE state = 'running'")).scalar_one())


def test_roll_back_and_forward_twice_each_piece_of_work_once(tmp_path: Path, broker_url: str, database_url: str,
                                                             engine: Any) -> None:
    (tmp_path / "oldwork.py").write_text(OLD)
    (tmp_path / "newwork.py").write_text(NEW)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "MOTIR_IMPORTS": "newwork",
           "CELERY_BROKER_URL": broker_url, "MOTIR_DATABASE_URL": database_url,
           "LEDGER_URL": make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)}
    sent = 0
    outputs: list[str] = []

    def worker(stack: ExitStack, app: str, name: str) -> Any:
        return stack.enter_context(celery_worker(tmp_path, broker=broker_url, app=app, env=env, concurrency=1,
                                                 name=name))

    def batch(module: str, size: int = 8) -> None:
        nonlocal sent
        send(tmp_path, env, module, range(sent, sent + size))
        sent += size

    for round_ in range(2):
        # The release: its worker takes work, and one run is running when it is stopped.
        with ExitStack() as stack:
            w = worker(stack, "newwork", f"new{round_}")
            batch("newwork")
            wait_for(lambda: running(engine) == 1 and len(ledger(engine)) >= 1, timeout=60, what="a run running")
            warm_shutdown(w)             # it finishes the run it had
            assert running(engine) == 0
        outputs.append(w.output())
        back = subprocess.run([sys.executable, "-m", "motir_celery.ops.cli", "-A", "newwork", "rollback", "--all"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert back.returncode == 0, back.stdout + back.stderr
        assert "purged" in back.stdout and "send work.record as task" in back.stdout, back.stdout
        # The code before it: the work handed back runs there, old producers send more.
        with ExitStack() as stack:
            w = worker(stack, "oldwork", f"old{round_}")
            batch("oldwork")
            done = len(ledger(engine))
            wait_for(lambda: len(ledger(engine)) >= done + 2, timeout=60, what="the old worker at work")
            warm_shutdown(w)             # mid-queue: what it had not taken waits for the next release
        outputs.append(w.output())
    with ExitStack() as stack:       # forward for good: everything left runs
        w = worker(stack, "newwork", "final")
        wait_for(lambda: len(ledger(engine)) >= sent, timeout=120, what="every piece of work")
        wait_for(lambda: running(engine) == 0 and pending(engine) == 0, timeout=60, what="no run left")
    outputs.append(w.output())
    assert ledger(engine) == list(range(sent))             # each piece of work exactly once
    assert not any("missing 1 required positional argument" in o or "TypeError" in o for o in outputs)
    with engine.connect() as conn:
        left = conn.execute(text("SELECT count(*) FROM job_queue WHERE state IN ('queued', 'running')")).scalar_one()
        handed_back = conn.execute(text("SELECT count(*) FROM job_queue WHERE claimed_by = 'motir rollback'")).scalar_one()
    assert left == 0 and handed_back > 0


def test_a_durable_celery_tasks_queued_run_is_handed_back_once(broker_url: str, database_url: str,
                                                               engine: Any) -> None:
    """``@app.task(durable=True)``: the run's message is Celery's own, arguments and all, under the
    run's id. Kept in the queue beside the work handed back, an old worker would run it twice."""
    tasks = importlib.import_module("tests.fixtures.durable_tasks")
    queue = redis.Redis.from_url(broker_url)
    queue.delete(os.environ["MOTIR_QUEUE"])
    result = tasks.flaky.delay("handed-back", 0)       # its run written, then Celery's message sent
    job = job_for_task(tasks.flaky.name)
    assert job is not None and job.celery
    dry = roll_back(motir_celery.current_engine(), tasks.app, [job], dry_run=True)
    assert dry.queues == {os.environ["MOTIR_QUEUE"]: 1} and dry.purged == 0 and len(dry.resent) == 1
    report = roll_back(motir_celery.current_engine(), tasks.app, [job])
    handed = str(uuid.uuid5(RESENT, result.id))
    assert (report.purged, report.kept, report.resent) == (1, 0, [(result.id, tasks.flaky.name, handed)])
    left = [json.loads(m) for m in queue.lrange(os.environ["MOTIR_QUEUE"], 0, -1)]
    assert [(m["headers"]["task"], m["headers"]["id"]) for m in left] == [(tasks.flaky.name, handed)]  # once
    args, kwargs, _ = json.loads(base64.b64decode(left[0]["body"]))
    assert (args, kwargs) == (["handed-back", 0], {})   # the same arguments
    assert run_state(engine, result.id) == "cancelled"
