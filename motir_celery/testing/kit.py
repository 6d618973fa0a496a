"""``Motir``: durable jobs run in this process against a real Postgres, with crashes and skipped time.

What the pytest fixture ``motir`` hands a test (``plugin.py``; docs/testing.md). No
broker and no worker process: ``drain()`` takes every due run and executes it with the
real runner — the claim, each fenced step record, the settle — then sweeps with the real
sweeper statements, until nothing is due. So a test sees what production does,
statement for statement:

* ``crash_after("charge")`` — the next attempt that stores step ``charge`` dies right
  after the record commits, as a worker killed there would: no settle, its lease runs
  out at once, the sweeper reclaims the run (the attempt stays charged), and the next
  ``drain`` round runs attempt two, which finds ``charge`` stored. ``crash_before``
  dies before the body starts. A side effect outside ``step.run`` happens twice, one
  inside it once: that is what such a test shows.
* ``advance(seconds=…)`` — every instant the engine stored (run_at, leases, sleeps'
  and waits' windows, events' arrival, retries' backoff, countdowns) moves back by that
  much, which to every statement is ``now()`` moving forward. Production statements
  are untouched: there is no clock of the kit's on the hot path. Cron slots are the one
  clock reading the kit keeps itself (``tick()``).

The kit is an engine of its own (``core/engine.py``) over the test's database, made current
for the fixture's lifetime (``install`` / ``uninstall``): ``job.delay()`` and ``send_event``
write through it, and the messages they publish are held in ``published``, not sent to a
broker. Crashes are injected through that engine's ``faults`` (the step boundaries every
attempt passes), never by patching a class.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Sequence

from sqlalchemy import Engine as SqlEngine

from motir_celery.core.current import default, make_current
from motir_celery.core.engine import Engine
from motir_celery.core.jobs import Job, all_jobs, get_job
from motir_celery.core.producer.events import SendResult
from motir_celery.core.producer.results import ResultTimeout, RunHandle
from motir_celery.core.publish import Publish
from motir_celery.core.schedule import latest_slot
from motir_celery.core.worker.inline import Inline
from motir_celery.core.worker.runner import Outcome
from motir_celery.core.worker.steps import Step
from motir_celery.settings import Settings
from motir_celery.store.records import Queued
from motir_celery.store.sql import producer as producer_sql
from motir_celery.store.sql import testing as testing_sql

__all__ = ["Motir", "WorkerCrash", "Handle", "DrainError", "Held"]


class WorkerCrash(BaseException):
    """The kit's stand-in for a worker's death at a step boundary: a BaseException, so no
    handler's ``except Exception`` and no settle of the runner's can catch it."""


class DrainError(AssertionError):
    """``drain`` ran its limit of attempts and runs were still due (a job that never settles)."""


class Handle(RunHandle):
    """A result handle that never waits: a run not finished yet is a test's mistake to hear about."""

    def get(self, timeout: float | None = 0.0, *, propagate: bool = True) -> Any:
        try:
            return super().get(timeout=timeout, propagate=propagate)
        except ResultTimeout:
            raise ResultTimeout(f"run {self.id} of {self.job_id} is not finished ({self.state}): "
                                "motir.drain() runs what is due, motir.advance(seconds=…) what waits") from None


@dataclass
class _Crash:
    step_id: str
    after: bool  # after the record commits; else before the body starts


class Held(list[tuple[uuid.UUID, str, float]]):
    """A host that holds every message as ``(run_id, job_id, countdown)``: an engine built with it
    (``Engine(settings, host=Held())``) writes runs and publishes nothing — for a test that
    looks at what would have been sent."""

    eager = False

    def publish(self, run_id: uuid.UUID, job_id: str, countdown: float = 0.0) -> None:
        self.append((run_id, job_id, countdown))

    def publish_many(self, runs: Sequence[tuple[uuid.UUID, str]]) -> None:
        for run_id, job_id in runs:
            self.publish(run_id, job_id)

    def routed(self, queue: str | None, priority: int | None) -> Publish:
        return self.publish


class _Held:
    """The kit engine's host: each message is held in ``Motir.published`` — or, when the app the
    code under test would have published through is in Celery's eager mode, its run is executed
    here at once (``Inline``). While the kit drains, messages are dropped: ``drain`` finds the
    due runs in the database itself."""

    def __init__(self, kit: Motir) -> None:
        self.kit = kit
        self.inline: Inline | None = None

    @property
    def eager(self) -> bool:
        # The engine the code would publish through without the kit: the one made current
        # before it (an attached app's), else the default (motir_celery.app's).
        before = self.kit.before if self.kit.before is not None else default()
        host = before.built_host
        return host is not None and host.eager and not self.kit.draining

    def publish(self, run_id: uuid.UUID, job_id: str, countdown: float = 0.0) -> None:
        if self.kit.draining:
            return
        if self.eager:
            if self.inline is None:
                self.inline = Inline(self.kit.engine)
            self.inline.publish(run_id, job_id, countdown)
            return
        self.kit.published.append((run_id, job_id, countdown))

    def publish_many(self, runs: Sequence[tuple[uuid.UUID, str]]) -> None:
        for run_id, job_id in runs:
            self.publish(run_id, job_id)

    def routed(self, queue: str | None, priority: int | None) -> Publish:
        return self.publish


