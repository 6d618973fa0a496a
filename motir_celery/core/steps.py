"""``step.run``: memoized side effects.

The contract, plainly (docs/jobs.md says the same):

* A step whose result is stored is **never executed again** for that run —
  not on retry, not after a crash, not on a redelivered message, not on
  another worker. ``step.run`` returns the stored value instead.
* A step interrupted **before** its result was stored runs again on the next
  attempt: step bodies are at-least-once. Make them idempotent (or accept a
  rare repeat) for the window between the side effect and the store.
  With the opt-in ``MOTIR_ASYNC_STEP_COMMIT=1`` that window also covers the
  WAL flush: a crash of Postgres itself may take back the step records of the
  last fraction of a second, and those steps run again — nothing else changes.
* When the store happens. A step whose body outlasted ``MAX_LAG`` is stored
  before the next body starts, in its own flushed commit: slow bodies are where
  the side effects are, and one wait is small next to them. A faster step's
  record is held: the records of fast steps travel together, in one statement
  and one flushed commit, with the next record sent or in the run's settle (a
  success writes the result and every step not stored yet in one commit; a
  failure stores them first, so the retry replays them). A record is held for
  at most ``MAX_LAG`` after its step finished: at a step boundary past that
  it is sent, and inside a longer body the process's flusher thread
  (``flusher.py``) sends it. So a run of k fast steps is two statements, the
  claim and the settle; with slow bodies, k + 1. REJECTED: storing each step
  before ``step.run`` returns (a flush per step that nothing observes before
  the next write); holding records until the next boundary without a timer (a
  long body would keep the fast steps before it in this process's memory, where
  a crash of the worker loses them, for as long as it runs).
* Records are pipelined (``driver.Pipe``): a body does not wait for the answer
  to a record sent before it, except after a body that outlasted ``MAX_LAG``,
  and the settle is sent behind the records: a run waits for two answers,
  the claim's and the settle's, when its bodies are fast. Answers are read as
  they arrive; a body never starts while a record sent more than ``MAX_LAG``
  ago is unanswered, and a sleep, a wait, a ``step.send_event`` and a
  failure's settle wait for all of them. The window of the previous point then
  also covers the handler's own code between a step and the next one and,
  after bodies shorter than ``MAX_LAG``, about ``MAX_LAG`` of the bodies that
  follow: a crash there runs those steps again, never one whose record was
  answered. A refused record (below) stops the handler at the first step
  boundary after its answer arrives: the next one when the body in flight
  outlasted ``MAX_LAG``, otherwise within about ``MAX_LAG`` of fast bodies.
* The value a step returns is what JSON can carry; on the first execution too
  ``step.run`` returns the value as read back from JSON (a tuple comes back
  as a list both times), so a handler sees one type whichever path it took.

The store is fenced on the claim token. When it is refused, this worker no
longer holds the run (its lease was reclaimed, or the run was cancelled):
``LostClaim`` / ``RunCancelled`` stop the handler at the step boundary where
the refusal is read (the settle, refused the same way, ends the attempt as
lost or cancelled).

Besides ``run``, a step can give its worker back: ``sleep`` / ``sleep_until``
and ``wait_for_event`` memoize when they started and until when, put the run
back in the queue (no attempt charged, no process held, no long Celery
countdown) and resume it from its memoized steps when due. ``send_event``
emits exactly one event per step across retries.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime, timedelta
from contextlib import contextmanager
from typing import Any, Callable, ContextManager, Iterator, NamedTuple, TypeVar

from sqlalchemy import Connection

from motir_celery.core import flusher
from motir_celery.store import statements
from motir_celery.errors import LostClaim, RunCancelled, StepOutputError, Suspended
from motir_celery.store.statements import (Claim, Finished, Pipe, renew_lease, send_settle_succeeded, send_store_steps, stored_output,
                    why_fenced)
from motir_celery.core.runspec import path_of, value_at
from motir_celery.core.tracing import step_span

__all__ = ["Step", "SEPARATOR", "encode_json"]

T = TypeVar("T")

#: Seconds (see the module docstring): a body longer than this has its record stored
#: before the next body; a faster one's is held at most this long; and no body
#: starts while a record sent longer ago than this is unanswered. About three
#: round trips to a busy local Postgres.
MAX_LAG = 0.001

_SETTLE = object()  # the settle's tag among the records in flight

class _Held(NamedTuple):
    """A finished step whose record is not sent yet (times: time.monotonic())."""

    key: str
    encoded: str
    started: float
    finished: float


#: Joins a repeated step id and its occurrence number (``charge``, ``charge:1``...).
#: Reserved: a step id may not contain it, so ``charge:1`` cannot collide.
SEPARATOR = ":"


def encode_json(value: Any, *, what: str, limit: int) -> str:
    try:
        encoded = json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise StepOutputError(f"{what} is not JSON-serialisable ({type(value).__name__}): {exc}") from None
    if len(encoded) > limit:
        raise StepOutputError(f"{what} is {len(encoded)} bytes of JSON, over the {limit}-byte limit")
    if "\\u0000" in encoded:  # as events.py checks event data
        raise StepOutputError(f"{what} contains a NUL character, which Postgres jsonb cannot store")
    return encoded


class Step:
    """Handed to every handler as its second argument."""

    def __init__(self, claim: Claim, conn: Connection, *, max_bytes: int, event_data: Any = None,
                 publish: Callable[..., None] | None = None, republish_after: float = 60.0,
                 transaction: Callable[[], ContextManager[Connection]] | None = None,
                 lease_seconds: float | None = None, async_commit: bool = False) -> None:
        self._claim = claim
        # MOTIR_ASYNC_STEP_COMMIT (opt-in): see statements.store_steps.
        self._async_commit = async_commit
        # The attempt's connection may be in autocommit (one round trip per
        # statement); what needs several statements in one transaction (a wait's
        # lock, look-back and suspension) goes through `transaction`.
        self._conn = conn
        self._transaction = transaction or self._on_own_connection
        self._memo: dict[str, Any] = dict(claim.steps)
        # Finished steps not sent yet: see run().
        # The flusher's thread may send them too (send_held), so they and the pipe are
        # used only under _lock; an error it met is raised on the handler's thread.
        self._held: list[_Held] = []
        self._lock = threading.Lock()
        self._late_error: BaseException | None = None
        self._closed = False
        # Step records sent and not answered yet: see run().
        self._pipe = Pipe(conn, claim.prepared)
        self._seen: dict[str, int] = {}
        self._max_bytes = max_bytes
        self._event_data = event_data
        self._publish = publish
        self._republish_after = republish_after
        #: Step bodies executed (not replayed) in this attempt, for tests and metrics.
        self.executed: list[str] = []
        # The attempt's last proof, on this process's monotonic clock, that the
        # database still gave it the run: the claim, a stored step, a check. See _still_held.
        self._lease = lease_seconds
        self._confirmed = time.monotonic()

    @contextmanager
    def _on_own_connection(self) -> Iterator[Connection]:
        with self._conn.begin():
            yield self._conn

    @property
    def run_id(self) -> str:
        return str(self._claim.run_id)

    @property
    def attempt(self) -> int:
        """This attempt's number, 1-based."""
        return self._claim.attempt

    def run(self, step_id: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        key = self._key(step_id)
        if key in self._memo:
            return self._memo[key]  # type: ignore[no-any-return]
        # After a body that outlasted MAX_LAG, the records held go out and are
        # waited for: that step is stored before this body starts. After a fast
        # one they stay held (sent by the flusher, or here if it is late) and this
        # body runs while earlier records are written. Answers already in are read
        # first, and a body never starts while a record sent more than MAX_LAG ago
        # is unanswered, so a refused record (cancelled, lost claim) stops the
        # handler about as soon as a wait per record would have.
        with self._lock:
            self._raise_late_error()
            slow = bool(self._held) and self._held[-1].finished - self._held[-1].started > MAX_LAG
            if slow or (self._held and time.monotonic() - self._held[0].finished > MAX_LAG):
                self._send_held()
            self._check(block=slow or self._pipe.lagging(MAX_LAG))
        self._still_held(key)
        with step_span(key):
            started = time.monotonic()
            value = fn(*args, **kwargs)
            encoded = encode_json(value, what=f"step {key!r} returned a value that", limit=self._max_bytes)
        return self._store(key, encoded, started)

    def _finished(self, key: str, encoded: str) -> Any:
        self.executed.append(key)
        result = json.loads(encoded)
        self._memo[key] = result
        return result

    def flush(self) -> None:
        """Every finished step stored: the records held are sent, and every record
        in flight is answered (``LostClaim`` / ``RunCancelled`` if one was refused).
        Called before whatever must come after the records (a sleep, a wait, a
        ``step.send_event``, any other statement on this connection); the runner
        calls it before a failure's settle and sends a success's settle behind
        the records instead (``settle``)."""
        with self._lock:
            self._raise_late_error()
            self._send_held()
            self._check(block=True)

    def send_held(self) -> None:
        """The flusher's thread, MAX_LAG after the oldest held step finished: send
        the held records if the handler has not (it is inside a longer body)."""
        if self._closed or not self._held:
            return  # the usual case, read without the lock: the handler sent them itself
        with self._lock:
            if self._closed or not self._held or time.monotonic() - self._held[0].finished < MAX_LAG:
                return  # sent meanwhile; records held since are armed on their own
            try:
                self._send_held()
            except BaseException as exc:  # noqa: BLE001 — raised on the handler's thread
                self._late_error = exc

    def _raise_late_error(self) -> None:
        error, self._late_error = self._late_error, None
        if error is not None:
            raise error

    def _take_held(self) -> list[Finished]:
        """The finished steps not sent yet, as (key, JSON, seconds since its body began)."""
        now = time.monotonic()
        held, self._held = self._held, []
        return [(h.key, h.encoded, now - h.started) for h in held]

    def _send_held(self) -> None:
        held = self._take_held()
        if held:
            send_store_steps(self._pipe, self._claim, held, tuple(key for key, _, _ in held),
                             async_commit=self._async_commit)

    def _check(self, *, block: bool) -> None:
        """Read the answers to the records in flight that are in (all of them with
        ``block``); a refused record drains the rest and stops the handler."""
        if self._pipe.idle:
            return
        refused = None
        for keys, sent, row in self._pipe.answers(block=block):
            if row is not None and int(row[0]) == len(keys):
                self._confirmed = sent
            elif refused is None:
                refused = keys
        if refused is None:
            return
        self._pipe.answers(block=True)
        with self._conn.begin():
            reason = why_fenced(self._conn, self._claim)
            if reason == "held":
                # Still ours, but a step was already stored (a duplicate id racing
                # within one attempt): the stored values win from now on.
                for key in refused:
                    self._memo[key] = stored_output(self._conn, self._claim, key)
                return
        self._refused(refused[0], reason)

    def settle(self, result_json: str) -> bool:
        """The run succeeded: settle it behind the records in flight, with the steps
        held in the settle's own statement and commit. False when the database
        refused it (the run was cancelled or reclaimed)."""
        with self._lock:
            self._raise_late_error()
            send_settle_succeeded(self._pipe, self._claim, result_json, self._take_held(), _SETTLE)
            settled = False
            for tag, _, row in self._pipe.answers(block=True):
                if tag is _SETTLE:
                    settled = row is not None
            return settled

    def abandon(self) -> None:
        """The attempt has ended: the flusher sends nothing more for it, and a
        connection left with records in flight (an exception escaped the runner)
        is invalidated rather than returned to the pool."""
        with self._lock:
            self._closed = True
            self._held.clear()
            self._pipe.abandon()

    def _store(self, key: str, encoded: str, started: float) -> Any:
        """A finished step (its body began at ``started``, monotonic), held: see the
        module docstring for when its record is sent."""
        finished = time.monotonic()
        with self._lock:
            self._held.append(_Held(key, encoded, started, finished))
            first = len(self._held) == 1
        if first:
            flusher.arm(self, finished + MAX_LAG)
        return self._finished(key, encoded)

    def _still_held(self, key: str) -> None:
        """Never start a body on a run this worker may have lost.

        The store after a body is fenced, but the body itself is not: a worker
        frozen between two steps (SIGSTOP, a VM pause, a long GC) past its lease
        is reclaimed, another worker runs and stores the next step, and the thawed
        one would start that step's body again before its store is refused
        (tests/chaos, scenario 1 with frozen workers, found this). So when more
        than a heartbeat period (lease / 3) has passed since this attempt last
        heard from the database — never between two steps of a normal handler,
        whose heartbeat renews meanwhile — renew the lease, fenced, before the
        body: refused means lost (or cancelled), and the body does not start.
        A pause in the microseconds between this check and the body remains
        possible; bodies stay at-least-once (docs/jobs.md).
        """
        if self._lease is None or time.monotonic() - self._confirmed < self._lease / 3:
            return
        self.flush()  # the connection is needed for the renewal
        sent = time.monotonic()
        with self._conn.begin():
            held = renew_lease(self._conn, self._claim, self._lease)
            reason = "" if held else why_fenced(self._conn, self._claim)
        if not held:
            if reason == "cancelled":
                raise RunCancelled(f"run {self.run_id} was cancelled; step {key!r} not started")
            raise LostClaim(f"run {self.run_id}: this worker lost its claim; step {key!r} not started")
        self._confirmed = sent

    def _refused(self, key: str, reason: str) -> None:
        if reason == "cancelled":
            raise RunCancelled(f"run {self.run_id} was cancelled; stopped before storing step {key!r}")
        raise LostClaim(f"run {self.run_id}: this worker lost its claim; step {key!r} not stored")

    # --- giving the worker back ---------------------------------------------------

    def sleep(self, step_id: str, duration: float | timedelta) -> None:
        """Sleep ``duration`` (seconds or timedelta) without holding a worker."""
        seconds = duration.total_seconds() if isinstance(duration, timedelta) else float(duration)
        if seconds < 0:
            raise ValueError(f"step.sleep({step_id!r}): duration must be >= 0, got {duration!r}")
        self._sleep(self._key(step_id), seconds=seconds)

    def sleep_until(self, step_id: str, when: datetime) -> None:
        """Sleep until the aware instant ``when`` without holding a worker."""
        if not isinstance(when, datetime) or when.tzinfo is None:
            raise ValueError(f"step.sleep_until({step_id!r}): an aware datetime is needed, got {when!r}")
        self._sleep(self._key(step_id), until=when)

    def _sleep(self, key: str, *, seconds: float | None = None, until: datetime | None = None) -> None:
        window, now = self._clock(key, seconds=seconds, until=until)
        wake = datetime.fromisoformat(window["until"])
        if wake > now:
            self._suspend(until=wake)

    def _clock(self, key: str, *, seconds: float | None = None,
               until: datetime | None = None) -> tuple[dict[str, str], datetime]:
        """The memoized {"since", "until"} of a sleep or wait, and the database's now()."""
        if key in self._memo:
            assert self._claim.db_now is not None
            return self._memo[key], self._claim.db_now
        self.flush()
        with self._conn.begin():
            row = statements.store_clock_step(self._conn, self._claim, key, seconds=seconds, until=until)
            reason = "" if row is not None else why_fenced(self._conn, self._claim)
        if row is None:
            self._refused(key, reason)
        window, now = row  # type: ignore[misc]
        self._memo[key] = window
        return window, now

    def _suspend(self, *, until: datetime, wait: tuple[str, list[str], str | None] | None = None) -> None:
        self.flush()
        with self._conn.begin():
            run_at = statements.suspend(self._conn, self._claim, outcome="suspended", until=until, wait=wait,
                                   republish_after=self._republish_after)
            reason = "" if run_at is not None else why_fenced(self._conn, self._claim)
        if run_at is None:
            self._refused("(suspend)", reason)
        raise Suspended(run_at)

    # --- events ------------------------------------------------------------------

    def send_event(self, step_id: str, name: str, data: Any, *, workspace_id: str | None = None) -> Any:
        """Emit one event, exactly once for this step across retries: its idempotency
        key derives from the run and the step, so a body that runs again after an
        interruption finds the event already sent."""
        from motir_celery.core import events  # events imports the runner layer; import when used

        key = self._key(step_id)
        if key in self._memo:
            return self._memo[key]
        self.flush()
        result = events.send_event(
            name, data, workspace_id=workspace_id if workspace_id is not None else self._claim.workspace_id,
            idempotency_key=f"motir.step:{self.run_id}:{key}", publish=self._publish,
        )
        encoded = json.dumps({"event_id": str(result.event_id), "deduplicated": result.deduplicated})
        return self._store(key, encoded, time.monotonic())

    def wait_for_event(self, step_id: str, *, event: str, match: str,
                       timeout: float | timedelta) -> dict[str, Any] | None:
        """Suspend until an event ``event`` arrives whose field ``match`` (e.g.
        ``"data.order_id"``) equals the triggering event's, or until ``timeout``
        (then ``None``). Returns {"id", "name", "data"} of the event."""
        key = self._key(step_id)
        if key in self._memo:
            return self._memo[key]  # type: ignore[no-any-return]
        self.flush()
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        path = path_of(match)
        value = value_at(self._event_data, path)
        window, now = self._clock(f"{key}{SEPARATOR}wait", seconds=seconds)
        since, until = datetime.fromisoformat(window["since"]), datetime.fromisoformat(window["until"])
        found, run_at, reason = None, None, ""
        with self._transaction() as tx:
            # The exclusive twin of send_event's shared lock: every event committed so
            # far is visible to the look-back below, and every later send_event will
            # see this run's waiter when it wakes waiters. No event falls between.
            statements.lock_wait(tx, event)
            row = statements.find_event(tx, event, path, value, since)
            if row is not None:
                found = {"id": str(row.id), "name": row.name, "data": row.data}
            elif now < until:
                run_at = statements.suspend(tx, self._claim, outcome="suspended", until=until,
                                       wait=(event, path, value), republish_after=self._republish_after)
                reason = "" if run_at is not None else why_fenced(tx, self._claim)
        if reason:
            self._refused(key, reason)
        if run_at is not None:
            raise Suspended(run_at)  # committed: the run waits in the queue, not in this process
        return self._store(key, json.dumps(found), time.monotonic())  # type: ignore[no-any-return]

    def _key(self, step_id: str) -> str:
        if not isinstance(step_id, str) or not step_id:
            raise ValueError(f"step id must be a non-empty string, got {step_id!r}")
        if SEPARATOR in step_id:
            raise ValueError(
                f"step id {step_id!r} contains {SEPARATOR!r}, which is reserved for repeated steps"
            )
        n = self._seen.get(step_id, 0)
        self._seen[step_id] = n + 1
        return step_id if n == 0 else f"{step_id}{SEPARATOR}{n}"
