"""Helpers for the operator-surface tests: real runs, executed in this process.

``runner.execute`` is exactly what a worker's task calls, so the rows these
helpers leave (runs, steps, attempts, DLQ entries) are the engine's own; only
the Celery hop is skipped, which keeps CLI, dashboard and purge tests fast.
The end-to-end path through a real worker is covered by test_browser.py.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Engine

import tests.jobs  # noqa: F401  (registers the test jobs in this process)
from motir_celery.core.producer import events
from motir_celery.core.worker import runner
from motir_celery.core.worker.runner import Outcome

WORKER = "ops-test@host/1"


def emit(name: str, data: Any, **kwargs: Any) -> dict[str, uuid.UUID]:
    """Send an event without publishing; returns {job_id: run_id}."""
    result = events.send_event(name, data, publish=None, **kwargs)
    return {r.job_id: r.run_id for r in result.runs if hasattr(r, "run_id")}


def settle(run_id: uuid.UUID, job_id: str, *, timeout: float = 10.0) -> Outcome:
    """Execute a run until it succeeds, fails or is cancelled (waiting out retry backoffs)."""
    deadline = time.monotonic() + timeout
    while True:
        outcome = runner.execute(run_id, job_id=job_id, worker=WORKER)
        if outcome.state in ("succeeded", "failed", "cancelled"):
            return outcome
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run_id} not settled after {timeout}s: {outcome}")
        time.sleep(0.05)


def run_event(name: str, data: Any, **kwargs: Any) -> dict[str, uuid.UUID]:
    runs = emit(name, data, **kwargs)
    for job_id, run_id in runs.items():
        settle(run_id, job_id)
    return runs


def dead_letter(engine: Engine, workspace: str | None, switch: str | None = None) -> tuple[uuid.UUID, uuid.UUID]:
    """A failed run with an open DLQ entry (test.mixed-fail); returns (run_id, dlq_id)."""
    data: dict[str, Any] = {"switch": switch or uuid.uuid4().hex}
    if workspace is not None:
        data["workspace_id"] = workspace
    runs = run_event("test.mixed", data)
    run_id = runs["test.mixed-fail"]
    with engine.connect() as conn:
        dlq_id = conn.execute(text("SELECT id FROM job_run_dlq WHERE run_id = :r"), {"r": run_id}).scalar_one()
    return run_id, dlq_id


def fix_switch(engine: Engine, switch: str) -> None:
    """Make test.mixed-fail succeed from now on for events carrying ``switch``."""
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO test.side_effect (run_id, step) VALUES (:s, 'fixed')"), {"s": switch})


def age(engine: Engine, sql: str, **params: Any) -> None:
    """Backdate rows (retention tests): run ``sql`` as the owner."""
    with engine.begin() as conn:
        conn.execute(text(sql), params)
