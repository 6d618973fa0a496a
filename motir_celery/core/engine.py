"""The engine: the one composition root, built once and handed down.

An ``Engine`` owns what every path of a run shares — the settings, the connection pools, the
``Host`` its runs are published through, the lease keeper and the test kit's faults — and is
the one object the rest of the package is handed. Who builds one:

* ``attach(app)`` / ``create_app()`` (``adapter/celery_app.py``): an engine hosted on a
  Celery app, made current; the app's tasks run their runs through it;
* the test kit (``testing/kit.py``): an engine over the test's database whose messages are
  held, with crashes injected at step boundaries (``faults``), current for the test;
* the package's face, when nothing else made one: ``core/current.py``'s default.

Every room of the core takes the engine as its first argument; no module below reads the
environment, and nothing reaches an engine through a module-global hook: code without one
(``job.delay()``) asks ``current()``.

**Settings.** An engine given settings keeps them; one built without follows this process's
environment (``settings.get_settings``, read again after ``reset_settings``, as Django's app
does once it has written its settings there).
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Mapping, Protocol, Sequence, TextIO, cast

from motir_celery.core.publish import Host, NoBroker, Publish
from motir_celery.core.worker import canvas as _canvas_job  # noqa: F401  (defines the job system.canvas)
from motir_celery.settings import Settings, get_settings
from motir_celery.store import db
from motir_celery.store.pg import Pool

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from sqlalchemy import Engine as SqlEngine
    from sqlalchemy.orm import Session

    from motir_celery.core.jobs import Job
    from motir_celery.core.operator.dlq import Caller, ReplayResult
    from motir_celery.core.operator.offboard import Erased, Offboarded, SubjectCancelled
    from motir_celery.core.operator.resume import ResumeResult
    from motir_celery.core.producer.events import SendResult
    from motir_celery.core.producer.results import RunHandle
    from motir_celery.core.producer.streams import Progress, StreamReader
    from motir_celery.core.producer.subjects import ActiveRun
    from motir_celery.core.worker.runner import Outcome
    from motir_celery.core.worker.steps import Step
    from motir_celery.core.worker.sweeper import SweepReport
    from motir_celery.store import records
    from motir_celery.store.driver import Conn
    from motir_celery.store.lent import LentPool
    from motir_celery.store.listen import Listener

__all__ = ["Engine", "Tuning", "Faults", "Joined", "JoinTransaction", "LendConnections"]

#: A framework's open transaction that a write without ``session=`` joins: the connection to
#: write on (in that transaction), and ``on_commit(fn)``, which calls ``fn`` once it has
#: committed and never if it rolls back.
Joined = tuple["Conn", Callable[[Callable[[], None]], None]]
#: ``join(workspace_id)``: the framework's transaction to write in, or None (contrib/django).
JoinTransaction = Callable[[str | None], "AbstractContextManager[Joined] | None"]
#: ``lend()``: a framework's connection every statement of the engine goes on for now (a
#: ``LentPool``: Django's, inside a ``TestCase``'s transaction; contrib/django/testdb.py), or None.
LendConnections = Callable[[], "LentPool | None"]


@dataclass(frozen=True)
class Tuning:
    """The performance mechanisms that trade a measured gain against a stated hazard.

    Not settings: each default is decided on the evidence (docs/performance.md, "Ablation";
    docs/reliability.md, "What a crash can cost"), and only a benchmark builds an engine with one
    turned off, to measure it (docs/settings.md)."""

    #: The claim's commit does not wait for the WAL flush (store/sql/worker.py, CLAIM).
    claim_async_commit: bool = True
    #: A succeeded run's settle does not wait for the WAL flush (SETTLE_SUCCEEDED).
    settle_async_commit: bool = True
    #: On a plain Redis broker, run messages are pushed onto kombu's lists directly
    #: (adapter/messages.py) instead of through ``send_task``.
    direct_publish: bool = True
    #: kombu's Redis acknowledgement emulation stays off in the app ``create_app`` builds
    #: (adapter/celery_app.py); an attached app keeps its own.
    redis_ack_emulation: bool = False


class Faults(Protocol):
    """The test kit's crash injection, at the step boundaries of every attempt this engine runs."""

    def before_body(self, step: Step, key: str) -> None:
        """About to run step ``key``'s body (raise to die there)."""
        ...

    def after_record(self, step: Step, key: str) -> None:
        """Step ``key``'s record has committed (raise to die there)."""
        ...


