"""``step.run``: memoized side effects — the handler's second argument.

* A step whose result is stored is **never executed again** for that run.
* A step's record is **committed before ``step.run`` returns**: before the next
  body starts and before the settle; no record waits on a thread, a timer or a
  later statement. The one re-run window is between a body's end and its
  record's commit: a worker that dies there runs that step again.
* The store is fenced on the claim token: a worker that lost the run gets
  ``LostClaim`` / ``RunCancelled`` at that step boundary.
* A result must be JSON Postgres stores (``StepOutputError``); a step id is at
  most ``MAX_STEP_ID`` printable characters (``StepIdError``).

``async def`` handlers: ``await step.run(step_id, fn, ...)`` with a coroutine function ``fn``
is memoized exactly as a plain step — a stored result is returned without running ``fn``, a
new one is committed before the awaitable completes. Pass the coroutine function itself
(``step.run("x", fetch, url)``), not a lambda. In a plain handler, where no loop runs, such a
step runs with ``asyncio.run`` (the runner runs an ``async def`` handler the same way: a fresh
loop per attempt).

``Step`` is the public per-attempt object: what a handler calls (``run``, sleeps, waits,
``send_event``, ``invoke`` / ``gather``) and what the rest of the worker path builds on
(``core/worker/invoke.py``, the canvas, the test kit's faults): its claim, its stored records,
the next key of a step id, the fence check before a body, the refusal of a fenced write.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import time
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ContextManager, Mapping, NoReturn, Sequence, TypeVar

from motir_celery.core.runspec import path_of, value_at
from motir_celery.core.shapes import check_audit
from motir_celery.core.tracing import step_span
from motir_celery.core.worker import invoke
from motir_celery.core.worker.streams import DEFAULT_STATE, Output, StreamWriter, check_state, check_stream_name
from motir_celery.errors import LostClaim, RunCancelled, StepIdError, StepOutputError, Suspended, checked_delay
from motir_celery.store.records import Claim
from motir_celery.store.sql import worker as worker_sql

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine
    from motir_celery.store.driver import Conn

__all__ = ["Step", "SEPARATOR", "MAX_STEP_ID", "encode_json"]

T = TypeVar("T")

#: Joins a repeated step id and its occurrence number (``charge``, ``charge:1``...).
#: Reserved: a step id may not contain it, so ``charge:1`` cannot collide.
SEPARATOR = ":"
#: The longest step id, in characters (a btree index entry must stay well under 2.7 kB).
MAX_STEP_ID = 200

_SURROGATE = re.compile("[\ud800-\udfff]")


def _is_coroutine_function(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def encode_json(value: Any, *, what: str, limit: int) -> str:
    """``value`` as the JSON Postgres will store, or ``StepOutputError`` naming what is wrong."""
    try:
        encoded = json.dumps(value, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise StepOutputError(f"{what} is not JSON-serialisable ({type(value).__name__}): {exc}") from None
    if len(encoded) > limit:
        raise StepOutputError(f"{what} is {len(encoded)} bytes of JSON, over the {limit}-byte limit")
    if "\\u0000" in encoded:
        raise StepOutputError(f"{what} contains a NUL character, which Postgres jsonb cannot store")
    if _SURROGATE.search(encoded):
        raise StepOutputError(f"{what} contains a lone surrogate (undecodable bytes?), which is not UTF-8")
    return encoded


class Step:
    """One attempt of one run, as its worker holds it: handed to every handler as ``step``."""

    def __init__(self, engine: Engine, claim: Claim, conn: Conn, *, event_data: Any = None) -> None:
        self.engine = engine
        #: What the claim returned: the run, its token, its attempt, its stored steps.
        self.claim = claim
        self._conn = conn  # the attempt's connection, in autocommit: one statement, one commit
        self._memo: dict[str, Any] = dict(claim.steps)
        self._seen: dict[str, int] = {}
        settings = engine.settings
        self.max_bytes = settings.max_payload_bytes
        self._lease = settings.lease_seconds
        self.republish_after = settings.republish_after
        self._event_data = event_data
        # The attempt's last proof, on this process's monotonic clock, that the
        # database still gave it the run: the claim, a stored step, a renewal.
        self._confirmed = time.monotonic()
        #: Step bodies executed (not replayed) in this attempt, for tests and metrics.
        self.executed: list[str] = []
        #: The handler's segment: 0 before its first step, then one more at each step's start and
        #: end, in the order it reaches them — the same on every attempt (core/worker/streams.py).
        self.segment = 0
        self._output: Output | None = None  # made on the first progress report or stream write
        #: What ``audit`` set in this attempt, by column: written by the success settle, nothing before.
        self.audited: dict[str, str] = {}

    @property
    def run_id(self) -> str:
        return str(self.claim.run_id)

    @property
    def attempt(self) -> int:
        """This attempt's number, 1-based."""
        return self.claim.attempt

    @property
    def event_data(self) -> Any:
        """The data of the event that started the run (a direct run's: its arguments)."""
        return self._event_data

    @property
    def records(self) -> Mapping[str, Any]:
        """Every step stored for this run so far, by key (read-only)."""
        return MappingProxyType(self._memo)

    def transaction(self) -> ContextManager[Conn]:
        """A transaction on a pooled connection of its own (a wait's lock, look-back and suspension)."""
        return self.engine.pool().begin()

    def run(self, step_id: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` once for this run, or return its stored result
        (an awaitable of it when ``fn`` is a coroutine function: the module docstring)."""
        key = self.next_key(step_id)
        if _is_coroutine_function(fn):
            return self._coroutine_step(key, fn, args, kwargs)  # type: ignore[no-any-return, arg-type]
        if key in self._memo:
            self.boundary()
            return self._memo[key]  # type: ignore[no-any-return]
        self.ensure_held(key)
        with step_span(key):
            started = time.monotonic()
            try:
                value = fn(*args, **kwargs)
                encoded = self.encode(key, value)
            except BaseException:
                self.segment += 1  # the body's segment ends with it, whatever the handler does next
                raise
        stored = self.record(key, encoded, time.monotonic() - started)
        # After the record, never between the body and it (that window is the only one in which a
        # finished step runs again): a re-run's leftovers are trimmed once the step is stored.
        self.boundary()
        return stored  # type: ignore[no-any-return]

    def _coroutine_step(self, key: str, fn: Callable[..., Awaitable[Any]], args: Sequence[Any],
                        kwargs: Mapping[str, Any]) -> Any:
        """An awaitable of the step inside a running loop (an ``async def`` handler); in a plain
        handler, where no loop runs, the step's result, its coroutine run here with ``asyncio.run``."""
        body = self._awaited(key, fn, args, kwargs)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(body)
        return body

    async def _awaited(self, key: str, fn: Callable[..., Awaitable[Any]], args: Sequence[Any],
                       kwargs: Mapping[str, Any]) -> Any:
        """``run`` for an ``async def`` body: memo, fence check, body, committed record."""
        if key in self._memo:
            self.boundary()
            return self._memo[key]
        self.ensure_held(key)
        with step_span(key):
            started = time.monotonic()
            try:
                value = await fn(*args, **kwargs)
                encoded = self.encode(key, value)
            except BaseException:
                self.segment += 1
                raise
        stored = self.record(key, encoded, time.monotonic() - started)
        self.boundary()  # after the record, as in run()
        return stored

    def encode(self, key: str, value: Any) -> str:
        """``value`` as the JSON step ``key`` stores, or ``StepOutputError``."""
        return encode_json(value, what=f"step {key!r} returned a value that", limit=self.max_bytes)

    def record(self, key: str, encoded: str, elapsed: float) -> Any:
        """Commit the step's record (fenced) and memoize it; raise if the run is no longer ours."""
        sent = time.monotonic()
        if not worker_sql.store_step(self._conn, self.claim, key, encoded, elapsed):
            with self._conn.begin():
                reason = worker_sql.why_fenced(self._conn, self.claim)
                if reason == "held":
                    # Still ours, but the step was stored already (a duplicate id
                    # racing within one attempt): the stored value wins.
                    self._memo[key] = worker_sql.stored_output(self._conn, self.claim, key)
                    return self._memo[key]
            self.stop(key, reason)
        self._confirmed = sent
        self.executed.append(key)
        self._memo[key] = json.loads(encoded)
        if self.engine.faults is not None:
            self.engine.faults.after_record(self, key)
        return self._memo[key]

    def ensure_held(self, key: str) -> None:
        """Never start a body on a run this worker may have lost.

        The store after a body is fenced, the body itself is not: a worker frozen
        between two steps (SIGSTOP, a VM pause) past its lease is reclaimed,
        another worker stores the next step, and the thawed one would start that
        body again. So when more than a heartbeat period (lease / 3) has passed
        since this attempt last heard from the database, renew the lease (fenced)
        first: refused means lost or cancelled, and the body does not start.
        """
        if self.engine.faults is not None:
            self.engine.faults.before_body(self, key)
        if time.monotonic() - self._confirmed < self._lease / 3:
            return
        sent = time.monotonic()
        with self._conn.begin():
            held = worker_sql.renew_lease(self._conn, self.claim, self._lease)
            reason = "" if held else worker_sql.why_fenced(self._conn, self.claim)
        if not held:
            self.stop(key, reason, started=False)
        self._confirmed = sent

    def stop(self, key: str, reason: str, *, started: bool = True) -> NoReturn:
        """A fenced write was refused (``reason``: ``why_fenced``'s): end the attempt here."""
        what = f"stopped before storing step {key!r}" if started else f"step {key!r} not started"
        if reason == "cancelled":
            raise RunCancelled(f"run {self.run_id} was cancelled; {what}")
        raise LostClaim(f"run {self.run_id}: this worker lost its claim; {what}")

    def next_key(self, step_id: str) -> str:
        """The key of ``step_id``'s next occurrence in this attempt (``charge``, ``charge:1``...)."""
        if not isinstance(step_id, str) or not step_id:
            raise StepIdError(f"step id must be a non-empty string, got {step_id!r:.100}")
        if len(step_id) > MAX_STEP_ID:
            raise StepIdError(f"step id {step_id[:40]!r}... is {len(step_id)} characters, "
                              f"over the {MAX_STEP_ID}-character limit")
        if SEPARATOR in step_id:
            raise StepIdError(f"step id {step_id!r} contains {SEPARATOR!r}, which is reserved for repeated steps")
        if "\x00" in step_id or _SURROGATE.search(step_id) or not step_id.isprintable():
            raise StepIdError(f"step id {step_id!r} contains a NUL, a lone surrogate or an unprintable character")
        n = self._seen.get(step_id, 0)
        self._seen[step_id] = n + 1
        self.boundary()
        return step_id if n == 0 else f"{step_id}{SEPARATOR}{n}"

    # --- progress and streams (core/worker/streams.py) -------------------------------------

    def progress(self, meta: Any = None, *, state: str = DEFAULT_STATE) -> None:
        """Report how far the run has got: ``state`` (``PROGRESS`` unless named; not a final state)
        and ``meta`` (JSON), shown by ``AsyncResult(id).state`` / ``.info``, ``RunHandle.progress``, the
        dashboard and ``motir runs show`` while this attempt runs. One statement, no WAL flush
        waited for; fenced on the claim (``LostClaim`` / ``RunCancelled`` if the run is not ours)."""
        self.output().progress(meta, check_state(state))

    def audit(self, *, provider_key: str | None = None, model_version: str | None = None) -> None:
        """Record what ran the job: which downstream provider handled it and which model/version it
        ran against (an audit, not an input: "did the incident affect runs on provider X?"). Kept
        by this attempt and written by its success settle, in the same statement — no statement
        here, none at all when never called. A value given replaces this attempt's earlier one;
        ``None`` leaves it. A run that fails, or an attempt that does not succeed, writes none: call
        it on every attempt, outside ``step.run`` (a stored step's body does not run again).
        ``AuditValueError`` at the call for a value that is not 1 to ``AUDIT_MAX`` printable characters."""
        given = {"provider_key": provider_key, "model_version": model_version}
        for column, value in given.items():
            if value is not None:
                check_audit(column, value)
        self.audited.update((column, value) for column, value in given.items() if value is not None)

    def stream(self, name: str) -> StreamWriter:
        """The run's stream ``name``: ``.write(item)`` appends ``item``; readers follow it in order
        (``RunHandle.stream(name)``). Positions derive from the step and the order: a re-run
        overwrites, never appends (core/worker/streams.py)."""
        return StreamWriter(self.output(), check_stream_name(name))

    def output(self) -> Output:
        """This attempt's writer of progress and streams (made on first use)."""
        if self._output is None:
            self._output = Output(self)
        return self._output

    def boundary(self) -> None:
        """A step starts or ends: the next segment (a re-run's leftovers of the last trimmed)."""
        self.segment += 1
        if self._output is not None and self._output.rewritten:
            self._output.close()

    def finish(self) -> None:
        """The handler returned: its last segment ends (before the settle)."""
        if self._output is not None and self._output.rewritten:
            self._output.close()

    @property
    def connection(self) -> Conn:
        """The attempt's connection, in autocommit: one statement, one commit."""
        return self._conn

    def encode_value(self, value: Any, *, what: str) -> str:
        """``value`` as JSON of at most ``MOTIR_MAX_PAYLOAD_BYTES``, or ``StepOutputError`` naming ``what``."""
        return encode_json(value, what=what, limit=self.max_bytes)

    def refused(self, what: str) -> NoReturn:
        """A fenced write of ``what`` wrote nothing: end the attempt (cancelled, or lost)."""
        with self._conn.begin():
            reason = worker_sql.why_fenced(self._conn, self.claim)
        if reason == "cancelled":
            raise RunCancelled(f"run {self.run_id} was cancelled; stopped at its {what}")
        raise LostClaim(f"run {self.run_id}: this worker lost its claim; stopped at its {what}")

    # --- giving the worker back ---------------------------------------------------

    def sleep(self, step_id: str, duration: float | timedelta) -> None:
        """Sleep ``duration`` (seconds or timedelta) without holding a worker."""
        seconds = checked_delay(f"step.sleep({step_id!r:.100}) duration",
                                duration.total_seconds() if isinstance(duration, timedelta) else duration)
        self._sleep(self.next_key(step_id), seconds=seconds)

    def sleep_until(self, step_id: str, when: datetime) -> None:
        """Sleep until the aware instant ``when`` without holding a worker."""
        if not isinstance(when, datetime) or when.tzinfo is None:
            raise ValueError(f"step.sleep_until({step_id!r}): an aware datetime is needed, got {when!r}")
        self._sleep(self.next_key(step_id), until=when)

    def _sleep(self, key: str, *, seconds: float | None = None, until: datetime | None = None) -> None:
        window, now = self.window(key, seconds=seconds, until=until)
        wake = datetime.fromisoformat(window["until"])
        if wake > now:
            self._suspend(until=wake)

    def window(self, key: str, *, seconds: float | None = None,
               until: datetime | None = None) -> tuple[dict[str, str], datetime]:
        """The memoized {"since", "until"} of a sleep or wait (stored as step ``key``), and the
        database's now()."""
        if key in self._memo:
            assert self.claim.db_now is not None
            return self._memo[key], self.claim.db_now
        with self._conn.begin():
            row = worker_sql.store_clock_step(self._conn, self.claim, key, seconds=seconds, until=until)
            reason = "" if row is not None else worker_sql.why_fenced(self._conn, self.claim)
        if row is None:
            self.stop(key, reason)
        window, now = row
        self._memo[key] = window
        return window, now

    def _suspend(self, *, until: datetime, wait: tuple[str, list[str], str | None] | None = None) -> NoReturn:
        with self._conn.begin():
            run_at = worker_sql.suspend(self._conn, self.claim, outcome="suspended", until=until, wait=wait,
                                   republish_after=self.republish_after)
            reason = "" if run_at is not None else worker_sql.why_fenced(self._conn, self.claim)
        if run_at is None:
            self.stop("(suspend)", reason)
        raise Suspended(run_at)

    # --- events ------------------------------------------------------------------

    def send_event(self, step_id: str, name: str, data: Any, *, workspace_id: str | None = None) -> Any:
        """Emit one event, exactly once for this step across retries: its idempotency
        key derives from the run and the step, so a body that runs again after an
        interruption finds the event already sent."""
        key = self.next_key(step_id)
        if key in self._memo:
            return self._memo[key]
        result = self.engine.send_event(
            name, data, workspace_id=workspace_id if workspace_id is not None else self.claim.workspace_id,
            idempotency_key=f"motir.step:{self.run_id}:{key}",
        )
        encoded = json.dumps({"event_id": str(result.event_id), "deduplicated": result.deduplicated})
        return self.record(key, encoded, 0.0)

    def wait_for_event(self, step_id: str, *, event: str, match: str,
                       timeout: float | timedelta) -> dict[str, Any] | None:
        """Suspend until an event ``event`` arrives whose field ``match`` (e.g.
        ``"data.order_id"``) equals the triggering event's, or until ``timeout``
        (then ``None``). Returns {"id", "name", "data"} of the event. Only an event of
        this run's workspace matches (a system run's: a system event)."""
        key = self.next_key(step_id)
        if key in self._memo:
            return self._memo[key]  # type: ignore[no-any-return]
        seconds = checked_delay(f"step.wait_for_event({step_id!r:.100}) timeout",
                                timeout.total_seconds() if isinstance(timeout, timedelta) else timeout)
        path = path_of(match)
        value = value_at(self._event_data, path)
        window, now = self.window(f"{key}{SEPARATOR}wait", seconds=seconds)
        since, until = datetime.fromisoformat(window["since"]), datetime.fromisoformat(window["until"])
        found, run_at, reason = None, None, ""
        with self.transaction() as tx:
            # The exclusive twin of send_event's shared lock: every event committed so
            # far is visible to the look-back below, and every later send_event will
            # see this run's waiter when it wakes waiters. No event falls between.
            worker_sql.lock_wait(tx, event)
            row = worker_sql.find_event(tx, event, path, value, since, self.claim.workspace_id)
            if row is not None:
                found = {"id": str(row["id"]), "name": row["name"], "data": row["data"]}
            elif now < until:
                run_at = worker_sql.suspend(tx, self.claim, outcome="suspended", until=until,
                                       wait=(event, path, value), republish_after=self.republish_after)
                reason = "" if run_at is not None else worker_sql.why_fenced(tx, self.claim)
        if reason:
            self.stop(key, reason)
        if run_at is not None:
            raise Suspended(run_at)  # committed: the run waits in the queue, not in this process
        return self.record(key, json.dumps(found), 0.0)  # type: ignore[no-any-return]

    # --- composition: child runs awaited durably (core/invoke.py) ---------------------

    def invoke(self, step_id: str, job: Any, data: Any, *, timeout: float | timedelta | None = None,
               detach: bool = False) -> Any:
        """Start one run of ``job`` (a Job or its id) on ``data`` — once per (run, step) — and
        return its result once it settles, the worker given back meanwhile; its final
        failure is raised as ``ChildFailed``. ``detach``: not cancelled with this run."""
        return invoke.invoke(self, step_id, job, data, timeout=timeout, detach=detach)

    def gather(self, step_id: str, calls: Any, *, timeout: float | timedelta | None = None,
               return_exceptions: bool = False, detach: bool = False) -> list[Any]:
        """Start one child per ``(job, data)`` of ``calls`` at once; once every one has
        settled, their results in order (the first failure raised, unless ``return_exceptions``)."""
        return invoke.gather(self, step_id, calls, timeout=timeout, return_exceptions=return_exceptions,
                             detach=detach)
