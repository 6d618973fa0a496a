"""The worker's side duties: its lease renewer, its heartbeats and its sweeper.

The one place that starts and supervises them:

* the renewer (``adapter/renewer.py``), which renews the leases every process of
  the worker holds from a process that runs no body, so a body holding its
  process's GIL cannot starve them: a thread of the main process under prefork,
  a process of its own under solo and threads; started by ``EngineStep`` (a
  bootstep) in the worker's main process, whose engine thread starts it again if
  it dies;
* one engine thread per process (``forks.per_process``: a prefork child gets its
  own on its first run), ticking about once a second: it keeps in touch with the
  renewer, or renews the process's leases itself while the renewer is away
  (``core/worker/leases.py``); and in the main process (where the solo and threads pools
  also run their runs) it sweeps (``core/sweeper.py``) every
  ``MOTIR_SWEEP_INTERVAL``, through the fleet's sweep slot, so one host per period sweeps;
  and at its first tick it writes the jobs this worker defines into the fleet's registry
  (``core/worker/registry.py``: what the app role's checked functions check a job id
  against), again each tick until the database answers.

Each duty uses a connection of its own (``Engine.side_pool``), so a busy run pool
cannot starve it. A duty that fails is logged and tried again next tick; a
thread that died anyway is started again by the next run.

At the worker's shutdown only the sweep stops. Celery stops this bootstep
before its pool has drained (a warm shutdown finishes the runs in hand), and
those runs still need their heartbeats (measured when the threads pool's ended
here: -3 s on a 3 s lease, and another worker's sweeper could hand them out
again). The renewer ends after the worker's main process, the engine threads
with their processes; a run still unsettled then is its lease's to recover.
"""

from __future__ import annotations

import atexit
import logging
import random
import socket
import threading
import time
from typing import Any, Callable

from celery import bootsteps

from motir_celery.adapter.messages import engine_of
from motir_celery.adapter.renewer import Supervisor
from motir_celery.core.engine import Engine
from motir_celery.core.worker import registry
from motir_celery.forks import per_process

__all__ = ["EngineStep", "engine_thread"]

log = logging.getLogger("motir_celery.worker")


class EngineThread:
    """This process's side duties for one engine: its leases, and in the main process its sweeps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._engine: Engine | None = None
        self._sweep = False
        self._supervise: Callable[[], object] | None = None
        #: The worker whose jobs are still to be written into the registry (None: written, or not asked).
        self._register: str | None = None

    def ensure(self, engine: Engine, *, sweep: bool = False, supervise: Callable[[], object] | None = None,
               register: str | None = None) -> None:
        """Running from now on for ``engine`` (sweeping too, with ``sweep``; calling ``supervise``
        every tick; writing this process's jobs into the registry as worker ``register``)."""
        with self._lock:
            self._engine = engine
            if register is not None:
                self._register = register
            if supervise is not None:
                self._supervise = supervise
            if sweep:
                self._sweep = True
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._loop, name="motir-engine", daemon=True)
                self._thread.start()

    def stop_sweeping(self) -> None:
        """Sweep no more; the heartbeats go on (the runs in hand are still running)."""
        with self._lock:
            self._sweep = False

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        engine = self._engine
        assert engine is not None
        settings = engine.settings
        # Often enough that a renewal due at lease / 3 is never late by more than lease / 6.
        tick = min(1.0, settings.lease_seconds / 6)
        # The first sweep at a random point of the period: workers started together (a deploy)
        # then sweep spread over it rather than all at once, every period after.
        next_sweep = time.monotonic() + random.uniform(0.0, settings.sweep_interval)
        while not self._stop.wait(tick):
            supervise = self._supervise
            if supervise is not None:
                _duty("lease renewer supervision", supervise)
            engine = self._engine or engine
            _duty("lease renewal", engine.leases.renew_due)
            worker = self._register
            if worker is not None and _duty("job registry", lambda: registry.register(engine, worker)):
                self._register = None
            if self._sweep and time.monotonic() >= next_sweep:
                _duty("sweep", lambda: engine.sweep(once_per_period=True))
                next_sweep = time.monotonic() + settings.sweep_interval


def _duty(name: str, fn: Callable[[], object]) -> bool:
    """``fn()``; whether it returned (a failure is logged: a database or broker blip, next tick)."""
    try:
        fn()
    except Exception:  # noqa: BLE001 — a database or broker blip: next tick
        log.warning("%s failed", name, exc_info=True)
        return False
    return True


engine_thread = per_process(EngineThread)


class EngineStep(bootsteps.StartStopStep):
    """In the worker's main process: size the pool for the threads pool, start the
    renewer and the sweeper (and stop the sweeper)."""

    label = "motir engine"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        self.engine = engine = engine_of(worker.app)
        pool = getattr(worker, "pool_cls", None)
        pool_name = pool if isinstance(pool, str) else getattr(pool, "__module__", "") or ""
        # prefork: the main process runs no body, so it can renew (no process more, ~60 MB less RSS)
        prefork = pool_name.endswith(("prefork", "processes"))
        if "thread" in pool_name:
            engine.runs_per_process = max(1, int(worker.concurrency or 1))
        if engine.settings.database_url:
            # The database driver imported now, in the main thread: a pool child forked while
            # the engine thread imports it (its first sweep) inherits that import's lock, held
            # by a thread the child does not have, and hangs at its first run for ever.
            engine.side_pool()
        self.renewer: Supervisor | None = None
        if not hasattr(socket, "AF_UNIX"):  # no Unix sockets (Windows): each process renews its own leases
            return
        # Here, before any pool child is forked (they inherit the socket's path), and
        # started now: it gets ready while the rest of the worker boots.
        logfile = getattr(worker, "logfile", None)  # the worker's --logfile, unless per process (%n, %i...)
        self.renewer = Supervisor(engine, logfile if isinstance(logfile, str) and "%" not in logfile else None,
                                  in_main_process=prefork)
        atexit.register(self.renewer.cleanup)
        limit = getattr(worker, "time_limit", None)
        engine.leases.use_renewer(self.renewer.path,
                                  time_limit=float(limit) if isinstance(limit, (int, float)) else None)
        self.renewer.spawn()

    def start(self, worker: Any) -> None:
        if self.renewer is not None:
            self.renewer.wait()  # before the consumer starts: no run is held before it listens
        engine_thread().ensure(self.engine, sweep=True, supervise=self.renewer.check if self.renewer else None,
                               register=str(getattr(worker, "hostname", None) or socket.gethostname()))

    def stop(self, worker: Any) -> None:
        # Not engine_thread().stop(): this runs before the pool drains (see the module docstring).
        engine_thread().stop_sweeping()