@dataclass
class Motir:
    """The test kit over one migrated database (the ``motir`` fixture)."""

    settings: Settings
    #: Seconds skipped so far (the cron clock: database now() plus this).
    skipped: float = 0.0
    #: What every executed attempt came to, in order: (run id, outcome).
    outcomes: list[tuple[uuid.UUID, Outcome]] = field(default_factory=list)
    #: The messages the code under test published, (run id, job id, countdown): the kit
    #: holds them instead of a broker (``drain`` finds due runs in the database itself).
    published: list[tuple[uuid.UUID, str, float]] = field(default_factory=list)
    #: The engine current before ``install`` (its app says whether Celery's eager mode is on).
    before: Engine | None = None
    #: True while ``drain`` runs runs.
    draining: bool = False
    _crashes: list[_Crash] = field(default_factory=list)
    _installed: bool = False

    def __post_init__(self) -> None:
        #: The kit's engine: this test's database, messages held, crashes injected (``install``).
        self.engine = Engine(self.settings, host=_Held(self), faults=self)

    @property
    def sql(self) -> SqlEngine:
        """A SQLAlchemy engine on the kit's database, for a test's own reads."""
        return self.engine.sql_engine()

    # --- starting runs ------------------------------------------------------------

    def run(self, job: Job | str, *args: Any, **kwargs: Any) -> Handle:
        """One run of a direct job, as ``job.delay(*args, **kwargs)`` writes it (nothing runs until ``drain``)."""
        return self.apply_async(job, args, kwargs)

    def apply_async(self, job: Job | str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                    **options: Any) -> Handle:
        """``job.apply_async(args, kwargs, **options)``: countdown=, eta=, task_id=, workspace_id=…"""
        job = get_job(job) if isinstance(job, str) else job
        handle = self.engine.apply_async(job, args, kwargs or {}, options)
        return self._handle(handle.id, job.id, handle.workspace_id, handle.deduplicated)

    def send_event(self, name: str, data: Any, **options: Any) -> SendResult:
        """``send_event(name, data, …)``; its runs' handles are ``result.results`` (and ``motir.handles``)."""
        return self.engine.send_event(name, data, **options)

    def handles(self, result: SendResult) -> list[Handle]:
        """A never-waiting handle per run an event created."""
        return [self._handle(h.id, h.job_id, h.workspace_id) for h in result.results]

    def tick(self, *jobs: Job | str) -> list[uuid.UUID]:
        """The beat's pass on the kit's clock: the latest slot of each cron job (of ``jobs``, when
        given; else of every cron job this process defines), once; the runs made now."""
        with self.sql.begin() as conn:
            now = producer_sql.db_now(conn) + timedelta(seconds=self.skipped)
        made = []
        for job in [get_job(j) if isinstance(j, str) else j for j in jobs] or all_jobs():
            if job.cron is None:
                continue
            slot = latest_slot(job.cron, job.timezone, now)
            if slot is not None:
                made += self._enqueue_slot(job, slot)
        return made

    # --- running them ---------------------------------------------------------------

    def drain(self, *, limit: int = 1000) -> list[tuple[uuid.UUID, Outcome]]:
        """Run every due run to its settle (or its crash), sweep, again, until nothing is due.
        ``limit`` bounds the attempts of one drain (``DrainError`` beyond it)."""
        done: list[tuple[uuid.UUID, Outcome]] = []
        self.draining = True
        try:
            while True:
                self.engine.sweep()  # leases a crash left, runs whose message "went missing"
                with self.sql.begin() as conn:
                    due = testing_sql.due_runs(conn, limit=limit)
                if not due:
                    break
                for run_id, job_id in due:
                    if len(done) >= limit:
                        raise DrainError(f"drain ran {limit} attempts and runs are still due: {due[:5]}")
                    done.append((run_id, self._attempt(run_id, job_id)))
        finally:
            self.draining = False
        self.outcomes += done
        return done

    def _attempt(self, run_id: uuid.UUID, job_id: str) -> Outcome:
        try:
            return self.engine.execute(run_id, job_id=job_id, worker=f"motir.testing/{os.getpid()}")
        except WorkerCrash as crash:
            with self.sql.begin() as conn:
                testing_sql.expire_lease(conn, run_id)  # the dead worker's lease, run out at once
            return Outcome(str(run_id), "crashed", str(crash))

    def advance(self, seconds: float = 0.0, *, minutes: float = 0.0, hours: float = 0.0, days: float = 0.0) -> None:
        """Skip time: to the engine it is now this much later (sleeps, waits' timeouts, backoff,
        countdown and eta, leases, cron slots). Nothing runs until ``drain()``."""
        total = seconds + 60 * minutes + 3600 * hours + 86400 * days
        if total < 0:
            raise ValueError("time only moves forward")
        with self.sql.begin() as conn:
            testing_sql.advance(conn, total)
        self.skipped += total

    # --- crashes ----------------------------------------------------------------------

    def crash_after(self, step_id: str) -> None:
        """The next attempt that stores ``step_id`` dies right after its record commits."""
        self._crashes.append(_Crash(step_id, after=True))

    def crash_before(self, step_id: str) -> None:
        """The next attempt that is about to run ``step_id``'s body dies before it starts."""
        self._crashes.append(_Crash(step_id, after=False))

    def _take(self, step_key: str, *, after: bool) -> _Crash | None:
        base = step_key.split(":", 1)[0]
        for crash in self._crashes:
            if crash.after == after and crash.step_id in (step_key, base):
                self._crashes.remove(crash)
                return crash
        return None

    # --- the engine's faults (core/engine.py ``Faults``) ------------------------------

    def before_body(self, step: Step, key: str) -> None:
        if self._take(key, after=False) is not None:
            raise WorkerCrash(f"crash_before({key!r}) in run {step.run_id}")

    def after_record(self, step: Step, key: str) -> None:
        if self._take(key, after=True) is not None:
            raise WorkerCrash(f"crash_after({key!r}) in run {step.run_id}")

    def install(self) -> None:
        """Make the kit's engine current: the code under test writes through it, its messages are
        held, its attempts crash where asked (the fixture calls it). An app in Celery's eager mode
        keeps running its runs at once (``Inline``)."""
        if not self._installed:
            self._installed = True
            self.before = make_current(self.engine)
            if self.before is not None and self.before.transactions is not None:
                self.engine.join_transactions(self.before.transactions)  # Django's atomic(), joined as before
                self.engine.lend_connections(self.before.lender)

    def uninstall(self) -> None:
        if self._installed:
            self._installed = False
            make_current(self.before)

    # --- reading what happened -----------------------------------------------------------

    def steps(self, handle: RunHandle) -> list[str]:
        """The run's stored steps, in the order they were stored (a wait's own window left out)."""
        with self.sql.connect() as conn:
            found = testing_sql.steps_of(conn, _run_id(handle))
        return [s["step_id"] for s in found if not s["step_id"].endswith(":wait")]

    def attempts(self, handle: RunHandle) -> int:
        """Attempts charged so far (a sleep, a wait or a deferral charges none)."""
        return int(self._run(handle)["attempts"])

    def outcomes_of(self, handle: RunHandle) -> list[str]:
        """How each attempt of the run ended: running, succeeded, retrying, failed, lost, suspended…"""
        return list(self._run(handle)["outcomes"])

    def state(self, handle: RunHandle) -> str:
        """The run's state: queued, running, succeeded, failed or cancelled."""
        return str(self._run(handle)["state"])

    def dlq(self) -> list[dict[str, Any]]:
        """Every DLQ entry, oldest first (``job_id``, ``failure``, ``attempts``, …)."""
        with self.sql.connect() as conn:
            return testing_sql.dlq_entries(conn)

    def reset(self) -> None:
        """Empty the tables (the fixture does this before every test)."""
        with self.sql.begin() as conn:
            testing_sql.empty_tables(conn)
        self.skipped, self.outcomes, self._crashes = 0.0, [], []

    # --- helpers --------------------------------------------------------------------------

    def _run(self, handle: RunHandle) -> dict[str, Any]:
        with self.sql.connect() as conn:
            row = testing_sql.run_of(conn, _run_id(handle))
        if row is None:
            raise LookupError(f"no run {handle.id}")
        return row

    def _handle(self, run_id: uuid.UUID | None, job_id: str, workspace_id: str | None,
                deduplicated: bool = False) -> Handle:
        return Handle(run_id, job_id, deduplicated=deduplicated, workspace_id=workspace_id, engine=self.engine)

    def _enqueue_slot(self, job: Job, slot: datetime) -> list[uuid.UUID]:
        spec = job.spec({"scheduled_for": slot.isoformat()}, None)
        with self.sql.begin() as conn:
            made = producer_sql.enqueue_scheduled(conn, job.id, slot, max_attempts=spec.max_attempts,
                                                  policy=spec.policy, priority=spec.priority,
                                                  concurrency_key=spec.concurrency_key)
        return [made.run_id] if isinstance(made, Queued) else []


def _run_id(handle: RunHandle) -> uuid.UUID:
    if handle.id is None:
        raise LookupError("this handle names no run (a refused call whose run is hidden)")
    return handle.id
