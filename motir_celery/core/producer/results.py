"""The result handle of a run: ``.id``, ``.state``, ``.ready()``, ``.get(timeout=)``, read from Postgres.

What ``job.delay()`` / ``job.apply_async()`` return, and what ``SendResult.results``
holds for each run an event created. No Celery result backend is involved: the
run's row is the result (``job_queue.result``, written by the settle that
ended it), and its attempt ledger says why it failed.

``state`` in Celery's words, from ``job_queue.state`` and the latest attempt:

==========  ==================================================================
PENDING     queued and not yet tried, or waiting (countdown/eta not due,
            step.sleep, wait_for_event, a RateLimited deferral); also a run id
            this database does not know (as Celery says of an unknown task id)
STARTED     running: a worker holds it
(custom)    running, with a progress report of the running attempt (``step.progress``, a
            durable Celery task's ``update_state(state="PROGRESS", meta=...)``): its state, and
            its meta as ``.info`` / ``.result``
RETRY       queued again after a failed attempt (it raised, or lost its lease)
SUCCESS     succeeded; ``get()`` returns what the handler returned
FAILURE     failed for good (DLQ entry written); ``get()`` raises ``JobFailed``
REVOKED     cancelled (``cancel_run``, ``cancel_on``); ``get()`` raises ``JobRevoked``
==========  ==================================================================

A handle belongs to a workspace — the one its run was made in (``workspace_id=`` of
the call, or the payload's) — and reads only there: a tenant's handle reads under the
app role with row-level security in that workspace, a system handle (no workspace)
through the engine login, and the statement itself names the workspace too. A run
id of another workspace is not found: ``PENDING``, as Celery says of an unknown id,
never its result or its error.

The handle is usable where Celery's ``AsyncResult`` is: ``.id`` (the run id; the Celery
task id when the call gave a UUID ``task_id=``), ``.state`` / ``.status``, ``.ready()``,
``.successful()``, ``.failed()``, ``.get(timeout=, propagate=)``, ``.result`` / ``.info``,
``.traceback``, ``.date_done``, ``.forget()`` (a no-op: the run's row is the record, and
``motir purge`` its retention). ``app.AsyncResult(id)`` reads the same row through the
Celery result backend of ``adapter/backend.py``.

A handle of a run written in a transaction that has not committed yet (``session=``,
Django's ``atomic()``) knows it: ``get()`` there raises ``RunNotCommitted`` at once —
no worker can see the run before the commit, so waiting could only time out.

``get`` polls: one indexed read (``producer_sql.RUN_RESULT``), then sleeps 20 ms,
×1.5 per poll, at most 500 ms between two — a run done in 50 ms is seen ~25 ms
later, a wait of a minute costs ~130 reads. Not LISTEN/NOTIFY, which needs
a trigger or a NOTIFY in every settle (a schema change and one more thing on the
run path) and a session-holding connection, which a transaction pooler
(PgBouncer) does not give; a poller works through one.
"""

from __future__ import annotations

import asyncio
import builtins
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from motir_celery.core.current import current
from motir_celery.core.producer.streams import Progress, RunNotFound, StreamReader, read_progress
from motir_celery.errors import MotirError
from motir_celery.store.db import validate_workspace_id
from motir_celery.store.driver import first
from motir_celery.store.sql import producer as producer_sql

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine

__all__ = ["RunHandle", "read_result", "JobFailed", "JobRevoked", "ResultTimeout", "RunNotCommitted", "READY_STATES", "celery_state",
           "CommitGate", "reported"]

READY_STATES = frozenset({"SUCCESS", "FAILURE", "REVOKED"})

#: get()'s polling: the first pause, its growth per poll, its ceiling (seconds).
FIRST_POLL, POLL_GROWTH, MAX_POLL = 0.02, 1.5, 0.5


class ResultTimeout(MotirError, TimeoutError):
    """``get(timeout=)`` ran out before the run finished (Celery raises its own TimeoutError)."""


class RunNotCommitted(MotirError):
    """``get()`` of a run whose transaction has not committed (yet): it would wait for ever."""


#: Set once the transaction that wrote a run has committed (a handle made outside one has none).
CommitGate = threading.Event