class Engine:
    """Settings, pools, host, leases: what one process's runs share (see the module docstring)."""

    def __init__(self, settings: Settings | None = None, *, host: Host | None = None,
                 host_factory: Callable[[Engine], Host] | None = None, faults: Faults | None = None,
                 tuning: Tuning | None = None) -> None:
        from motir_celery.core.admission import Admission
        from motir_celery.core.worker.leases import LeaseKeeper

        self._settings = settings
        self._host = host
        self._host_factory = host_factory
        self._host_lock = threading.RLock()
        self.faults = faults
        self.tuning = tuning or Tuning()
        self.leases = LeaseKeeper(self)
        #: Who goes next (core/admission.py): the gate every publish passes, and the dispatcher.
        self.admission = Admission(self)
        #: How many runs this process runs at once (Celery's threads pool: its concurrency).
        self.runs_per_process = 1
        self._join: JoinTransaction | None = None
        self._lend: LendConnections | None = None

    def __repr__(self) -> str:
        return f"<motir Engine host={type(self._host).__name__}>"

    # --- what it owns -------------------------------------------------------------------

    @property
    def settings(self) -> Settings:
        return self._settings if self._settings is not None else get_settings()

    @property
    def host(self) -> Host:
        """Where runs are published: the Celery app this engine is hosted on (built on first use
        by the default engine), the kit's, ``Inline``; ``NoBroker`` when there is none."""
        host = self._host
        if host is None:
            with self._host_lock:
                if self._host is None:
                    factory = self._host_factory
                    # A factory that raises (no broker configured yet) is asked again next time.
                    made = factory(self) if factory is not None else NoBroker()
                    if self._host is None:  # the factory may have hosted this engine itself (attach)
                        self._host = made
                    self._host_factory = None
                host = self._host
        return host

    @property
    def built_host(self) -> Host | None:
        """The host if it is made already (None: the default app not built yet), never building it."""
        return self._host

    def host_on(self, host: Host) -> None:
        """Publish through ``host`` from now on (``attach``)."""
        with self._host_lock:
            self._host = host
            self._host_factory = None

    def publish(self, run_id: uuid.UUID, job_id: str, countdown: float = 0.0) -> None:
        """Hand a committed run to the broker (callers go through ``publish_or_log``) — unless
        admission holds it in Postgres for its turn (core/admission.py)."""
        if self.admission.admitted([(run_id, job_id)]):
            self.host.publish(run_id, job_id, countdown)

    def publish_many(self, runs: Sequence[tuple[uuid.UUID, str]]) -> None:
        """Hand committed runs due now to the broker in one go, those admission admits."""
        admitted = self.admission.admitted(runs)
        if admitted:
            self.host.publish_many(admitted)

    def routed(self, queue: str | None, priority: int | None) -> Publish:
        """The publish of one call's message with its own ``queue=`` / ``priority=`` (none: ``publish``)."""
        if queue is None and priority is None:
            return self.publish
        publish = self.host.routed(queue, priority)

        def admitted_then_routed(run_id: uuid.UUID, job_id: str, countdown: float = 0.0) -> None:
            # A held run loses its call's queue= / priority= message options: the dispatcher sends
            # it as the sweeper does, routed by its job (its run's priority still orders the choice).
            if self.admission.admitted([(run_id, job_id)]):
                publish(run_id, job_id, countdown)

        return admitted_then_routed

    def pool(self) -> Pool:
        """This process's engine-role connections (runs, producers, operator actions) — or, while a
        framework lends its own (``lend_connections``), that one connection."""
        lent = self.lent()
        if lent is not None:
            # A LentPool has connect() and begin(), all that the paths of a run ask of a pool.
            return cast(Pool, lent)
        return db.get_pool(self.settings, runs=self.runs_per_process)

    def lend_connections(self, lend: LendConnections | None) -> None:
        """Let a framework whose test holds everything in one transaction (Django's ``TestCase``)
        lend the connection that transaction is on: ``lend()`` is asked at every checkout."""
        self._lend = lend

    @property
    def lender(self) -> LendConnections | None:
        return self._lend

    def lent(self) -> LentPool | None:
        """The connection a framework lends now (``lend_connections``), or None."""
        return self._lend() if self._lend is not None else None

    def side_pool(self) -> Pool:
        """One connection of its own per process, for the worker's side duties (heartbeats, sweeps)."""
        return db.side_engine(self.settings)

    def sql_engine(self) -> SqlEngine:
        """A SQLAlchemy engine on the engine URL (the kit's reads, operator tools)."""
        return db.get_engine(self.settings)

    def session(self, workspace_id: str | None, *, admin: bool = False) -> ContextManager[Session]:
        """An RLS-enforced session scoped to ``workspace_id`` (``admin``: every workspace)."""
        return db.workspace_session(workspace_id, admin=admin, settings=self.settings)

    # --- framework transactions (contrib/django) ----------------------------------------

    def join_transactions(self, join: JoinTransaction | None) -> None:
        """Let a framework that owns the caller's transaction take the writes: ``join(workspace_id)``
        is asked on every write made without ``session=`` (None: the engine's own, autocommit)."""
        self._join = join

    @property
    def transactions(self) -> JoinTransaction | None:
        return self._join

    def joined(self, workspace_id: str | None) -> AbstractContextManager[Joined] | None:
        """The framework transaction a write of ``workspace_id``'s rows joins, or None."""
        return self._join(workspace_id) if self._join is not None else None

    # --- the worker's path ----------------------------------------------------------------

    def execute(self, run_id: uuid.UUID | str, *, job_id: str, worker: str) -> Outcome:
        """One attempt of a run: claim, handler, settle (``core/worker/runner.py``)."""
        from motir_celery.core.worker import runner

        return runner.execute(self, run_id, job_id=job_id, worker=worker)

    def publish_woken(self, conn: Conn, settled: Sequence[uuid.UUID]) -> int:
        """After the commit that settled ``settled``: publish the parents those settles woke."""
        from motir_celery.core.worker import invoke

        return invoke.publish_woken(self.publish, conn, settled)

    def sweep(self, *, once_per_period: bool = False, batch: int = 500) -> SweepReport:
        """Reclaim expired leases, publish runs whose message went missing, fold the stats."""
        from motir_celery.core.worker import sweeper

        return sweeper.sweep(self, once_per_period=once_per_period, batch=batch)

    # --- producers ------------------------------------------------------------------------

    def send_event(self, name: str, data: Any, *, workspace_id: str | None = None,
                   idempotency_key: str | None = None, session: Session | None = None,
                   priority: int | None = None, jobs: Sequence[Job] | None = None) -> SendResult:
        """Record an event and start one run per subscribing job (``core/producer/events.py``)."""
        from motir_celery.core.producer import events

        return events.send_event(self, name, data, workspace_id=workspace_id, idempotency_key=idempotency_key,
                                 session=session, priority=priority, jobs=jobs)

    def send_events(self, items: Sequence[Any], *, session: Session | None = None) -> list[SendResult]:
        """N events and their runs in one statement (``core/producer/batch.py``)."""
        from motir_celery.core.producer import batch

        return batch.send_events(self, items, session=session)

    async def send_event_async(self, name: str, data: Any, *, workspace_id: str | None = None,
                               idempotency_key: str | None = None, session: Any = None,
                               priority: int | None = None) -> SendResult:
        from motir_celery.core.producer import aio

        return await aio.send_event_async(self, name, data, workspace_id=workspace_id,
                                          idempotency_key=idempotency_key, session=session, priority=priority)

    def write_event(self, conn: Conn, name: str, data: Any, encoded: str, workspace_id: str | None,
                    idempotency_key: str | None, jobs: Sequence[Job]) -> SendResult:
        """An event stored before (``encoded``: its JSON) and its runs for ``jobs``, in ``conn``'s
        transaction: a DLQ replay's."""
        from motir_celery.core.producer import events

        return events.write_event(conn, name, data, encoded, workspace_id, idempotency_key, jobs, engine=self)

    def publish_after_commit(self, session: Session, runs: Sequence[records.Queued]) -> None:
        """Publish ``runs`` through this engine when ``session`` commits, never if it rolls back
        (what ``send_event(session=)`` does): a DLQ replay in the caller's transaction."""
        from motir_celery.core.producer import events

        events.publish_after_commit(session, runs, self.publish)

    def apply_async(self, job: Job, args: Sequence[Any], kwargs: Mapping[str, Any],
                    options: Mapping[str, Any]) -> RunHandle:
        """``job.delay()`` / ``job.apply_async()``: one direct run (``core/producer/direct.py``)."""
        from motir_celery.core.producer import direct

        return direct.apply_async(self, job, args, kwargs, options)

    async def apply_async_async(self, job: Job, args: Sequence[Any], kwargs: Mapping[str, Any],
                                options: Mapping[str, Any]) -> RunHandle:
        from motir_celery.core.producer import aio

        return await aio.apply_async_async(self, job, args, kwargs, options)

    def apply(self, job: Job, args: Sequence[Any], kwargs: Mapping[str, Any], options: Mapping[str, Any]) -> RunHandle:
        """``job.apply()``: the run written, then executed here at once (``core/worker/inline.py``)."""
        from motir_celery.core.producer import direct

        return direct.apply_async(self.inline(), job, args, kwargs, options)

    def inline(self) -> Engine:
        """This engine with a host that runs every run it publishes here, at once (``Inline``)."""
        from motir_celery.core.worker.inline import Inline

        twin = Engine(self._settings, faults=self.faults, tuning=self.tuning)
        twin.runs_per_process = self.runs_per_process
        twin.join_transactions(self._join)
        twin.lend_connections(self._lend)
        twin.host_on(Inline(twin))
        return twin

    def adopt(self, job: Job, args: Any, kwargs: Any, task_id: str, *, task_name: str,
              shown: Mapping[str, str], celery: Mapping[str, Any] | None = None) -> Any:
        """A message in Celery's protocol stored as the run ``.delay()`` would have written."""
        from motir_celery.core.producer import direct

        return direct.adopt(self, job, args, kwargs, task_id, task_name=task_name, shown=shown, celery=celery)

    def enqueue(self, job: Job, args: Sequence[Any], kwargs: Mapping[str, Any], options: Mapping[str, Any],
                celery: Mapping[str, Any]) -> Any:
        """A durable Celery task's run, written before Celery sends its message (``direct.enqueue``)."""
        from motir_celery.core.producer import direct

        return direct.enqueue(self, job, args, kwargs, options, celery)

    def adopt_canvas(self, job: Job, args: Sequence[Any], kwargs: Mapping[str, Any], task_id: str,
                     parts: Mapping[str, Any], *, task_name: str, shown: Mapping[str, str]) -> Any:
        """A Celery message that carries a canvas, stored whole as one canvas run."""
        from motir_celery.core.producer import canvas

        return canvas.adopt_canvas(self, job, args, kwargs, task_id, parts, task_name=task_name, shown=shown)

    # --- progress and streams, read (core/producer/streams.py) --------------------------------

    def stream(self, run_id: uuid.UUID | str, name: str, *, workspace_id: str | None = None) -> StreamReader:
        """Stream ``name`` of run ``run_id``, read in ``workspace_id`` (None: system runs): ``read``,
        ``follow``, ``afollow``."""
        from motir_celery.core.producer.streams import StreamReader

        return StreamReader(self, run_id, name, workspace_id=workspace_id)

    def progress(self, run_id: uuid.UUID | str, *, workspace_id: str | None = None) -> Progress | None:
        """Run ``run_id``'s latest progress report and its streams, read in ``workspace_id``."""
        from motir_celery.core.producer.streams import read_progress

        return read_progress(self, run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id)),
                             workspace_id)

    def listener(self) -> Listener | None:
        """This process's LISTEN connection that wakes stream followers (store/listen.py); None behind
        a transaction pooler, where followers poll."""
        return db.get_listener(self.settings)

    def handle(self, run_id: uuid.UUID | None, job_id: str, *, workspace_id: str | None = None,
               deduplicated: bool = False) -> RunHandle:
        from motir_celery.core.producer.results import RunHandle

        return RunHandle(run_id, job_id, workspace_id=workspace_id, deduplicated=deduplicated, engine=self)

    # --- the canvas (``Job.s()`` & co.) --------------------------------------------------

    def signature(self, job: Job, args: Sequence[Any], kwargs: Mapping[str, Any], options: Mapping[str, Any],
                  immutable: bool) -> Any:
        from motir_celery.core.producer import canvas

        return canvas.Signature(job, args, kwargs, options, immutable)

    def xmap(self, job: Job, items: Iterable[Any]) -> Any:
        from motir_celery.core.producer import canvas

        return canvas.xmap(job, items)

    def xstarmap(self, job: Job, items: Iterable[Sequence[Any]]) -> Any:
        from motir_celery.core.producer import canvas

        return canvas.xstarmap(job, items)

    def chunks(self, job: Job, items: Iterable[Sequence[Any]], n: int) -> Any:
        from motir_celery.core.producer import canvas

        return canvas.chunks(job, items, n)

    # --- operator actions -------------------------------------------------------------------

    def replay_dlq(self, dlq_id: uuid.UUID | str, *, actor: str, idempotency_key: str | None = None,
                   session: Session | None = None) -> ReplayResult:
        """Replay a DLQ entry (``core/operator/dlq.py``); ``session=``: in that session's transaction."""
        from motir_celery.core.operator import dlq

        return dlq.replay_dlq(self, dlq_id, actor=actor, idempotency_key=idempotency_key, session=session)

    def resume_dlq(self, dlq_id: uuid.UUID | str, *, actor: str) -> ResumeResult:
        from motir_celery.core.operator import resume

        return resume.resume_dlq(self, dlq_id, actor=actor)

    def cancel_run(self, run_id: uuid.UUID | str) -> bool:
        from motir_celery.core.operator import dlq

        return dlq.cancel_run(self, run_id)

    def cancel_workspace(self, workspace_id: str, *, actor: str, reason: str, job: str | None = None) -> Offboarded:
        """Offboarding: cancel a workspace's queued and running runs, audited (``core/operator/offboard.py``)."""
        from motir_celery.core.operator import offboard

        return offboard.cancel_workspace(self, workspace_id, actor=actor, reason=reason, job=job)

    def cancel_subject(self, workspace_id: str, subject: tuple[str, str], *, actor: str,
                       reason: str) -> SubjectCancelled:
        """Offboarding a subject: cancel its queued and running runs in a workspace, audited (``offboard.py``)."""
        from motir_celery.core.operator import offboard

        return offboard.cancel_subject(self, workspace_id, subject, actor=actor, reason=reason)

    def active_for_subject(self, subject: tuple[str, str], *, workspace_id: str | None = None, limit: int = 10,
                           session: Session | None = None) -> list[ActiveRun]:
        """The open runs of ``subject`` in ``workspace_id``, read as the tenant (``core/producer/subjects.py``)."""
        from motir_celery.core.producer import subjects

        return subjects.active_for_subject(self, subject, workspace_id=workspace_id, limit=limit, session=session)

    def export_workspace(self, workspace_id: str, out: TextIO) -> dict[str, int]:
        """Every row of a workspace to ``out`` as JSON lines; the count per table (``offboard.py``)."""
        from motir_celery.core.operator import offboard

        return offboard.export_workspace(self, workspace_id, out)

    def erase_workspace(self, workspace_id: str, *, actor: str, reason: str) -> Erased:
        """Delete every row of a workspace with nothing queued or running, audited (``offboard.py``)."""
        from motir_celery.core.operator import offboard

        return offboard.erase_workspace(self, workspace_id, actor=actor, reason=reason)

    def caller(self, *, actor: str, workspace: str | None = None, admin: bool = False) -> Caller:
        from motir_celery.core.operator.dlq import Caller

        return Caller(actor=actor, workspace=workspace, admin=admin)

    def dispose(self) -> None:
        """Close this process's pooled connections (tests, shutdown)."""
        db.dispose_engines()
