"""Execute one run: claim, call the handler with its memoized steps, settle.

What a Celery task calls with the run id from its message; the only place an
attempt starts or ends. One pooled connection, in autocommit, for the attempt:
the claim, each step record and the settle are one statement and one commit.

How an attempt ends: ``LostClaim`` / ``RunCancelled`` (a fenced write was
refused: write nothing more); ``NonRetriableError``, ``StepOutputError``, an
unknown job, or a claim whose data cannot be decoded (nested deeper than Python's
json reads) → failed + DLQ now; ``RateLimited`` → deferred, no attempt charged;
``RetryAfterError`` → its delay (``RetryRequested``, a Celery task's own retry: whatever attempts are
left, its message the task's); anything else → the retry policy, then the DLQ.
Nothing a handler raises or returns can make the settle fail: errors are made
storable (``failures.py``), delays are checked where raised, results JSON-checked.
A settle Postgres still refuses fails the attempt with the database's message.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, Mapping

import psycopg

from motir_celery.core.jobs import Job, find_job, get_job
from motir_celery.core.publish import publish_or_log
from motir_celery.core.shapes import CHILD_EVENT_PREFIX, arguments
from motir_celery.core.tracing import run_span
from motir_celery.core.worker import concurrency, flow
from motir_celery.core.worker.claim import claim as claim_run
from motir_celery.core.worker.failures import describe, storable_error
from motir_celery.core.worker.steps import Step, encode_json
from motir_celery.errors import (
    LostClaim,
    NonRetriableError,
    RateLimited,
    RetryAfterError,
    RetryRequested,
    RunCancelled,
    StepOutputError,
    Suspended,
    UnknownJobError,
)
from motir_celery.store import records
from motir_celery.store.pg import ConnectionLost, PooledConnection
from motir_celery.store.sql import worker as worker_sql

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine

__all__ = ["Event", "Outcome", "execute", "call_handler"]

log = logging.getLogger("motir_celery.runner")


@dataclass(frozen=True)
class Event:
    """What a handler receives as its first argument."""

    name: str
    data: Any
    id: str | None
    workspace_id: str | None
    run_id: str
    attempt: int
    scheduled_for: datetime | None = None


@dataclass(frozen=True)
class Outcome:
    run_id: str
    state: str  # succeeded | retrying | deferred | suspended | failed | cancelled | lost | skipped
    detail: str = ""
    #: What the handler returned (succeeded only): the task's return value, so Flower shows it.
    result: Any = None
    #: What ended the attempt (retrying, failed, deferred): the exception the settle stored.
    error: BaseException | None = None


def execute(engine: Engine, run_id: uuid.UUID | str, *, job_id: str, worker: str) -> Outcome:
    """One attempt of the run a message names (``Engine.execute``)."""
    try:
        run_uuid = run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))
    except ValueError:
        # A forged message's "run id" is echoed at most 100 characters.
        shown = repr(run_id)[:100]
        log.warning("dropping message with a malformed run id %s for job %s", shown, job_id)
        return Outcome(shown, "skipped", "malformed run id")
    try:
        return _execute(engine, run_uuid, job_id, worker)
    except ConnectionLost:
        # The pooled socket died under us (a database restart): the pool replaces every
        # connection it had. Once more on a fresh socket: a claim that never reached the server
        # claims now; a run already claimed is refused here and left to its lease.
        log.info("run %s: connection lost; trying once more on a new one", run_uuid)
        return _execute(engine, run_uuid, job_id, worker)


def _execute(engine: Engine, run_uuid: uuid.UUID, job_id: str, worker: str) -> Outcome:
    with engine.pool().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        # Held from before the claim, under the token the claim then stores: the lease is
        # renewed from the claim's commit on, whatever else holds this process's GIL.
        with engine.leases.hold(run_uuid, job_id) as token:
            try:
                claim = claim_run(engine, conn, run_uuid, job_id=job_id, worker=worker, token=token)
            except RecursionError as exc:
                # Its data (or a step's output) is nested deeper than Python's json decodes: every
                # attempt would fail here, each to its lease. Failed now, with the reason.
                return _undecodable(conn, run_uuid, job_id, token, exc)
            if claim is None:
                # Duplicate or stale delivery, a run not due yet, or a forged id: ack and do nothing.
                log.debug("run %s of %s not claimable (duplicate, stale, not due or unknown)", run_uuid, job_id)
                return Outcome(str(run_uuid), "skipped", "not claimable")
            try:
                with run_span(claim.job_id, str(claim.run_id), claim.attempt, claim.traceparent):
                    outcome = _attempt(engine, claim, conn)
                if outcome.state in ("succeeded", "failed") and claim.event_name.startswith(CHILD_EVENT_PREFIX):
                    # A child that reached a final state may have woken its parent (the trigger
                    # did, in the settle's transaction): publish the parent now.
                    engine.publish_woken(conn, [claim.run_id])
                return outcome
            finally:
                if claim.concurrency_key is not None:
                    concurrency.free_slot(engine, claim)
                _hand_on(engine, claim)


def _hand_on(engine: Engine, claim: records.Claim) -> None:
    """This attempt has ended: its run left the in-flight set (or is queued again, and counted
    again), so admission may send the next held run (core/admission.py; nothing while it is off)."""
    try:
        engine.admission.dispatch(limit=1)
    except Exception:  # noqa: BLE001 — the sweep dispatches what this could not
        log.warning("run %s: could not hand its admission slot on", claim.run_id, exc_info=True)


def _undecodable(conn: PooledConnection, run_uuid: uuid.UUID, job_id: str, token: uuid.UUID,
                 exc: RecursionError) -> Outcome:
    """A run whose claim could not be decoded: failed into the DLQ at once (its data stays in job_event)."""
    reason = NonRetriableError(f"the run's data cannot be decoded here: it is nested too deeply ({exc})")
    dlq_id = worker_sql.fail_undecodable(conn, run_uuid, job_id, token, storable_error(reason))
    if dlq_id is None:
        return Outcome(str(run_uuid), "skipped", "not claimable")
    log.error("run %s of %s failed at its claim: %s; DLQ entry %s", run_uuid, job_id, reason, dlq_id)
    return Outcome(str(run_uuid), "failed", str(dlq_id), error=reason)


def _attempt(engine: Engine, claim: records.Claim, conn: PooledConnection) -> Outcome:
    when = claim.scheduled_for
    event_data = claim.event_data if claim.event_id else {"scheduled_for": when.isoformat() if when else None}
    step = Step(engine, claim, conn, event_data=event_data)
    limit = engine.settings.max_payload_bytes
    run = str(claim.run_id)
    try:
        job = get_job(claim.job_id)
        event = Event(name=claim.event_name, data=event_data, id=str(claim.event_id) if claim.event_id else None,
                      workspace_id=claim.workspace_id, run_id=run, attempt=claim.attempt,
                      scheduled_for=claim.scheduled_for)
        # batch=: the handler gets the list of the events the run gathered
        result = call_handler(job, _batch_of(conn, claim, event) if job.run_options.batch else event, step)
        step.finish()  # its streams' last segment ends before the settle (core/worker/streams.py)
        encoded = encode_json(result, what=f"the handler of {claim.job_id!r} returned a value that", limit=limit)
    except Suspended as exc:
        # step.sleep / wait_for_event already queued the run again (no attempt charged).
        return Outcome(run, "suspended", f"until {exc.until}")
    except RunCancelled:
        log.info("run %s cancelled; stopped at a step boundary", run)
        return Outcome(run, "cancelled")
    except LostClaim as exc:
        log.warning("%s", exc)
        return Outcome(run, "lost", str(exc))
    except (NonRetriableError, StepOutputError, UnknownJobError) as exc:
        return _settle(engine, claim, conn, exc, None)
    except RateLimited as exc:
        return _settle(engine, claim, conn, exc, exc.retry_after, defer=True)
    except RetryAfterError as exc:
        return _settle(engine, claim, conn, exc, exc.delay)
    except Exception as exc:  # noqa: BLE001 — any handler error is a failed attempt
        return _settle(engine, claim, conn, exc, _backoff(claim))
    outcome = _settle_success(engine, claim, conn, encoded, step.audited)
    return replace(outcome, result=result) if outcome.state == "succeeded" else outcome


def _batch_of(conn: PooledConnection, claim: records.Claim, event: Event) -> list[Event]:
    """A batch run's events, in order of arrival (a run no producer gathered: its own one)."""
    return [replace(event, name=e["name"], data=e["data"], id=str(e["id"]))
            for e in flow.batch_events(conn, claim.run_id)] or [event]


