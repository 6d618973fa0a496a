"""Jobs with flow control (throttle=, debounce=, batch=) for tests/test_flow_control.py and tests/test_insights.py.

Imported by the tests and by their real workers (``MOTIR_IMPORTS=tests.jobs,tests.flow_jobs``).
Each handler records when it started in ``test.side_effect`` when that table exists (the
session database of tests/conftest.py), by the database's clock, and returns what it was given.
"""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy import text

from motir_celery import RetryPolicy, define_job
from motir_celery.store.db import get_engine

#: The throttle the concurrent tests drive: 3 starts per 2 s per key.
LIMIT, PERIOD = 3, 2.0


def _record(run_id: str, step: str) -> None:
    with get_engine().begin() as conn:
        if conn.execute(text("SELECT to_regclass('test.side_effect')")).scalar() is None:
            return  # the kit's own database: no side-effect ledger
        conn.execute(text("INSERT INTO test.side_effect (run_id, step, pid, at) VALUES (:r, :s, :p, clock_timestamp())"),
                     {"r": run_id, "s": step, "p": os.getpid()})


@define_job("flow.throttled", event="flow.throttle", throttle=(LIMIT, PERIOD, "data.key"), retry_policy="none")
def throttled(event: Any, step: Any) -> Any:
    _record(event.run_id, "start")
    return event.data


@define_job("flow.throttled_whole", event="flow.throttle_whole", throttle=(1, 60.0), retry_policy="none")
def throttled_whole(event: Any, step: Any) -> Any:
    return event.data


#: Retries come quickly (the tests wait them out with the kit's advance, or for real).
QUICK = RetryPolicy(max_attempts=3, backoff=0.2, factor=1.0, jitter=0.0, name="quick")


@define_job("flow.throttled_flaky", event="flow.throttle_flaky", throttle=(1, 60.0), retry_policy=QUICK)
def throttled_flaky(event: Any, step: Any) -> Any:
    if event.attempt == 1:
        raise RuntimeError("the first attempt fails")
    return event.attempt


@define_job("flow.debounced", event="flow.debounce", debounce=(5.0, "data.key", 30.0), retry_policy="none")
def debounced(event: Any, step: Any) -> Any:
    _record(event.run_id, "start")
    return event.data


@define_job("flow.debounced_limited", event="flow.debounce_limited", debounce=(5.0, "data.key"),
            concurrency=(1, "data.account"), retry_policy="none")
def debounced_limited(event: Any, step: Any) -> Any:
    return event.data


@define_job("flow.debounced_fast", event="flow.debounce_fast", debounce=(1.0, "data.key", 6.0), retry_policy="none")
def debounced_fast(event: Any, step: Any) -> Any:
    _record(event.run_id, "start")
    return event.data


@define_job("flow.batched", event="flow.batch", batch=(5, 10.0, "data.key"), retry_policy="none")
def batched(events: list[Any], step: Any) -> Any:
    _record(events[0].run_id, "start")
    return [e.data for e in events]


@define_job("flow.batched_fast", event="flow.batch_fast", batch=(10, 1.0, "data.key"), retry_policy="none")
def batched_fast(events: list[Any], step: Any) -> Any:
    _record(events[0].run_id, "start")
    return [e.data["n"] for e in events]


@define_job("flow.plain", event="flow.plain", retry_policy="none")
def plain(event: Any, step: Any) -> Any:
    return event.data


# --- for the insights: outcomes, retries, durations ------------------------------------------


@define_job("flow.fails", event="flow.fail", retry_policy="none")
def fails(event: Any, step: Any) -> Any:
    raise RuntimeError(f"flow.fails always fails ({event.data.get('n')})")


@define_job("flow.flaky", event="flow.flaky", retry_policy=QUICK)
def flaky(event: Any, step: Any) -> Any:
    if event.attempt == 1:
        raise RuntimeError("the first attempt fails, the second succeeds")
    return event.attempt


@define_job("flow.invokes_batch", event="flow.invoke_batch", retry_policy="none")
def invokes_batch(event: Any, step: Any) -> Any:
    # a child of a batch job: run as it is, a batch of one (its parent waits for that very run)
    return step.invoke("child", "flow.batched", {"key": "k", "n": event.data["n"]})