class JobFailed(MotirError):
    """The run failed for good; carries the stored error of its last attempt.

    When that error was a built-in exception (``ValueError``, ``KeyError``...),
    the raised object is also an instance of it, so ``except ValueError`` works
    as it does around Celery's ``AsyncResult.get``."""

    def __init__(self, run_id: uuid.UUID | None, error: dict[str, Any] | None) -> None:
        error = error or {}
        self.run_id = run_id
        #: ``module.QualName`` of the exception the handler raised, e.g. ``builtins.ValueError``.
        self.type: str = str(error.get("type") or "unknown")
        self.message: str = str(error.get("message") or "")
        self.remote_traceback: str = str(error.get("traceback") or "")
        super().__init__(f"{self.type.removeprefix('builtins.')}: {self.message} (run {run_id})")


class JobRevoked(MotirError):
    """The run was cancelled before it finished."""


def reported(row: dict[str, Any]) -> tuple[str, Any] | None:
    """The progress a run's row (``RUN_RESULT``) shows now: (state, meta) reported by the attempt
    that is running (``step.progress``, ``update_state``); None when there is none."""
    state = row.get("progress_state")
    if state is None or row["state"] != "running" or row.get("progress_attempt") != row["attempts"]:
        return None
    return state, row.get("progress_meta")


def celery_state(state: str | None, last_outcome: str | None) -> str:
    """``job_queue.state`` (and the latest attempt's outcome) in Celery's names; table above."""
    if state == "queued":
        return "RETRY" if last_outcome in ("retrying", "lost") else "PENDING"
    return {"running": "STARTED", "succeeded": "SUCCESS", "failed": "FAILURE",
            "cancelled": "REVOKED"}.get(state or "", "PENDING")


@dataclass(frozen=True)
class _Snapshot:
    state: str
    result: Any
    error: dict[str, Any] | None
    finished_at: datetime | None = None
    #: A running run's reported meta (its state is the reported one).
    progress: Any = None


def _failure(run_id: uuid.UUID | None, error: dict[str, Any] | None) -> JobFailed:
    name = str((error or {}).get("type") or "")
    builtin = getattr(builtins, name.removeprefix("builtins."), None) if name.startswith("builtins.") else None
    if isinstance(builtin, type) and issubclass(builtin, Exception) and builtin is not Exception:
        try:
            cls = type(f"JobFailed[{builtin.__name__}]", (JobFailed, builtin), {})
            return cls(run_id, error)  # type: ignore[no-any-return]
        except TypeError:  # a base whose instance layout cannot be combined
            pass
    return JobFailed(run_id, error)


def read_result(engine: Engine, run_id: uuid.UUID, workspace_id: str | None) -> dict[str, Any] | None:
    """A run's state, result and latest error, read in ``workspace_id`` only: a tenant's under the
    app role with row-level security there, a system run (None) through the engine login; the
    statement names the workspace too. None: no such run in that workspace (another's is not found)."""
    params = {"run_id": run_id, "workspace_id": workspace_id}
    # While a framework lends its connection (a Django TestCase's transaction), the run may exist
    # on that connection only: it is read there, through the engine login; the statement still
    # names the workspace, so another workspace's run is not found.
    if workspace_id is not None and engine.lent() is None:
        with engine.session(workspace_id) as session:
            return first(session.connection(), producer_sql.RUN_RESULT, params)
    with engine.pool().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        return first(conn, producer_sql.RUN_RESULT, params)


