"""A Celery result backend that reads the runs table: ``AsyncResult(<run id>)`` answers from Postgres.

A durable run's state, result and error live in its row (``job_queue``, its attempt
ledger, its DLQ entry); this backend reads them there (``adapter_sql.RUN_META``, one
read by primary key through the engine's login), so ``app.AsyncResult(id)``,
``celery.result.AsyncResult(id, app=app)``, Flower's task result and any code that
kept task ids answer for a run with no second store to keep in step. A run's id is
the Celery task id of its messages, and the task id a call gave when it was a UUID
(``apply_async(task_id=...)``, an adopted message's id).

* ``result_backend = "motir_celery.adapter.backend:MotirBackend"`` points an app at it.
* ``attach(app)`` installs it (``app.backend_cls``) unless the app chose a backend
  class itself: an app with no result backend gets ``MotirBackend``; an app with its
  own (``redis://…``, ``db+…``) keeps it, wrapped by ``RunsFirst``: a task id that is
  a run's is answered from the runs table, any other from the app's backend as
  before, which still stores the results of the app's other tasks.
* What a worker would store for a durable task (started, retry) is not stored: the run's
  row already says it. Its **final** state (success, failure) is also written to the app's
  own backend while it has one, so a process of the code before the switch, with no motir
  in it, reads the run's result with ``AsyncResult(id).get()`` (``RunsFirst.copy_final``;
  ``motir_copy_results = False`` in the app's configuration turns it off once no such
  process is left). ``forget`` of a run does nothing (``motir
  purge`` keeps the retention). Any other task on ``MotirBackend`` alone is as on
  Celery's disabled backend: nothing stored, ``PENDING``.

States are Celery's, from ``results.celery_state``: PENDING, STARTED, RETRY, SUCCESS,
FAILURE (the result is the last attempt's exception, rebuilt as Celery rebuilds one;
the traceback its text), REVOKED — and, while the running attempt has reported progress
(``step.progress``, a durable task's ``self.update_state``), that report's state
(``PROGRESS``...) with its meta as the result. That report is read from Postgres even where
``RunsFirst`` otherwise prefers the app's own backend: it is stored there, fenced by the
claim, and the app's backend holds no progress of a durable task (tasks.py), at most the
``STARTED`` of ``task_track_started``. A run is read in the caller's workspace only, as a
result handle reads (``results.read_result``): inside ``motir_celery.in_workspace(ws)`` (or
a Django request under ``WorkspaceMiddleware``) that workspace's runs under the app role's
row-level security, outside one system runs only; another workspace's run is not found
(PENDING), never its result or error -- a task id can be guessed (a uuid5 of an order
number) or be another tenant's. ``MOTIR_RESULTS_ANY_WORKSPACE=1`` answers for any run
through the engine login: for an operator's process (Flower) only.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from functools import partial
from typing import Any, Callable

from celery import states
from celery.app.backends import by_url
from celery.backends.base import BaseBackend
from celery.backends.rpc import RPCBackend
from celery.exceptions import TimeoutError as CeleryTimeout

from motir_celery.adapter.messages import engine_of
from motir_celery.adapter.tasks import REPLACED, run_id_of, tagged
from motir_celery.core.engine import Engine
from motir_celery.core.jobs import find_job, job_for_task
from motir_celery.core.producer.results import FIRST_POLL, MAX_POLL, POLL_GROWTH, celery_state, read_result, reported
from motir_celery.store.db import caller_workspace
from motir_celery.store.driver import database_errors, first
from motir_celery.store.sql import adapter as adapter_sql

__all__ = ["MotirBackend", "RunsFirst", "BACKEND", "COPY_RESULTS", "runs_first"]

log = logging.getLogger("motir_celery.adapter.backend")

#: The import path for ``result_backend`` (and what ``attach`` sets as ``app.backend_cls``).
BACKEND = f"{__name__}:MotirBackend"
#: How the runs table is named where a backend names itself (a worker's banner, ``celery report``).
RUNS_TABLE = "motir://runs-table"
_DISABLED = ("", "disabled", "disabled://")
#: The app configuration key (Django: ``CELERY_MOTIR_COPY_RESULTS``) that turns off the copy of
#: durable runs' final states into the app's own result backend (``RunsFirst.copy_final``).
COPY_RESULTS = "motir_copy_results"


#: The states a run's row gives (``results.celery_state``); any other is a progress report's.
_RUN_STATES = frozenset({states.PENDING, states.STARTED, states.RETRY, states.SUCCESS, states.FAILURE,
                         states.REVOKED})

#: How many replacements (``self.replace``) a result is followed through.
_MAX_REPLACED = 20


def run_meta(engine: Engine, task_id: Any, *, any_workspace: bool = False) -> dict[str, Any] | None:
    """Celery's task meta for the run of ``task_id`` (the run id; a durable Celery task's task id,
    tasks.run_id_of); None when no run has that id. A run replaced by ``self.replace`` answers with
    its replacement's. ``any_workspace``: read through the engine login (the worker copying a run
    it settled)."""
    read = partial(_row, engine, any_workspace or engine.settings.results_any_workspace)
    row = read(run_id_of(task_id))
    if row is not None and _replaced(row):
        # Replaced (self.replace): the task's result is its replacement's, the run of the same task
        # id one or more levels deeper (a replacement's chain may add levels); PENDING until it ends.
        row = _replacement(read, task_id)
        if row is None:
            return {"task_id": str(task_id), "status": states.PENDING, "result": None, "traceback": None,
                    "children": [], "date_done": None}
    return None if row is None else _meta(task_id, row)


def _replacement(read: Callable[[uuid.UUID], dict[str, Any] | None], task_id: Any) -> dict[str, Any] | None:
    """The deepest run of ``task_id`` that was not replaced itself, if one is written yet."""
    for nesting in range(1, _MAX_REPLACED + 1):
        row = read(run_id_of(task_id, nesting))
        if row is not None and not _replaced(row):
            return row
    return None


def _replaced(row: dict[str, Any]) -> bool:
    result = row["result"]
    return row["state"] == "succeeded" and isinstance(result, dict) and result.get(REPLACED) is True


def _row(engine: Engine, any_workspace: bool, run_id: uuid.UUID) -> dict[str, Any] | None:
    if any_workspace:  # an operator's process (Flower), a worker copying what it settled: any run
        with engine.pool().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            found: dict[str, Any] | None = first(conn, adapter_sql.RUN_META, {"run_id": run_id})
            return found
    return read_result(engine, run_id, caller_workspace())  # the caller's workspace only: another's is not found


def _meta(task_id: Any, row: dict[str, Any]) -> dict[str, Any]:
    shown = reported(row)
    if shown is not None:  # running, with a progress report of this attempt's: its state and meta
        return {"task_id": str(task_id), "status": shown[0], "result": tagged(shown[1]), "traceback": None,
                "children": [], "date_done": None, "name": row["job_id"],
                "retries": max(int(row["attempts"] or 0) - 1, 0)}
    state = celery_state(row["state"], row["last_outcome"])
    error = row["last_error"] or {}
    result: Any = None
    traceback = None
    if state == states.SUCCESS:
        result = tagged(row["result"])  # as Celery's JSON serializer reads it (a durable task's bytes...)
    elif state in (states.FAILURE, states.RETRY):
        module, _, name = str(error.get("type") or "builtins.Exception").rpartition(".")
        # A durable Celery task's exception as Celery's backends keep one (its class and arguments).
        result = error.get("celery") or {"exc_type": name or "Exception", "exc_module": module or None,
                                         "exc_message": [str(error.get("message") or "")]}
        traceback = str(error.get("traceback") or "") or None
    elif state == states.REVOKED:
        result = {"exc_type": "TaskRevokedError", "exc_module": "celery.exceptions",
                  "exc_message": [f"run {row['id']} was cancelled"]}
    done = row["finished_at"] if state in states.READY_STATES else None
    return {"task_id": str(task_id), "status": state, "result": result, "traceback": traceback,
            "children": [], "date_done": done.isoformat() if done is not None else None,
            "name": row["job_id"], "retries": max(int(row["attempts"] or 0) - 1, 0)}


def _durable(request: Any) -> bool:
    """Whether the worker is storing the state of a job's run (its row is the record). A durable
    Celery task's results are stored as Celery stores them: its canvas reads them there."""
    job = None if request is None else job_for_task(str(getattr(request, "task", "") or ""))
    return job is not None and not job.celery


