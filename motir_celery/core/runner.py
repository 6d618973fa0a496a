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

import dataclasses
import json
import logging
import os
import threading
import time
import traceback
import uuid
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Iterator

from psycopg import pq
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from motir_celery.store import statements
from motir_celery.store.db import get_engine
from motir_celery.errors import (
    LostClaim,
    NonRetriableError,
    RateLimited,
    RetryAfterError,
    RunCancelled,
    StepOutputError,
    Suspended,
    UnknownJobError,
)
from motir_celery.core.jobs import get_job
from motir_celery.core.publish import Publish, publish_or_log
from motir_celery.settings import Settings, get_settings
from motir_celery.core.steps import Step, encode_json
from motir_celery.core.tracing import run_span

__all__ = ["Event", "Outcome", "execute", "Publish", "publish_or_log"]

log = logging.getLogger("motir_celery.core.runner")

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
        # Whatever a forged message carried is echoed at most 100 characters (a
        # 2 MB "run id" must not become a 2 MB log line or task result).
        shown = repr(run_id)[:100]
        log.warning("dropping message with a malformed run id %s for job %s", shown, job_id)
        return Outcome(shown, "skipped", "malformed run id")

    # One connection for the whole attempt: claim, step writes and settle are one
    # statement and one commit each, with no checkout (or ping) between.
    conn, claim = _claim(engine, run_uuid, job_id, worker, settings)
    try:
        outcome = _claimed(engine, conn, claim, run_uuid, job_id, publish, settings)
    except BaseException:
        conn.close()  # whatever state the attempt left it in, the pool resets or replaces it
        raise
    _kept.put(conn)
    return outcome


def _claimed(engine: Engine, conn: Connection, claim: statements.Claim | None, run_id: uuid.UUID, job_id: str,
             publish: Publish | None, settings: Settings) -> Outcome:
    if claim is None:
        # Duplicate or stale delivery, a run not due yet, or a forged id: ack and do nothing.
        log.debug("run %s of %s not claimable (duplicate, stale, not due or unknown)", run_id, job_id)
        return Outcome(str(run_id), "skipped", "not claimable")
    # The process's heartbeat thread renews from its own connection, beside the handler's.
    try:
        with _heartbeats.hold(claim, engine.begin, settings.lease_seconds), \
                run_span(claim.job_id, str(claim.run_id), claim.attempt, claim.traceparent):
            return _attempt(claim, conn, publish, settings)
    finally:
        if claim.concurrency_key is not None:
            _free_slot(engine, claim, publish)


class _KeptConnection(threading.local):
    """The attempt connection a worker thread keeps checked out between its runs.

    A pool checkout and checkin cost ~0.2 ms of Python at low load (measured
    cold, one run every 20 ms), on every run's way from its message to its claim.
    A thread runs one attempt at a time, so it holds one connection whether it
    keeps it or not. Kept only after an attempt that ended normally, and only
    idle (no transaction, not in pipeline mode); never across a fork or a pool
    replaced by ``engine.dispose()``. The pool's idle ping does not see a kept
    connection: a socket that died meanwhile fails the claim, which claims once
    more on a fresh connection (``_claim``).
    """

    held: tuple[int, Any, Connection] | None = None

    def take(self, engine: Engine) -> Connection:
        held, self.held = self.held, None
        if held is not None:
            pid, pool, conn = held
            if pid != os.getpid():
                # The parent's socket: neither used nor closed here, nor left to the
                # garbage collector (its check-in would roll back on that socket).
                _inherited.append(conn)
            elif pool is engine.pool and not conn.closed and not conn.invalidated:
                return conn
            else:
                conn.close()
        return engine.connect().execution_options(isolation_level="AUTOCOMMIT")

    def put(self, conn: Connection) -> None:
        if self.held is None and _idle(conn):
            self.held = (os.getpid(), conn.engine.pool, conn)
        else:
            conn.close()


def _idle(conn: Connection) -> bool:
    """Open, outside any transaction (ours or the server's), and not in pipeline mode."""
    if conn.closed or conn.invalidated or conn.in_transaction():
        return False
    pgconn = conn.connection.driver_connection.pgconn
    return pgconn.transaction_status == pq.TransactionStatus.IDLE and pgconn.pipeline_status == pq.PipelineStatus.OFF


_kept = _KeptConnection()
_inherited: list[Connection] = []


def _free_slot(engine: Engine, claim: statements.Claim, publish: Publish | None) -> None:
    """concurrency=(limit, key): this run no longer holds its slot (settled,
    suspended, cancelled or lost) — hand the slot to the next queued run of the key."""
    try:
        with engine.begin() as tx:
            next_run = statements.next_in_line(tx, claim.job_id, claim.concurrency_key or "")
    except Exception:  # noqa: BLE001 — the sweeper re-publishes waiting runs anyway
        log.warning("run %s: could not hand its concurrency slot on", claim.run_id, exc_info=True)
        return
    if next_run is not None and publish is not None:
        publish_or_log(publish, next_run, claim.job_id)