class RunHandle:
    """A run, Celery-``AsyncResult``-shaped. ``id`` is the run id (``motir runs show <id>``)."""

    def __init__(self, run_id: uuid.UUID | None, job_id: str, *, deduplicated: bool = False,
                 workspace_id: str | None = None, engine: Engine | None = None,
                 committed: CommitGate | None = None) -> None:
        self.id = run_id
        self.job_id = job_id
        #: The workspace this handle reads in (None: system runs only).
        self.workspace_id = validate_workspace_id(workspace_id)
        #: True when this call created nothing: its idempotency key (or task_id) was used
        #: already, or a singleton run was active; ``id`` is that existing run.
        self.deduplicated = deduplicated
        #: The engine it reads through (None: the current one, when it reads).
        self.engine = engine
        #: Set when the transaction that wrote the run commits; None: committed when made.
        self._committed = committed

    def __repr__(self) -> str:
        flag = " deduplicated" if self.deduplicated else ""
        return f"<RunHandle {self.job_id} {self.id}{flag}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunHandle) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    @property
    def task_id(self) -> str:
        return str(self.id)

    def _read(self) -> _Snapshot:
        if self.id is None:  # a refused call whose existing run row-level security hides
            return _Snapshot("PENDING", None, None)
        row = read_result(self.engine or current(), self.id, self.workspace_id)
        if row is None:
            return _Snapshot("PENDING", None, None)
        shown = reported(row)
        if shown is not None:  # running, with a report of its own: its state, its meta as info
            return _Snapshot(shown[0], None, None, progress=shown[1])
        return _Snapshot(celery_state(row["state"], row["last_outcome"]), row["result"], row["last_error"],
                         row["finished_at"])

    def _check_committed(self) -> None:
        if self._committed is not None and not self._committed.is_set():
            raise RunNotCommitted(
                f"run {self.id} of {self.job_id} was written in a transaction that has not committed (yet): "
                "no worker can see it before the commit, so get() would only wait out its timeout. Call get() "
                "after the transaction commits (after the `with transaction.atomic():` block, or "
                "session.commit()); a rolled-back run never existed.")

    @property
    def state(self) -> str:
        return self._read().state

    status = state

    def ready(self) -> bool:
        return self.state in READY_STATES

    def successful(self) -> bool:
        return self.state == "SUCCESS"

    def failed(self) -> bool:
        return self.state == "FAILURE"

    def _outcome(self, snap: _Snapshot, propagate: bool) -> Any:
        if snap.state == "SUCCESS" or not propagate:
            return snap.result if snap.state == "SUCCESS" else snap.error
        if snap.state == "REVOKED":
            raise JobRevoked(f"run {self.id} of {self.job_id} was cancelled")
        raise _failure(self.id, snap.error)

    def get(self, timeout: float | None = None, *, propagate: bool = True) -> Any:
        """Wait for the run to finish; its result, or its final error raised (``JobFailed``).

        ``timeout`` in seconds (None: wait as long as it takes) → ``ResultTimeout``.
        ``propagate=False`` returns the stored error dict instead of raising. Inside the
        uncommitted transaction that wrote the run: ``RunNotCommitted``, at once."""
        self._check_committed()
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = FIRST_POLL
        while True:
            snap = self._read()
            if snap.state in READY_STATES:
                return self._outcome(snap, propagate)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ResultTimeout(f"run {self.id} of {self.job_id} not finished after {timeout}s "
                                    f"(state {snap.state})")
            time.sleep(pause if left is None else min(pause, left))
            pause = min(pause * POLL_GROWTH, MAX_POLL)

    async def get_async(self, timeout: float | None = None, *, propagate: bool = True) -> Any:
        """``get`` for asyncio code: each read runs in a thread, the pauses are
        ``asyncio.sleep``: the event loop is never blocked."""
        self._check_committed()
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = FIRST_POLL
        while True:
            snap = await asyncio.to_thread(self._read)
            if snap.state in READY_STATES:
                return self._outcome(snap, propagate)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ResultTimeout(f"run {self.id} of {self.job_id} not finished after {timeout}s "
                                    f"(state {snap.state})")
            await asyncio.sleep(pause if left is None else min(pause, left))
            pause = min(pause * POLL_GROWTH, MAX_POLL)

    @property
    def result(self) -> Any:
        """The result if it succeeded, the stored error dict if it failed; while it runs, the meta of
        its latest progress report (as Celery's ``AsyncResult.info`` in a custom state); else None."""
        snap = self._read()
        return self._outcome(snap, propagate=False) if snap.state in READY_STATES else snap.progress

    @property
    def progress(self) -> Progress | None:
        """The run's latest progress report and its streams' names and totals (None: no such run in
        this handle's workspace). ``.current``: reported by the attempt that runs now."""
        if self.id is None:
            return None
        return read_progress(self.engine or current(), self.id, self.workspace_id)

    def stream(self, name: str) -> StreamReader:
        """The run's stream ``name``, to read or follow (``for item in handle.stream("tokens")``)."""
        if self.id is None:
            raise RunNotFound(f"{self!r} names no run this workspace can read")
        return StreamReader(self.engine or current(), self.id, name, workspace_id=self.workspace_id)

    info = result

    @property
    def traceback(self) -> str | None:
        """The traceback of a failed run's last attempt (the worker's text), else None."""
        snap = self._read()
        return str((snap.error or {}).get("traceback") or "") or None if snap.state == "FAILURE" else None

    @property
    def date_done(self) -> datetime | None:
        """When the run finished (the database's clock), else None."""
        snap = self._read()
        return snap.finished_at if snap.state in READY_STATES else None

    def forget(self) -> None:
        """Celery frees a result backend's entry; here a no-op: the run's row is the record
        (``motir purge`` removes finished runs after their retention)."""