def call_handler(job: Job, event: Any, step: Any) -> Any:
    """``handler(event, step)``; a direct job's ``handler(step, *args, **kwargs)`` (``bind=False``:
    ``handler(*args, **kwargs)``); an
    ``async def`` handler's coroutine run to its end on a loop of its own."""
    if job.direct:
        args, kwargs = arguments(event.data)
        result = job.handler(step, *args, **kwargs) if job.bind else job.handler(*args, **kwargs)
    else:
        result = job.handler(event, step)
    if inspect.iscoroutine(result):
        result = asyncio.run(result)
    return result


def _settle_success(engine: Engine, claim: records.Claim, conn: PooledConnection, encoded: str,
                    audited: Mapping[str, str]) -> Outcome:
    try:
        if not worker_sql.settle_succeeded(conn, claim, encoded, async_commit=engine.tuning.settle_async_commit,
                                           provider_key=audited.get("provider_key"),
                                           model_version=audited.get("model_version")):
            return Outcome(str(claim.run_id), _fenced_state(conn, claim))
    except psycopg.Error as refused:
        return _settle(engine, claim, conn, _refusal(claim, refused), _backoff(claim))
    return Outcome(str(claim.run_id), "succeeded")


def _settle(engine: Engine, claim: records.Claim, conn: PooledConnection, exc: BaseException, delay: float | None,
            *, defer: bool = False) -> Outcome:
    """A failed (``delay`` None, or no attempts left) or deferred attempt, settled. If
    Postgres refuses that too, the attempt fails with the database's own message."""
    try:
        return _write_settle(engine, claim, conn, exc, delay, defer)
    except psycopg.Error as refused:
        return _write_settle(engine, claim, conn, _refusal(claim, refused), _backoff(claim), False)


