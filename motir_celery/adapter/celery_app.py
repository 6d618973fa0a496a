"""The Celery adapter: the default app, ``attach(app)``, per-job tasks, publishing.

Each job becomes a task under its Celery name (``Job.task_name``: ``name=``, or
``module.function`` for a direct job, else ``motir.<job_id>``) and under its alias
``motir.<job_id>``, so Flower lists runs per job, ``task_routes`` and ``beat_schedule``
written for the Celery task keep meaning it, and messages of earlier releases still
land. The engine publishes under the task name. A run's message carries the run id
only (also as its Celery task id); Postgres holds the rest. A message in Celery's
own protocol for a direct job is adopted as a run before its body runs
(``protocol.py``). ``attach`` also installs the result backend that reads the runs
table (``backend.py``), unless the app chose a backend class itself.

The one default this module sets on the apps it hosts:
``worker_prefetch_multiplier = 1`` — a worker reserves as few messages as
Celery allows (one besides each running one); a reserved message waits for a
free process of that worker, behind however long its runs are.

Messages are acknowledged early, as Celery does by default (when a pool
process starts the task), not late: Postgres, not the broker, is what makes a
run happen. A run a dead worker had claimed comes back through its lease and
the sweeper; a message redelivered for it would be refused by the claim while
the lease holds, so late acks buy nothing there, and cost a broker round trip
in the worker's serial main process between every two runs (the largest single
item of a run's wall time after Postgres; docs/performance.md). A message lost
between its acknowledgement and the claim leaves its run queued, and the
sweeper publishes it again after ``MOTIR_REPUBLISH_AFTER``. Early acks also keep
long runs clear of RabbitMQ's ``consumer_timeout`` (an unacknowledged delivery
older than 30 min closes the channel) and of Redis's ``visibility_timeout``
(redelivery of every message held longer than an hour). An app that sets
``task_acks_late = True`` itself keeps it: our tasks follow the app's setting.

On Redis, the app this module builds (not an app given to ``attach``) also
turns kombu's acknowledgement emulation off (``broker_transport_options =
{"ack_emulation": False}``). The emulation keeps every delivered message in a
Redis hash until its ack, so that it can be handed out again: two synchronous
Redis round trips per message in the worker's main process, half of its time
(py-spy; docs/performance.md), to protect the instants between delivery and the
ack, which early acks make short. Postgres covers them already: a run whose
message was lost stays queued and the sweeper publishes it again after
``MOTIR_REPUBLISH_AFTER``; a warm shutdown still returns reserved messages to
the queue. Redis's visibility timeout then never redelivers anything (one less
way to deliver a run twice). Not on an attached app: its other tasks may count
on the emulation (late acks on Redis do). An app that sets
``broker_transport_options`` itself replaces ours.

On ``redis://`` it also reads through ``guard.GuardedRedisTransport``, on
``amqp://`` through ``guard.GuardedAMQPTransport`` (``broker_transport``): an item
a worker cannot decode or take as a task is moved to ``<queue>.malformed`` with an
ERROR line, where Celery would end the worker. An attached app opts in by setting
``broker_transport`` itself. Not on ``rediss://`` or ``amqps://``: a
``broker_transport`` replaces the URL's scheme, and with it kombu's TLS default
(untested here, so left as kombu has it).

Task events are left as Celery leaves them, off: publishing them synchronously
costs the worker's main process a third to a half of its CPU. Flower (its
default ``--enable_events``) switches them on in the workers it sees while it
runs; ``-E`` or ``worker_send_task_events = True`` keeps them on always, and
``task_send_sent_event = True`` adds ``task-sent`` from the publisher.

**Engines.** ``attach(app)`` hosts an engine (``core/engine.py``) on the app — a new one, or
the one it is given — and makes it current: the app's tasks run their runs through it
(``engine_of(app)``), and ``job.delay()`` publishes through the app. The default engine (what
``current()`` builds when no code attached an app) gets the default app on its first message:
built from the environment (``settings.py``) by ``create_app``, never at import.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import weakref
from dataclasses import asdict
from typing import Any, Callable

from celery import Celery, signals
from celery.exceptions import Retry

from motir_celery.adapter import tasks, unknown
from motir_celery.adapter.backend import BACKEND
from motir_celery.adapter.guard import GUARDED_AMQP_TRANSPORT
from motir_celery.adapter.messages import GUARDED_TRANSPORT, CeleryHost, engine_of, host, hosted, hosts
from motir_celery.adapter.protocol import run_to_execute
from motir_celery.adapter.worker import EngineStep, engine_thread
from motir_celery.core.current import current, default, make_current, peek
from motir_celery.core.engine import Engine, Tuning
from motir_celery.core.jobs import TASK_OPTIONS, Job, find_job, on_job_defined
from motir_celery.core.publish import Host
from motir_celery.errors import ConfigurationError, RunFailed
from motir_celery.settings import Settings

__all__ = ["create_app", "control_app", "attach", "default_app", "default_engine", "engine_of", "import_jobs", "run_job"]

log = logging.getLogger("motir_celery.celery")

def default_engine(settings: Settings | None = None) -> Engine:
    """An engine whose Celery app is built by ``create_app`` on its first message: what
    ``current()`` builds when no code attached an app (the package's face names it, with the
    environment's settings), and an operator tool's (the dashboard's) with its own settings."""
    return Engine(settings, host_factory=_default_host)


def _default_host(engine: Engine) -> Host:
    # Built on the engine's first message: hosting it on its app does not make it current over
    # the engine made current since (the test kit's, an attached app's).
    return _host_of(create_app(engine=engine, current=False))


def _host_of(app: Celery) -> CeleryHost:
    """The host of attached ``app``."""
    found = hosted(app)
    if found is None:
        raise ConfigurationError(f"Celery app {app.main!r} is not attached (motir_celery.attach(app))")
    return found


def default_app() -> Celery:
    """The app the current engine publishes through — the one given to ``motir_celery.attach``,
    else ours, built from the environment on first use (also while the test kit's engine is
    current) — with its job modules imported (a producer fans an event out to the jobs it knows)."""
    hosted = current().host
    if not isinstance(hosted, CeleryHost):
        hosted = default().host
        assert isinstance(hosted, CeleryHost)
    import_jobs(hosted.app)
    return hosted.app


def control_app(settings: Settings) -> Celery:
    """A Celery app on ``settings``' broker for asking the workers (``control.ping``, ``inspect``):
    no engine, no tasks, nothing published (doctor, the metrics' probe)."""
    app = Celery("motir-control", set_as_current=False)
    url = settings.broker_url
    # As create_app: explicit read/write URLs, or $CELERY_BROKER_URL would win over broker_url.
    app.conf.update(broker_url=url, broker_read_url=url, broker_write_url=url)
    return app


def create_app(settings: Settings | None = None, *, main: str = "motir_celery",
               engine: Engine | None = None, current: bool = True) -> Celery:
    """A Celery app of the engine's own, configured from ``settings`` (those of ``engine`` when
    given, else the environment's), with the engine attached (``attach``'s ``current``)."""
    engine = engine if engine is not None else Engine(settings)
    settings = engine.settings
    if not settings.broker_url:
        raise ConfigurationError(
            "CELERY_BROKER_URL is not set: point it at Redis or RabbitMQ, or run through "
            "`make run` / `python -m motir_celery.dev.embedded env` to start an embedded Redis"
        )
    app = Celery(main, set_as_current=False)
    app.conf.update(
        broker_url=settings.broker_url,
        # Celery lets $CELERY_BROKER_URL beat `broker_url` (conf.broker_url reads the
        # environment first), so an app built from explicit settings would publish to
        # whatever the variable says. The read/write URLs are consulted before it.
        broker_read_url=settings.broker_url,
        broker_write_url=settings.broker_url,
        result_backend=settings.result_backend,
        task_ignore_result=settings.result_backend is None,
        task_default_queue=settings.queue,
        broker_connection_retry_on_startup=True,
        timezone="UTC",
        enable_utc=True,
    )
    if settings.broker_url.startswith(("redis://", "rediss://", "redis+socket://")) \
            and not engine.tuning.redis_ack_emulation:
        # No unacknowledged-message bookkeeping in Redis: see the module docstring. Not in
        # attach(): the user's own tasks may rely on it.
        app.conf.broker_transport_options = {"ack_emulation": False}
    if settings.broker_url.startswith("redis://"):
        # A malformed item on a queue's list is moved aside, not fatal (guard.py).
        app.conf.broker_transport = GUARDED_TRANSPORT
    elif settings.broker_url.startswith(("amqp://", "pyamqp://")):
        # The same on RabbitMQ: a message a worker cannot take goes to <queue>.malformed (guard.py).
        app.conf.broker_transport = GUARDED_AMQP_TRANSPORT
    return attach(app, engine=engine, current=current)


def attach(app: Celery, *, settings: Settings | None = None, engine: Engine | None = None,
           tuning: Tuning | None = None, current: bool = True) -> Celery:
    """Host an engine on ``app`` (``engine``, else a new one with ``settings``, else the
    environment's) and, with ``current``, make it current (``job.delay()`` then publishes through
    the app): register every job (and every later one) as a task, run the sweeper in its
    workers, and import ``MOTIR_IMPORTS`` there.

    The job modules are not imported here but when Celery imports the app's own
    (``app.conf.imports``: the ``import_modules`` signal of a worker, beat, ``celery
    shell``), when a producer first publishes through it (``default_app``), or when
    the CLI asks (``import_jobs``): the module that calls ``attach(app)`` may then
    define tasks after the call that the job modules import, and a Django project's
    job modules may import models (Celery sets Django up first). Each is imported the
    way Celery imports ``-A proj``: from the current folder too.
    """
    attached = hosts(app)
    if attached is not None:
        if current:
            make_current(attached)
        return app
    if engine is None:
        engine = Engine(settings, tuning=tuning)
        before = peek()
        if before is not None and before.transactions is not None:
            engine.join_transactions(before.transactions)  # Django's app was ready before this attach
            engine.lend_connections(before.lender)
    engine.host_on(host(app, engine))
    if current:
        make_current(engine)
    for key, value in {
        "worker_prefetch_multiplier": 1,
        # Not task_acks_late, nor task events: Celery's defaults (off); see the module docstring.
    }.items():
        # Ours are defaults: a setting the user made on their own app wins.
        if key not in app.conf.changes:
            app.conf[key] = value
    app.steps["worker"].add(EngineStep)
    # AsyncResult(<run id>) reads the runs table (backend.py): alone on an app with no result
    # backend, before the app's own backend otherwise. Not over a backend class the app chose.
    if app.backend_cls is None:
        app.backend_cls = BACKEND
    # `celery beat` fires the cron jobs through our scheduler (beat.py), unless the
    # user chose a scheduler of their own (then: beat.MotirCronMixin).
    if "beat_scheduler" not in app.conf.changes and app.conf.beat_scheduler == "celery.beat:PersistentScheduler":
        app.conf.beat_scheduler = "motir_celery.beat:MotirScheduler"
    from motir_celery.core import system_jobs  # noqa: F401  (registers system.daily-health-check)
    tasks.install(app)  # @app.task(durable=True): the app's own tasks, durable (tasks.py)
    unknown.install()  # a message of an unknown task: its run to the DLQ, or set aside (unknown.py)
    on_job_defined(_registrar(app))
    signals.import_modules.connect(_on_import_modules, sender=app, weak=False)
    return app


_import_lock = threading.RLock()


def import_jobs(app: Celery) -> None:
    """Import ``MOTIR_IMPORTS`` for attached ``app``, once, with the current folder on ``sys.path``
    while doing so (Celery's ``import_from_cwd``, as for ``-A`` and ``app.conf.imports``)."""
    hosted = _host_of(app)
    with _import_lock:
        if hosted.jobs_imported:
            return
        hosted.jobs_imported = True  # first: a job module that publishes while being imported does not loop
        try:
            for module in hosted.engine.settings.imports:
                app.loader.import_task_module(module)
        except BaseException:
            hosted.jobs_imported = False
            raise


def _on_import_modules(sender: Celery, **_: Any) -> None:
    # After the app's own signal handlers connected before ours (Celery's Django fixup:
    # django.setup()), before app.conf.imports.
    import_jobs(sender)


def run_job(task: Any, job_id: str, run_id: str) -> Any:
    """The entry of every run: the body of each job's Celery task (``task`` is the bound task).
    Claims the run its message names, runs the handler, settles; raises only to show the ending
    in Celery's own terms (FAILURE, RETRY), the settle being committed already. Returns what the
    handler returned when the run succeeded (Flower's result column), else how it ended."""
    worker = f"{task.request.hostname or 'worker'}/{os.getpid()}"
    engine = engine_of(task.app)
    engine_thread().ensure(engine)  # this process's heartbeats (a prefork child's first run starts them)
    outcome = engine.execute(run_id, job_id=job_id, worker=worker)
    if outcome.state == "failed":
        # Settled already (failed + DLQ row, committed). Raising only makes the
        # task show as FAILURE in Flower and Celery's events; the message is
        # acknowledged all the same (late acks too ack failures), so it is not redelivered.
        raise RunFailed(f"run {outcome.run_id} of {job_id} failed for good; DLQ entry {outcome.detail}")
    if outcome.state == "retrying":
        # Settled already: queued again for its next attempt, whose message the runner
        # published (or the sweeper will). Raising Retry only makes the task end in
        # state RETRY (Flower's "Retried", the task-retried event, the task_retry
        # signal): Celery sends a new message in Task.retry(), never for a Retry raised
        # by the task itself, and acknowledges this one as for any ending.
        raise Retry(f"run {outcome.run_id} of {job_id}: attempt failed, next attempt {outcome.detail}")
    if outcome.state == "succeeded":
        return outcome.result
    ending = asdict(outcome)
    del ending["result"]
    return ending


def _registrar(app: Celery) -> Callable[[Job], bool]:
    """Registers each job as a task of ``app`` while the app lives (a weak reference: an app a
    process drops, a test's, is not kept by the job registry)."""
    ref = weakref.ref(app)

    def register(job: Job) -> bool:
        found = ref()
        if found is None:
            return False
        _register(found, job)
        return True

    return register


def _register(app: Celery, job: Job) -> None:
    # Our own record, not `name in app.tasks`: that would finalize the app early,
    # and a job re-defined before finalization would be queued twice.
    names = _host_of(app).task_names
    # (priority= is ours, 0-9 higher first; messages.publisher maps it per broker.)
    options = {k: job.options[k] for k in TASK_OPTIONS if k in job.options}
    # Its Celery name, then its alias motir.<job_id>. A durable Celery task's own name is the
    # app's task (tasks.py): only its alias is ours (run messages under MOTIR_PUBLISH_ALIAS).
    for name in job.task_names[1:] if job.celery else job.task_names:
        if name in names:
            continue
        names.add(name)
        # durable=False: the engine's own task, never made durable by motir_durable_tasks (tasks.py).
        app.task(name=name, bind=True, shared=False, durable=False, **options)(_task_of(job))


def _task_of(defined: Job) -> Any:
    def task(self: Any, *args: Any, **kwargs: Any) -> Any:
        job = find_job(defined.id) or defined  # the current definition (a module imported again)
        if self.request.called_directly:  # app.tasks[name](...): no message, the body inline
            return job(*args, **kwargs)
        run_id = run_to_execute(engine_of(self.app), self.request, job, args, kwargs)
        if run_id is None:
            return {"run_id": None, "state": "skipped", "detail": "nothing to run (see the log line above)"}
        return run_job(self, job.id, run_id)

    task.__name__ = task.__qualname__ = "run_" + re.sub(r"\W", "_", defined.id)
    task.__doc__ = (f"Run of motir job {defined.id!r}: claim, steps, settle (celery_app.run_job); a message in "
                    "Celery's protocol is adopted as a run first (protocol.py).")
    # shared=False: every app registers its own jobs here; a shared task would be
    # registered again by every later app of the process (DuplicateTaskNameWarning).
    return task
