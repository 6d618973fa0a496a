"""The worker's side thread: the heartbeats of the runs its process holds, and the sweeper.

The one place that starts and supervises a worker's side duties. One daemon
thread per process (``forks.per_process``: a prefork child gets its own on its
first run), ticking about once a second:

* heartbeats (``core/leases.py``) in every process that runs runs;
* the sweep (``core/sweeper.py``) every ``MOTIR_SWEEP_INTERVAL`` in the worker's
  main process (``EngineStep``, a bootstep), where the solo and threads pools
  also run their runs; through the fleet's sweep slot, so one host per period sweeps.

Each duty uses a connection of its own (``db.side_engine``), so a busy run pool
cannot starve it. A duty that fails is logged and tried again next tick; a
thread that died anyway is started again by the next run.

At the worker's shutdown only the sweep stops. Celery stops this bootstep
before its pool has drained (a warm shutdown finishes the runs in hand), and
in the solo and threads pools those runs' heartbeats are this thread's: stopped
with it, their leases ran out mid-run (measured: -3 s on a 3 s lease) and
another worker's sweeper could hand them out again. The heartbeats end with
the process (a daemon thread); a run still unsettled then is its lease's to
recover.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any, Callable

from celery import bootsteps

from motir_celery.adapter.messages import publisher
from motir_celery.core import leases, sweeper
from motir_celery.core.publish import Publish
from motir_celery.forks import per_process
from motir_celery.settings import get_settings
from motir_celery.store.db import size_pool_for

__all__ = ["EngineStep", "engine_thread"]

log = logging.getLogger("motir_celery.worker")


class EngineThread:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._sweep: Callable[[], object] | None = None

    def ensure(self, publish: Publish | None = None) -> None:
        """Running from now on (sweeping too, with ``publish``)."""
        with self._lock:
            if publish is not None:
                settings = get_settings()
                self._sweep = lambda: sweeper.sweep(publish, settings=settings, once_per_period=True)
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._loop, name="motir-engine", daemon=True)
                self._thread.start()

    def stop_sweeping(self) -> None:
        """Sweep no more; the heartbeats go on (the runs in hand are still running)."""
        with self._lock:
            self._sweep = None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        settings = get_settings()
        # Often enough that a renewal due at lease / 3 is never late by more than lease / 6.
        tick = min(1.0, settings.lease_seconds / 6)
        # The first sweep at a random point of the period: workers started together (a deploy)
        # then sweep spread over it rather than all at once, every period after.
        next_sweep = time.monotonic() + random.uniform(0.0, settings.sweep_interval)
        while not self._stop.wait(tick):
            _duty("lease renewal", leases.renew_due)
            sweep = self._sweep
            if sweep is not None and time.monotonic() >= next_sweep:
                _duty("sweep", sweep)
                next_sweep = time.monotonic() + settings.sweep_interval


def _duty(name: str, fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 — a database or broker blip: next tick
        log.warning("%s failed", name, exc_info=True)


engine_thread = per_process(EngineThread)


class EngineStep(bootsteps.StartStopStep):
    """In the worker's main process: size the pool for the threads pool, start the sweeper (and stop it)."""

    label = "motir engine"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        pool = getattr(worker, "pool_cls", None)
        pool_name = pool if isinstance(pool, str) else getattr(pool, "__module__", "") or ""
        if "thread" in pool_name:
            size_pool_for(int(worker.concurrency or 1))

    def start(self, worker: Any) -> None:
        engine_thread().ensure(publisher(worker.app))

    def stop(self, worker: Any) -> None:
        # Not engine_thread().stop(): this runs before the pool drains (see the module docstring).
        engine_thread().stop_sweeping()