def _celery_task(meta: dict[str, Any]) -> bool:
    """Whether a run's meta is a durable Celery task's (or a job's this process does not know)."""
    job = find_job(str(meta.get("name") or ""))
    return job is None or job.celery


class RunsTable:
    """What both backends share: runs are read from Postgres, never stored here."""

    app: Any
    #: The meta of a task id that is no run's (``MotirBackend``: PENDING; ``RunsFirst``: the app's backend).
    not_a_run: Callable[..., dict[str, Any]]

    def get_task_meta(self, task_id: Any, cache: bool = True) -> dict[str, Any]:
        meta = self.run_meta(task_id)
        return meta if meta is not None else self.not_a_run(task_id, cache)

    def run_meta(self, task_id: Any) -> dict[str, Any] | None:
        return run_meta(engine_of(self.app), task_id)

    def wait_for(self, task_id: Any, timeout: float | None = None, interval: float = 0.5, no_ack: bool = True,
                 on_interval: Callable[[], Any] | None = None) -> dict[str, Any]:
        """Poll until the run is ready (20 ms first, ×1.5, at most ``interval``), as ``RunHandle.get``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause, ceiling = FIRST_POLL, max(min(interval or MAX_POLL, MAX_POLL), FIRST_POLL)
        while True:
            meta = self.get_task_meta(task_id, cache=False)
            if on_interval:
                on_interval()  # first, as Celery's own backends: a failed parent's error is raised before this one's
            if meta["status"] in states.READY_STATES:
                return meta
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise CeleryTimeout("The operation timed out.")
            time.sleep(pause if left is None else min(pause, left))
            pause = min(pause * POLL_GROWTH, ceiling)

    def wait_for_pending(self, result: Any, timeout: float | None = None, interval: float = 0.5,
                         no_ack: bool = True, on_message: Any = None, on_interval: Any = None,
                         callback: Any = None, propagate: bool = True) -> Any:
        if not self.is_run(result.id):
            return self.other_wait_for_pending(result, timeout=timeout, interval=interval, no_ack=no_ack,
                                               on_message=on_message, on_interval=on_interval,
                                               callback=callback, propagate=propagate)
        self.wait_for(result.id, timeout=timeout, interval=interval, on_interval=on_interval)
        return result.maybe_throw(propagate=propagate, callback=callback)  # reads the ready meta, caches it

    def is_run(self, task_id: Any) -> bool:
        return self.run_meta(task_id) is not None

    def other_wait_for_pending(self, result: Any, **options: Any) -> Any:
        raise NotImplementedError

    def store_result(self, task_id: Any, result: Any, state: str, traceback: Any = None, request: Any = None,
                     **kwargs: Any) -> Any:
        if _durable(request):
            return self.store_durable(task_id, result, state, traceback, request, **kwargs)
        return self.store_other(task_id, result, state, traceback, request, **kwargs)

    def store_durable(self, task_id: Any, result: Any, state: str, traceback: Any, request: Any,
                      **kwargs: Any) -> Any:
        return result  # the run's row is the record: nothing to keep in step

    def store_other(self, task_id: Any, result: Any, state: str, traceback: Any, request: Any,
                    **kwargs: Any) -> Any:
        return result

    def forget(self, task_id: Any) -> None:
        meta = self.run_meta(task_id)
        if meta is not None and not _celery_task(meta):
            return  # a job's run is forgotten by `motir purge`, after its retention
        # Anything else, and what the app's backend keeps of a durable Celery task (its run stays
        # for `motir purge`, as a job's does).
        self.forget_other(task_id)

    def forget_other(self, task_id: Any) -> None:
        return None


class MotirBackend(RunsTable, BaseBackend):
    """The backend of an app with no other: runs from Postgres, anything else PENDING.

    Constructed by Celery as ``MotirBackend(app=app, url=url)``. When the app names a
    backend of its own in ``result_backend`` (``attach`` set this class as ``backend_cls``
    over it), the object made is a ``RunsFirst`` over that backend instead."""

    def __new__(cls, app: Any = None, *args: Any, url: str | None = None, **kwargs: Any) -> Any:
        own = str(app.conf.result_backend or "") if app is not None and cls is MotirBackend else ""
        if own.strip() in _DISABLED or own.startswith(("disabled", BACKEND)):
            return super().__new__(cls)
        backend, their_url = by_url(own, app.loader)
        if isinstance(backend, type) and issubclass(backend, RunsTable):
            return super().__new__(cls)
        return runs_first(backend)(*args, app=app, url=their_url, **kwargs)

    def not_a_run(self, task_id: Any, cache: bool = True) -> dict[str, Any]:
        return {"task_id": str(task_id), "status": states.PENDING, "result": None, "traceback": None,
                "children": [], "date_done": None}

    def as_uri(self, include_password: bool = False) -> str:
        return RUNS_TABLE  # what a worker's banner and `celery report` show

    def other_wait_for_pending(self, result: Any, **options: Any) -> Any:
        # An id that is no run's yet (a durable chain's next link, a chord's body: written when the
        # link before it ends) is waited for until it is; anything else stays PENDING until the
        # timeout, as on Celery's disabled backend.
        self.wait_for(result.id, timeout=options.get("timeout"), interval=options.get("interval") or 0.5,
                      on_interval=options.get("on_interval"))
        return result.maybe_throw(propagate=options.get("propagate", True), callback=options.get("callback"))

    def _forget(self, task_id: Any) -> None:
        return None


class RunsFirst(RunsTable):
    """Mixed before an app's own backend class (``runs_first``): a run's id is answered from the
    runs table, any other id by the app's backend, which keeps storing its other tasks. (The
    app's backend is reached past ``RunsTable`` in the class's order: ``super(RunsTable, self)``.)

    Waiting on an id that is no run's *yet* (``send_task`` to a durable job, then ``get()``
    before a worker adopted the message) polls both: the runs table, and the app's backend
    (its ``get_task_meta``), until either answers; on ``rpc://``, whose results are messages
    to the caller, the wait is the app's backend's own."""

    _motir_warned = False

    def run_meta(self, task_id: Any) -> dict[str, Any] | None:
        try:
            return run_meta(engine_of(self.app), task_id)
        except database_errors() as exc:  # motir's database away: the app's own tasks still answer
            if not RunsFirst._motir_warned:
                RunsFirst._motir_warned = True
                log.warning("the runs table could not be read for a result (%s); answering from the app's "
                            "own result backend until it can", getattr(exc, "orig", None) or exc)
            return None

    def not_a_run(self, task_id: Any, cache: bool = True) -> dict[str, Any]:
        meta: dict[str, Any] = super(RunsTable, self).get_task_meta(task_id, cache)  # type: ignore[misc]
        return meta

    def get_task_meta(self, task_id: Any, cache: bool = True) -> dict[str, Any]:
        """A durable Celery task's run: what the app's backend stored for it (Celery's own record,
        with its children), unless that says nothing yet or the run was revoked; a job's run: its row."""
        meta = self.run_meta(task_id)
        if meta is None:
            return self.not_a_run(task_id, cache)
        if meta["status"] == states.REVOKED or not _celery_task(meta):
            return meta
        theirs = self.not_a_run(task_id, False)
        if meta["status"] not in _RUN_STATES and theirs.get("status") not in states.READY_STATES:
            return meta  # the running attempt's progress: Postgres has it, fenced (tasks.py, update_state)
        return theirs if theirs.get("status") != states.PENDING else meta

    def other_wait_for_pending(self, result: Any, **options: Any) -> Any:
        if isinstance(self, RPCBackend):
            return super(RunsTable, self).wait_for_pending(result, **options)  # type: ignore[misc]
        RunsFirst.wait_for(self, result.id, timeout=options.get("timeout"), interval=options.get("interval") or 0.5,
                           on_interval=options.get("on_interval"))
        return result.maybe_throw(propagate=options.get("propagate", True), callback=options.get("callback"))

    def wait_for(self, task_id: Any, timeout: float | None = None, interval: float = 0.5, no_ack: bool = True,
                 on_interval: Callable[[], Any] | None = None) -> dict[str, Any]:
        # RunsTable.wait_for polls get_task_meta: the runs table first, then the app's backend.
        return RunsTable.wait_for(self, task_id, timeout=timeout, interval=interval, on_interval=on_interval)

    def store_other(self, task_id: Any, result: Any, state: str, traceback: Any, request: Any,
                    **kwargs: Any) -> Any:
        return super(RunsTable, self).store_result(task_id, result, state,  # type: ignore[misc]
                                                   traceback=traceback, request=request, **kwargs)

    def forget_other(self, task_id: Any) -> None:
        super(RunsTable, self).forget(task_id)  # type: ignore[misc]

    def store_durable(self, task_id: Any, result: Any, state: str, traceback: Any, request: Any,
                      **kwargs: Any) -> Any:
        """A durable run's message ended: its final state is copied into the app's own backend."""
        if state in states.READY_STATES:
            self.copy_final(task_id, request)
        return result

    def copy_final(self, task_id: Any, request: Any) -> None:
        """The run's final state, as Postgres has it, written to the app's own backend under its
        task id: what a producer of the code before the switch (plain Celery, no motir) reads with
        ``AsyncResult(id).get()`` during a workers-first cut-over. Read back from the runs table
        rather than taken from the tracer, which sees a duplicate delivery's "skipped" or a
        ``RunFailed`` where the run has its own result or exception. Off with the app key
        ``motir_copy_results = False`` (docs/operations.md, "Results during the switch")."""
        if not self.app.conf.get(COPY_RESULTS, True):
            return
        meta = run_meta(engine_of(self.app), task_id, any_workspace=True)
        if meta is None or meta["status"] not in (states.SUCCESS, states.FAILURE):
            return  # queued again (a retry), or not a run: nothing final to copy
        result = meta["result"]
        if meta["status"] == states.FAILURE:
            result = super(RunsTable, self).exception_to_python(result)  # type: ignore[misc]
        super(RunsTable, self).store_result(task_id, result, meta["status"],  # type: ignore[misc]
                                            traceback=meta["traceback"], request=request)

    def as_uri(self, include_password: bool = False) -> str:
        own: str = super(RunsTable, self).as_uri(include_password)  # type: ignore[misc]
        if isinstance(self, RPCBackend):
            return own  # Celery's worker recognises rpc:// by this very string
        return f"{RUNS_TABLE} + {own}"  # the banner's results: durable runs, then the app's own tasks


_mixed: dict[type, type] = {}
_mixed_lock = threading.Lock()


def runs_first(backend: type) -> type:
    """``RunsFirst`` mixed before ``backend`` (one class per backend class, importable from
    this module by its name, so a pickled AsyncResult that carries it unpickles)."""
    with _mixed_lock:
        mixed = _mixed.get(backend)
        if mixed is None:
            name = f"RunsFirst_{backend.__module__.replace('.', '_')}_{backend.__name__}"
            mixed = type(name, (RunsFirst, backend), {"__module__": __name__, "__qualname__": name})
            globals()[name] = _mixed[backend] = mixed
        return mixed
