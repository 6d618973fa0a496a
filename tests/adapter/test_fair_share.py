"""Who goes next, with real workers and a real broker (core/admission.py; docs/fair-share.md).

Admission on (the fleet's in-flight limit): a burst of one workspace does not starve the next one,
an urgent run sent after a backlog starts early, a workspace's cap holds while its runs run (and
through a worker killed mid-run), and raising it takes effect on the next choice. Times are the
database's (job_run.started_at, job_queue.finished_at). Sized for a shared 2-core machine; the
in-process specification of the same choices is tests/core/test_admission.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import text
from sqlalchemy.engine import Engine as SAEngine

import tests.fixtures.jobs  # noqa: F401  (registers the jobs in this process too, for send_event)
from motir_celery import send_events
from motir_celery.adapter.celery_app import create_app
from motir_celery.adapter.messages import engine_of
from motir_celery.settings import Settings
from tests.conftest import celery_worker, wait_for

A, B, C = "ws-a", "ws-b", "ws-c"


@pytest.fixture
def app(broker_url: str, monkeypatch: pytest.MonkeyPatch) -> Celery:
    monkeypatch.setenv("CELERY_BROKER_URL", broker_url)
    return create_app(Settings.from_env())


def admission_on(engine: SAEngine, app: Celery, limit: int) -> None:
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO job_admission (name, max_in_flight) VALUES ('fleet', :n)"), {"n": limit})
    engine_of(app).admission.forget()


def set_cap(engine: SAEngine, ws: str, cap: int) -> None:
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO job_quota (workspace_id, max_running) VALUES (:ws, :cap) "
                          "ON CONFLICT ((coalesce(workspace_id, ''))) DO UPDATE SET max_running = :cap"),
                     {"ws": ws, "cap": cap})


def burst(app: Celery, ws: str, n: int, *, sleep: float, priority: int | None = None, chunk: int = 200) -> list[Any]:
    """``n`` runs of test.fair for ``ws``, sent in batches (send_events: one statement a batch)."""
    runs: list[Any] = []
    for start in range(0, n, chunk):
        items = [{"name": "test.fair", "data": {"i": i, "sleep": sleep}, "workspace_id": ws,
                  **({"priority": priority} if priority is not None else {})}
                 for i in range(start, min(n, start + chunk))]
        runs += [r for result in send_events(items, app=app) for r in result.run_ids]
    return runs


def all_finished(engine: SAEngine, n: int) -> bool:
    with engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM job_queue WHERE state = 'succeeded'")).scalar_one() >= n


def finish_order(engine: SAEngine) -> list[tuple[Any, str]]:
    """(run id, workspace) of every finished run, in the order they finished."""
    with engine.connect() as conn:
        return [(r.id, r.workspace_id) for r in conn.execute(text(
            "SELECT id, workspace_id FROM job_queue WHERE state = 'succeeded' ORDER BY finished_at, id"))]


def test_a_burst_of_a_thousand_does_not_starve_the_next_workspace(engine: SAEngine, app: Celery, broker_url: str,
                                                                   tmp_path: Path) -> None:
    """A sends 1,000 runs, then B sends 20: B's 20 all finish before A's 100th (FIFO: after all
    1,000 of A's)."""
    admission_on(engine, app, 8)
    burst(app, A, 1000, sleep=0.01)
    b_runs = burst(app, B, 20, sleep=0.01)
    with celery_worker(tmp_path, broker=broker_url, pool="threads", concurrency=4):
        wait_for(lambda: all_finished(engine, 1020), timeout=240, what="1,020 runs to finish")
    order = finish_order(engine)
    a_order = [run_id for run_id, ws in order if ws == A]
    a_100th = [run_id for run_id, _ in order].index(a_order[99])
    last_b = max(i for i, (run_id, _) in enumerate(order) if run_id in set(b_runs))
    print(f"B's last finished {last_b + 1}th overall; A's 100th finished {a_100th + 1}th")
    assert last_b < a_100th, f"B's last run finished {last_b + 1}th, after A's 100th ({a_100th + 1}th)"


def test_an_urgent_run_sent_after_a_backlog_starts_before_the_50th_normal_one_finishes(
        engine: SAEngine, app: Celery, broker_url: str, tmp_path: Path) -> None:
    admission_on(engine, app, 8)
    burst(app, A, 500, sleep=0.01)
    (urgent,) = burst(app, A, 1, sleep=0.01, priority=9)
    with celery_worker(tmp_path, broker=broker_url, pool="threads", concurrency=4):
        wait_for(lambda: all_finished(engine, 501), timeout=180, what="501 runs to finish")
    with engine.connect() as conn:
        started = conn.execute(text("SELECT min(started_at) FROM job_run WHERE run_id = :r"), {"r": urgent}).scalar()
        fiftieth = conn.execute(text(
            "SELECT finished_at FROM job_queue WHERE state = 'succeeded' AND priority = 0 "
            "ORDER BY finished_at OFFSET 49 LIMIT 1")).scalar()
        before = conn.execute(text("SELECT count(*) FROM job_queue WHERE priority = 0 AND finished_at < :t"),
                              {"t": started}).scalar()
    print(f"the urgent run started after {before} normal runs had finished")
    assert started < fiftieth, f"the urgent run started after {before} normal ones finished"


def test_a_workspace_capped_at_two_never_has_a_third_running_through_a_worker_killed_mid_run_and_a_raise_takes_effect(
        engine: SAEngine, app: Celery, broker_url: str, tmp_path: Path) -> None:
    """C is capped at 2 while A keeps the workers busy: sampled every 5 ms, C never has a third run
    running — also while a worker killed mid-run holds one of C's runs until its lease runs out and
    the sweeper reclaims it. Raised to 3, C has 3 running on the next choices."""
    admission_on(engine, app, 12)
    set_cap(engine, C, 2)
    burst(app, A, 200, sleep=0.2)
    c_runs = burst(app, C, 40, sleep=0.3)
    peak = {"before": 0, "after": 0}
    phase = {"name": "before"}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            with engine.connect() as conn:
                running = conn.execute(text(
                    "SELECT count(*) FROM job_queue WHERE workspace_id = :ws AND state = 'running'"), {"ws": C}).scalar()
            peak[phase["name"]] = max(peak[phase["name"]], int(running or 0))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    env = {"MOTIR_LEASE_SECONDS": "2"}
    try:
        with celery_worker(tmp_path, broker=broker_url, pool="threads", concurrency=4, name="victim", env=env) as victim, \
                celery_worker(tmp_path, broker=broker_url, pool="threads", concurrency=4, name="survivor", env=env):
            def c_running_on_victim() -> bool:
                with engine.connect() as conn:
                    return bool(conn.execute(text(
                        "SELECT count(*) FROM job_queue WHERE workspace_id = :ws AND state = 'running' "
                        "AND claimed_by LIKE :w"), {"ws": C, "w": f"%{victim.nodename.split('@')[0]}%"}).scalar())
            wait_for(c_running_on_victim, timeout=60, what="a run of C on the victim")
            victim.kill()
            wait_for(lambda: _lost(engine) >= 1, timeout=60, what="the killed run's reclaim")
            wait_for(lambda: _finished(engine, C) >= 20, timeout=120, what="20 of C's runs")
            phase["name"] = "after"
            set_cap(engine, C, 3)                      # live: the workers are not told
            wait_for(lambda: peak["after"] >= 3, timeout=30, what="a third run of C once the cap is 3")
            wait_for(lambda: _finished(engine, C) >= len(c_runs), timeout=120, what="all of C's runs")
    finally:
        stop.set()
        sampler.join()
    print(f"C's running peak: {peak}")
    assert peak["before"] == 2 and peak["after"] == 3, peak
    with engine.connect() as conn:
        twice = conn.execute(text("SELECT count(*) FROM job_run WHERE outcome = 'succeeded' "
                                  "GROUP BY run_id HAVING count(*) > 1")).all()
    assert twice == []                                 # nothing ran to success twice


def _lost(engine: SAEngine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM job_run WHERE outcome = 'lost'")).scalar_one())


def _finished(engine: SAEngine, ws: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM job_queue WHERE workspace_id = :ws AND state = 'succeeded'"),
                                {"ws": ws}).scalar_one())


def test_weights_three_to_one_share_the_completed_runs_three_to_one(engine: SAEngine, app: Celery,
                                                                     broker_url: str, tmp_path: Path) -> None:
    """A (weight 3) and B (weight 1) each send 600 runs, interleaved: while both still wait, their
    completed runs are 3 : 1 within 10 %."""
    admission_on(engine, app, 8)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO job_quota (workspace_id, weight) VALUES (:a, 3), (:b, 1)"), {"a": A, "b": B})
    for _ in range(6):
        burst(app, A, 100, sleep=0.01)
        burst(app, B, 100, sleep=0.01)
    with celery_worker(tmp_path, broker=broker_url, pool="threads", concurrency=4):
        wait_for(lambda: all_finished(engine, 1200), timeout=240, what="1,200 runs to finish")
    window = finish_order(engine)[:600]          # B's 600 are not all done by then: both waited
    a, b = sum(1 for _, ws in window if ws == A), sum(1 for _, ws in window if ws == B)
    print(f"of the first 600 completed: A {a}, B {b} ({a / b:.2f} : 1)")
    assert a / b == pytest.approx(3.0, rel=0.10), (a, b)
