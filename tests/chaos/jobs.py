"""Jobs of the chaos workload (workers import ``MOTIR_IMPORTS=tests.chaos.jobs``).

Every step body first records itself in the ledger ``test.side_effect`` through a
connection of its own, committed at once, *before* doing anything else. So a body
that started and was then killed, timed out or cut off from its database still
counts: the invariant checks compare real executions with stored results
(``job_step``), never stored results with themselves. The ledger's ``at`` is the
database's ``now()``, the same clock as ``job_step.completed_at``.

Every event name starts with ``chaos.``; nothing else in the test suite sends them.
"""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import psycopg

from motir_celery import RetryAfterError, RetryPolicy, define_job

#: Patient enough that faults every few seconds never exhaust a healthy run:
#: a run that lands in the DLQ here means something repeatedly failed it.
PATIENT = RetryPolicy(max_attempts=25, backoff=0.2, factor=1.5, max_backoff=2.0, jitter=0.2, name="chaos-patient")


def _dsn() -> str:
    return os.environ["MOTIR_DATABASE_URL"].replace("postgresql+psycopg://", "postgresql://", 1)


def record(event: Any, step_name: str) -> None:
    """One ledger row per body execution; raises (and so runs nothing) if the database is away."""
    with psycopg.connect(_dsn(), autocommit=True, connect_timeout=5) as conn:
        conn.execute(
            "INSERT INTO test.side_effect (run_id, step, attempt, pid) VALUES (%s, %s, %s, %s)",
            (event.run_id, step_name, event.attempt, os.getpid()),
        )


def recorded_body(event: Any, name: str, value: Any, sleep: float = 0.0) -> Any:
    record(event, name)
    if sleep > 0:
        time.sleep(sleep)
    return value


@define_job("chaos.work", event="chaos.work", retry_policy=PATIENT)
def work(event: Any, step: Any) -> Any:
    """``steps`` steps of about ``sleep`` seconds each; ``fail_once``: the first attempt raises at the end."""
    data = event.data
    n, sleep = int(data.get("steps", 3)), float(data.get("sleep", 0.03))
    total = 0
    for i in range(n):
        total += step.run(f"s{i}", recorded_body, event, f"s{i}", i, sleep * random.uniform(0.5, 1.5))
    if data.get("fail_once") and event.attempt == 1:
        raise RuntimeError("chaos: first attempt fails after its steps (retried; steps are not redone)")
    return {"total": total}


@define_job("chaos.audit", event="chaos.work", retry_policy=PATIENT)
def audit(event: Any, step: Any) -> Any:
    """A second subscriber of ``chaos.work``: each event fans out to two runs."""
    return step.run("audit", recorded_body, event, "audit", {"seen": event.data.get("i")})


@define_job("chaos.slow", event="chaos.slow", retry_policy=PATIENT, soft_time_limit=1.5, time_limit=4)
def slow(event: Any, step: Any) -> Any:
    """A long middle step. ``long``: its sleep on the first attempt (past the soft limit,
    it is interrupted by ``SoftTimeLimitExceeded``); ``stubborn``: the body swallows the
    soft limit and keeps sleeping until the hard limit kills the pool process."""
    data = event.data
    step.run("before", recorded_body, event, "before", 1)

    def middle() -> int:
        record(event, "middle")
        sleep = float(data.get("long", 0)) if event.attempt == 1 else 0.05
        try:
            time.sleep(sleep)
        except BaseException:
            if data.get("stubborn"):
                time.sleep(10)  # ignores the soft limit: the hard limit (4 s) ends the process
            raise
        return 2

    step.run("middle", middle)
    step.run("after", recorded_body, event, "after", 3)
    return "done"


@define_job("chaos.poison", event="chaos.poison", retry_policy=RetryPolicy(max_attempts=3, backoff=0, jitter=0, name="chaos-poison"))
def poison(event: Any, step: Any) -> Any:
    """Kills the worker process that runs it, every attempt."""
    step.run("ok", recorded_body, event, "ok", 1)

    def die() -> None:
        record(event, "die")
        os.kill(os.getpid(), signal.SIGKILL)

    step.run("die", die)


@define_job("chaos.clock", event="chaos.clock", retry_policy=PATIENT)
def clock(event: Any, step: Any) -> Any:
    """Asks for a retry ``delay`` seconds later on its first attempt (RetryAfterError),
    and sleeps ``sleep`` in its last step (long enough to be SIGKILLed there)."""
    data = event.data
    step.run("a", recorded_body, event, "a", 1)
    if event.attempt == 1:
        raise RetryAfterError(float(data.get("delay", 1.0)))
    step.run("b", recorded_body, event, "b", 2, float(data.get("sleep", 0.0)) if event.attempt == 2 else 0.0)
    return {"tz": os.environ.get("TZ", "")}


@define_job("chaos.echo", event="chaos.echo", retry_policy="none")
def echo(event: Any, step: Any) -> Any:
    """Bad-input scenario: step ids, and a step output size, taken from the event."""
    data = event.data
    out = [step.run(str(sid), recorded_body, event, str(sid), data.get("value")) for sid in data.get("steps", ["x"])]
    if data.get("output_bytes"):
        step.run("big", lambda: "x" * int(data["output_bytes"]))
    return out


@define_job("chaos.zombie", event="chaos.zombie", retry_policy="none")
def zombie(event: Any, step: Any) -> Any:
    """A worker frozen between two steps while another worker takes its run over
    (the forged reclaim below is what the sweeper and a second claim would do)."""
    step.run("a", recorded_body, event, "a", 1)
    with psycopg.connect(_dsn(), autocommit=True) as conn:
        conn.execute("UPDATE job_queue SET claim_token = gen_random_uuid() WHERE id = %s", (event.run_id,))
    time.sleep(float(event.data.get("frozen", 0.0)))
    step.run("b", recorded_body, event, "b", 2)
    return "should not get here"