def _claim_limited(engine: Engine, run_id: uuid.UUID, job_id: str, worker: str, settings: Settings,
                   limit: int) -> statements.Claim | None:
    """Claim a run of a job with concurrency=(limit, key): count the key's running
    runs and claim in one transaction, under the key's advisory lock, so two
    workers cannot both take the last slot. A refused claim leaves the run
    queued; the run that frees a slot publishes the next in line."""
    with engine.begin() as tx:
        statements.lock_concurrency(tx, run_id)
        return statements.claim(tx, run_id, job_id=job_id, worker=worker, lease_seconds=settings.lease_seconds,
                           concurrency_limit=limit)


def _claim(engine: Engine, run_id: uuid.UUID, job_id: str, worker: str,
           settings: Settings) -> tuple[Connection, statements.Claim | None]:
    """Take the attempt's connection (the one this thread kept, else a pooled one) and claim on it.

    The connection is in autocommit for the attempt: each statement of the hot
    path is its own transaction, so it costs one round trip instead of three
    (BEGIN, statement, COMMIT) and still exactly one commit. Nothing on this
    path needs two statements in one transaction; the ``conn.begin()`` blocks
    mark the units and are no-ops at the database level.

    A socket that died under us (the database restarted while this worker was
    busy, or while its kept connection sat idle, so the idle ping in ``db.py``
    did not run) fails the claim
    with a disconnect; SQLAlchemy then invalidates the pool, and we claim once
    more on a fresh socket. Either the dead claim never reached the server, or
    it committed and its reply was lost: then the run is ``running`` under a
    token we never saw, the retry finds it unclaimable, and the sweeper
    requeues it when the lease expires, attempt charged.
    """
    limit = _concurrency_limit(job_id)
    for last in (False, True):
        conn = _kept.take(engine)
        try:
            if limit is not None:
                claim = _claim_limited(engine, run_id, job_id, worker, settings, limit)
                # Claimed on another connection: what it found prepared says nothing of `conn`.
                return conn, claim and dataclasses.replace(claim, prepared=())
            with conn.begin():
                return conn, statements.claim(conn, run_id, job_id=job_id, worker=worker,
                                         lease_seconds=settings.lease_seconds)
        except DBAPIError as exc:
            conn.close()
            if last or not exc.connection_invalidated:
                raise
            log.info("run %s: connection lost before the claim; claiming on a new one", run_id)
        except BaseException:
            conn.close()
            raise
    raise AssertionError("unreachable")


def _concurrency_limit(job_id: str) -> int | None:
    try:
        return get_job(job_id).run_options.concurrency_limit
    except UnknownJobError:
        return None  # claimed normally; the attempt then fails with the clear error


def _attempt(claim: statements.Claim, conn: Connection, publish: Publish | None, settings: Settings) -> Outcome:
    event_data = claim.event_data if claim.event_id else {"scheduled_for": _iso(claim.scheduled_for)}
    step = Step(claim, conn, max_bytes=settings.max_payload_bytes, event_data=event_data, publish=publish,
                republish_after=settings.republish_after, transaction=get_engine(settings=settings).begin,
                lease_seconds=settings.lease_seconds, async_commit=settings.async_step_commit)
    try:
        return _handle(claim, conn, step, event_data, publish, settings)
    finally:
        step.abandon()  # closes the step for the flusher; invalidates a connection left mid-pipeline


def _handle(claim: statements.Claim, conn: Connection, step: Step, event_data: Any, publish: Publish | None,
            settings: Settings) -> Outcome:
    run = str(claim.run_id)
    try:
        job = get_job(claim.job_id)
        event = Event(
            name=claim.event_name,
            data=event_data,
            id=str(claim.event_id) if claim.event_id else None,
            workspace_id=claim.workspace_id,
            run_id=run,
            attempt=claim.attempt,
            scheduled_for=claim.scheduled_for,
        )
        try:
            result = job.handler(event, step)
            encoded = encode_json(result, what=f"the handler of {claim.job_id!r} returned a value that",
                                  limit=settings.max_payload_bytes)
        except Exception:
            # A step that finished before the failure is stored before the failure's
            # settle, so the next attempt replays it. A refused store raises
            # LostClaim / RunCancelled instead, handled below like any other.
            step.flush()
            raise
    except Suspended as exc:
        # step.sleep / wait_for_event already queued the run again (no attempt charged).
        return Outcome(run, "suspended", f"until {exc.until}")
    except RateLimited as exc:
        with conn.begin():
            deferred = statements.suspend(conn, claim, outcome="deferred", delay=exc.retry_after, error_json=_error(exc),
                                     republish_after=settings.republish_after)
            if deferred is None:
                return Outcome(run, _fenced_state(conn, claim))
        if publish is not None and exc.retry_after <= settings.republish_after:
            publish_or_log(publish, claim.run_id, claim.job_id, exc.retry_after)
        return Outcome(run, "deferred", f"in {exc.retry_after:.1f}s")
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
        # Behind the step records in flight; the last step rides in its statement and commit.
        if not step.settle(encoded):
            return Outcome(run, _fenced_state(conn, claim))
    return Outcome(run, "succeeded")