def _refusal(claim: records.Claim, refused: psycopg.Error) -> BaseException:
    """The database's own error for a refused settle; a lost connection is re-raised
    (the database is away: the lease and the sweeper take over)."""
    if isinstance(refused, ConnectionLost):
        raise refused
    log.error("run %s: the database refused its settle: %s", claim.run_id, describe(refused))
    return refused


def _write_settle(engine: Engine, claim: records.Claim, conn: PooledConnection, exc: BaseException,
                  delay: float | None, defer: bool) -> Outcome:
    run, error = str(claim.run_id), storable_error(exc)
    republish_after = engine.settings.republish_after
    with conn.begin():
        if defer and delay is not None:
            settled, state = worker_sql.suspend(conn, claim, outcome="deferred", delay=delay, error_json=error,
                                                republish_after=republish_after) is not None, "deferred"
        elif delay is not None and (claim.attempt < claim.max_attempts or isinstance(exc, RetryRequested)):
            settled, state = worker_sql.settle_retry(conn, claim, error, delay), "retrying"
        else:
            dlq_id = worker_sql.settle_failed(conn, claim, error)
            settled, state = dlq_id is not None, "failed"
    if not settled:
        return Outcome(run, _fenced_state(conn, claim))
    if state == "failed":
        log.error("run %s of %s failed for good after %d attempt(s): %s; DLQ entry %s",
                  run, claim.job_id, claim.attempt, describe(exc), dlq_id)
        return Outcome(run, "failed", str(dlq_id), error=exc)
    log.info("run %s attempt %d %s (%s) for %.1fs", run, claim.attempt, state, type(exc).__name__, delay)
    # A short delay rides on a Celery countdown; a long one is published by the
    # sweeper once due (a long countdown is what Redis's visibility timeout
    # redelivers in a loop). The claim refuses a message that arrives early.
    if delay is not None and delay <= republish_after:
        own = exc.publish if isinstance(exc, RetryRequested) else None
        publish_or_log(own or engine.publish, claim.run_id, claim.job_id, delay)
    return Outcome(run, state, f"in {delay:.1f}s", error=exc)


def _backoff(claim: records.Claim) -> float:
    job = find_job(claim.job_id)
    return job.retry_policy.delay(claim.attempt) if job is not None else 0.0


def _fenced_state(conn: PooledConnection, claim: records.Claim) -> str:
    with conn.begin():
        return "cancelled" if worker_sql.why_fenced(conn, claim) == "cancelled" else "lost"
