"""Execute one run: claim, call the handler with its memoized steps, settle.

This is what a Celery task calls with the run id from its message, and it is
the only place an attempt starts or ends. No Celery import here: publishing a
retry is a callable handed in by the adapter.

Failure handling, in order of precedence:

* ``LostClaim`` / ``RunCancelled`` — the database refused a fenced write; this
  worker no longer owns the run and writes nothing more.
* ``NonRetriableError``, ``StepOutputError`` (a non-JSON step result will not
  become JSON on retry) and an unknown job → failed + DLQ now.
* ``RetryAfterError(delay)`` → queued again at ``now() + delay``.
* anything else → queued again after the retry policy's backoff, or failed +
  DLQ when the attempts recorded on the run are spent.

If the database goes away mid-run the settle cannot be written either; the
run stays ``running`` until its lease expires, and the sweeper requeues it
with the attempt already charged. Nothing is lost, and no step is redone.
"""

from __future__ import annotations

import json
import logging
import threading
import traceback
import uuid
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable

from sqlalchemy import Connection

from . import queue
from .db import get_engine
from .errors import LostClaim, NonRetriableError, RetryAfterError, RunCancelled, StepOutputError, UnknownJobError
from .jobs import get_job
from .settings import Settings, get_settings
from .steps import Step, encode_json

__all__ = ["Event", "Outcome", "execute", "Publish"]

log = logging.getLogger("motir_celery.runner")

#: publish(run_id, job_id, countdown_seconds) — hands a run to the broker.
Publish = Callable[[uuid.UUID, str, float], None]


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
    state: str  # succeeded | retrying | failed | cancelled | lost | skipped
    detail: str = ""


def execute(
    run_id: uuid.UUID | str,
    *,
    job_id: str,
    worker: str,
    publish: Publish | None = None,
    settings: Settings | None = None,
) -> Outcome:
    settings = settings or get_settings()
    engine = get_engine(settings=settings)
    run_uuid = _as_uuid(run_id)
    if run_uuid is None:
        log.warning("dropping message with a malformed run id %r for job %s", run_id, job_id)
        return Outcome(str(run_id), "skipped", "malformed run id")

    # One pooled connection for the whole attempt: claim, step writes and settle
    # are one statement and one commit each, with no checkout (or pre-ping) between.
    with engine.connect() as conn:
        with conn.begin():
            claim = queue.claim(conn, run_uuid, job_id=job_id, worker=worker, lease_seconds=settings.lease_seconds)
        if claim is None:
            # Duplicate or stale delivery, a run not due yet, or a forged id: ack and do nothing.
            log.debug("run %s of %s not claimable (duplicate, stale, not due or unknown)", run_uuid, job_id)
            return Outcome(str(run_uuid), "skipped", "not claimable")
        # The heartbeat renews from its own connection, beside the handler's.
        with _Heartbeat(claim, engine.begin, settings.lease_seconds):
            return _attempt(claim, conn, publish, settings)


def _attempt(claim: queue.Claim, conn: Connection, publish: Publish | None, settings: Settings) -> Outcome:
    run = str(claim.run_id)
    step = Step(claim, conn, max_bytes=settings.max_payload_bytes)
    try:
        job = get_job(claim.job_id)
        event = Event(
            name=claim.event_name,
            data=claim.event_data if claim.event_id else {"scheduled_for": _iso(claim.scheduled_for)},
            id=str(claim.event_id) if claim.event_id else None,
            workspace_id=claim.workspace_id,
            run_id=run,
            attempt=claim.attempt,
            scheduled_for=claim.scheduled_for,
        )
        result = job.handler(event, step)
        encoded = encode_json(result, what=f"the handler of {claim.job_id!r} returned a value that",
                              limit=settings.max_payload_bytes)
    except RunCancelled:
        log.info("run %s cancelled; stopped at a step boundary", run)
        return Outcome(run, "cancelled")
    except LostClaim as exc:
        log.warning("%s", exc)
        return Outcome(run, "lost", str(exc))
    except (NonRetriableError, StepOutputError, UnknownJobError) as exc:
        return _fail(claim, conn, exc)
    except RetryAfterError as exc:
        return _retry_or_fail(claim, conn, publish, exc, exc.delay, settings)
    except Exception as exc:  # noqa: BLE001 — any handler error is a failed attempt
        try:
            delay = get_job(claim.job_id).retry_policy.delay(claim.attempt)
        except UnknownJobError:
            delay = 0.0
        return _retry_or_fail(claim, conn, publish, exc, delay, settings)

    with conn.begin():
        if not queue.settle_succeeded(conn, claim, encoded):
            return Outcome(run, _fenced_state(conn, claim))
    return Outcome(run, "succeeded")


def _retry_or_fail(claim: queue.Claim, conn: Connection, publish: Publish | None,
                   exc: BaseException, delay: float, settings: Settings) -> Outcome:
    if claim.attempt >= claim.max_attempts:
        return _fail(claim, conn, exc)
    with conn.begin():
        if not queue.settle_retry(conn, claim, _error(exc), delay):
            return Outcome(str(claim.run_id), _fenced_state(conn, claim))
    log.info("run %s attempt %d failed (%s); retry in %.1fs", claim.run_id, claim.attempt, type(exc).__name__, delay)
    # A short backoff rides on a Celery countdown; a long one is published by the
    # sweeper once due (a long countdown is what Redis's visibility timeout
    # redelivers in a loop). The claim refuses a message that arrives early.
    if publish is not None and delay <= settings.republish_after:
        publish(claim.run_id, claim.job_id, delay)
    return Outcome(str(claim.run_id), "retrying", f"in {delay:.1f}s")


def _fail(claim: queue.Claim, conn: Connection, exc: BaseException) -> Outcome:
    with conn.begin():
        dlq_id = queue.settle_failed(conn, claim, _error(exc))
        if dlq_id is None:
            return Outcome(str(claim.run_id), _fenced_state(conn, claim))
    log.error("run %s of %s failed for good after %d attempt(s): %s; DLQ entry %s",
              claim.run_id, claim.job_id, claim.attempt, exc, dlq_id)
    return Outcome(str(claim.run_id), "failed", str(dlq_id))


def _fenced_state(conn: Connection, claim: queue.Claim) -> str:
    return "cancelled" if queue.why_fenced(conn, claim) == "cancelled" else "lost"


def _error(exc: BaseException) -> str:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return json.dumps(
        {
            "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "message": str(exc)[:2000],
            "traceback": tb[-8000:],
        }
    )


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def _as_uuid(value: uuid.UUID | str) -> uuid.UUID | None:
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None


class _Heartbeat:
    """Renews the lease (fenced) every third of its length while the handler runs."""

    def __init__(self, claim: queue.Claim, connect: Callable[[], AbstractContextManager[Connection]],
                 lease: float) -> None:
        self._claim, self._connect, self._lease = claim, connect, lease
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"motir-heartbeat-{claim.run_id}", daemon=True)

    def __enter__(self) -> "_Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self._lease / 3):
            try:
                with self._connect() as conn:
                    if not queue.renew_lease(conn, self._claim, self._lease):
                        log.warning("run %s: lease lost; the next step write will stop this attempt",
                                    self._claim.run_id)
                        return
            except Exception:  # noqa: BLE001 — a database blip: try again next period
                log.warning("run %s: lease renewal failed", self._claim.run_id, exc_info=True)