def _retry_or_fail(claim: statements.Claim, conn: Connection, publish: Publish | None,
                   exc: BaseException, delay: float, settings: Settings) -> Outcome:
    if claim.attempt >= claim.max_attempts:
        return _fail(claim, conn, exc)
    with conn.begin():
        if not statements.settle_retry(conn, claim, _error(exc), delay):
            return Outcome(str(claim.run_id), _fenced_state(conn, claim))
    log.info("run %s attempt %d failed (%s); retry in %.1fs", claim.run_id, claim.attempt, type(exc).__name__, delay)
    # A short backoff rides on a Celery countdown; a long one is published by the
    # sweeper once due (a long countdown is what Redis's visibility timeout
    # redelivers in a loop). The claim refuses a message that arrives early.
    if publish is not None and delay <= settings.republish_after:
        publish_or_log(publish, claim.run_id, claim.job_id, delay)
    return Outcome(str(claim.run_id), "retrying", f"in {delay:.1f}s")


def _fail(claim: statements.Claim, conn: Connection, exc: BaseException) -> Outcome:
    with conn.begin():
        dlq_id = statements.settle_failed(conn, claim, _error(exc))
        if dlq_id is None:
            return Outcome(str(claim.run_id), _fenced_state(conn, claim))
    log.error("run %s of %s failed for good after %d attempt(s): %s; DLQ entry %s",
              claim.run_id, claim.job_id, claim.attempt, exc, dlq_id)
    return Outcome(str(claim.run_id), "failed", str(dlq_id))


def _fenced_state(conn: Connection, claim: statements.Claim) -> str:
    return "cancelled" if statements.why_fenced(conn, claim) == "cancelled" else "lost"


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


class _Heartbeats:
    """One thread per process renews the lease (fenced) of every run the process
    holds, each every third of its length while its handler runs.

    Shared rather than a thread per attempt: starting and joining a thread for
    every run was a measurable part of a short run's cost (docs/performance.md).
    The thread starts on first use in each process (a prefork child gets its own
    after the fork) and sleeps until the next renewal is due.
    """

    def __init__(self) -> None:
        self._reset()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        # After a fork the parent's thread does not exist here, and its lock may
        # have been held at the instant of the fork: start from nothing.
        self._cond = threading.Condition(threading.Lock())
        self._held: dict[uuid.UUID, _Held] = {}
        self._thread: threading.Thread | None = None
        #: When the thread's current wait ends (None: it waits for a notify).
        self._wake_at: float | None = None

    @contextmanager
    def hold(self, claim: statements.Claim, connect: Callable[[], AbstractContextManager[Connection]],
             lease: float) -> Iterator[None]:
        held = _Held(claim, connect, lease, time.monotonic() + lease / 3)
        with self._cond:
            self._held[claim.token] = held
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="motir-heartbeat", daemon=True)
                self._thread.start()
            if self._wake_at is None or held.next_at < self._wake_at:
                # Only when this renewal is due before the thread's next wake-up:
                # waking it for every run was a thread switch per run, for nothing.
                self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._held.pop(claim.token, None)

    def _loop(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [h for h in self._held.values() if h.next_at <= now]
                if not due:
                    self._wake_at = min((h.next_at for h in self._held.values()), default=None)
                    self._cond.wait(None if self._wake_at is None else self._wake_at - now)
                    self._wake_at = None  # awake: a hold() meanwhile is seen by the next pass
                    continue
                for h in due:
                    h.next_at = now + h.lease / 3
            for h in due:
                self._renew(h)

    def _renew(self, held: _Held) -> None:
        claim = held.claim
        try:
            with held.connect() as conn:
                if statements.renew_lease(conn, claim, held.lease):
                    return
        except Exception:  # noqa: BLE001 — a database blip: try again next period
            log.warning("run %s: lease renewal failed", claim.run_id, exc_info=True)
            return
        with self._cond:
            still_held = self._held.pop(claim.token, None) is not None
        if still_held:  # not merely settled between our wake-up and the renewal
            log.warning("run %s: lease lost; the next step write will stop this attempt", claim.run_id)


@dataclass
class _Held:
    claim: statements.Claim
    connect: Callable[[], AbstractContextManager[Connection]]
    lease: float
    next_at: float


_heartbeats = _Heartbeats()
