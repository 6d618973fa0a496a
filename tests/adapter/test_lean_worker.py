"""A worker imports no SQLAlchemy: its runs go through the engine's own pool (store/pg.py).

SQLAlchemy is ~13 MB of every worker process's memory (its imports measured alone); issue 28's
RSS target has room for it in none of them. A real ``celery worker`` (prefork, two children)
runs a job, its sweeper and heartbeats run, and then neither the main process nor any child has
SQLAlchemy loaded: not in ``sys.modules``, not mapped.
"""

from __future__ import annotations

import time
from pathlib import Path

from sqlalchemy import Engine, text

import tests.fixtures.lean_jobs as lean
from tests.conftest import celery_worker, children


def test_a_prefork_worker_runs_a_job_and_sweeps_without_importing_sqlalchemy(
        tmp_path: Path, broker_url: str, engine: Engine) -> None:
    with celery_worker(tmp_path, broker=broker_url, env={"MOTIR_IMPORTS": "tests.fixtures.lean_jobs"},
                       sweep_interval=0.2) as worker:
        reports = [lean.imports.delay().get(timeout=30) for _ in range(4)]
        time.sleep(1.0)  # a few sweeps and heartbeats on the main process's side pool
        pool = children(worker.proc.pid)
        assert len(pool) == 2, worker.output()[-2000:]
        mapped = {pid: lean.mapped(pid) for pid in [worker.proc.pid, *pool]}
        output = worker.output()
    assert all(r["step"] == 1 for r in reports)
    assert {r["pid"] for r in reports} <= set(pool)  # the runs ran in the pool's children
    assert [r["modules"] for r in reports] == [[]] * 4 and not any(r["mapped"] for r in reports)
    assert mapped == {pid: False for pid in mapped}, output[-3000:]
    with engine.connect() as conn:  # the sweeper ran meanwhile (the test's own reads use SQLAlchemy)
        assert conn.execute(text("SELECT count(*) FROM job_sweep WHERE swept_at > '-infinity'")).scalar_one() >= 1
