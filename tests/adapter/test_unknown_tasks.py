"""A message naming a task no worker here registers is seen by an operator, never only logged (issue 47).

Real ``celery -A motir_celery worker`` processes on Redis (adapter/unknown.py):

* a run of a job no worker defines (removed, or forged), whose message the sweeper re-publishes
  under the job's alias, is failed into the DLQ with ``UnknownJobError`` within one re-publish
  period (before: re-sent every period for ever, an ERROR and a traceback each time);
* a plain task message nobody registers is moved to ``<queue>.malformed`` with the reason (before:
  discarded with an ERROR line, as plain Celery does).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from sqlalchemy import text

from motir_celery.adapter.guard import MALFORMED_SUFFIX
from tests.conftest import celery_worker, wait_for

#: How long a run's message may go unanswered before the sweeper sends it again (the workers' setting here).
REPUBLISH_AFTER = 3.0
SWEEP_INTERVAL = 1.0


def _dlq(engine: Any, run_id: object) -> Any:
    with engine.connect() as conn:
        return conn.execute(text("SELECT failure->>'type' AS type, failure->>'message' AS message, attempts "
                                 "FROM job_run_dlq WHERE run_id = :r"), {"r": run_id}).one_or_none()


def test_a_run_of_a_removed_job_reaches_the_dlq_within_one_republish_period_and_an_unknown_task_is_set_aside(
        engine: Any, broker_url: str, queue: str, tmp_path: Path) -> None:
    env = {"MOTIR_REPUBLISH_AFTER": str(REPUBLISH_AFTER)}
    with celery_worker(tmp_path, broker=broker_url, concurrency=1, sweep_interval=SWEEP_INTERVAL, env=env) as worker:
        # A run of a job no worker defines, its message just sent and lost: the sweeper sends it again
        # once REPUBLISH_AFTER has passed, under the job's alias (motir.removed.job).
        with engine.begin() as conn:
            run_id = conn.execute(text(
                "INSERT INTO job_queue (job_id, event_name, workspace_id, max_attempts, retry_policy, dispatched_at) "
                "VALUES ('removed.job', 'direct.removed.job', 'ws-a', 3, 'transient', now()) RETURNING id"
            )).scalar_one()
        started = time.monotonic()
        Celery(broker=broker_url).send_task("no.such.task", args=[1], queue=queue)
        wait_for(lambda: _dlq(engine, run_id) is not None, timeout=REPUBLISH_AFTER + SWEEP_INTERVAL + 20,
                 what="the run of the removed job in the DLQ")
        elapsed = time.monotonic() - started
        client = redis.Redis.from_url(broker_url)
        try:
            wait_for(lambda: client.llen(queue + MALFORMED_SUFFIX) == 1, timeout=10,
                     what="the unknown task's message set aside")
            aside = client.lrange(queue + MALFORMED_SUFFIX, 0, -1)
        finally:
            client.close()
        log = worker.output()
        with engine.connect() as conn:   # and the worker wrote its jobs into the registry at start-up
            registered = dict(conn.execute(text("SELECT job_id, registered_by FROM job_registry")).all())
    assert registered.get("test.three-steps") == worker.nodename and "removed.job" not in registered, registered
    entry = _dlq(engine, run_id)
    assert entry.type.endswith("UnknownJobError") and "removed.job" in entry.message, entry
    assert entry.attempts == 1   # one message, one attempt: not each period for ever
    # Within one re-publish period (plus the sweep's tick and a loaded machine's slack).
    assert elapsed < REPUBLISH_AFTER + SWEEP_INTERVAL + 10, elapsed
    assert b'"no.such.task"' in aside[0]
    assert "no task 'no.such.task' is registered in this worker" in log, log[-3000:]
    assert f"moved to the Redis list '{queue}{MALFORMED_SUFFIX}'" in log
    with engine.connect() as conn:
        assert conn.execute(text("SELECT state FROM job_queue WHERE id = :r"), {"r": run_id}).scalar_one() == "failed"
