"""DBOS Transact running the same three functions as a workflow of three ``@DBOS.step``s.

A worker process (``python -m bench.peers.dbos_app``, until SIGTERM) on queue ``bench``, tuned by the
driver's environment: ``BENCH_DBOS_CONCURRENCY`` (its ``worker_concurrency``), ``BENCH_DBOS_POLL`` (its
``polling_interval_sec``), and an ``executor_id`` of its own, which a per-worker concurrency needs.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from dbos import DBOS, DBOSConfig

from bench.functions import charge, notify, reserve

APP, VERSION, QUEUE = "motirbench", "bench-1", "bench"


@DBOS.step()
def step_reserve(n: int) -> dict[str, int]:
    return reserve(n)


@DBOS.step()
def step_charge(n: int) -> dict[str, int]:
    return charge(n)


@DBOS.step()
def step_notify(n: int) -> dict[str, int]:
    return notify(n)


@DBOS.workflow()
def three(n: int) -> dict[str, Any]:
    a = step_reserve(n)
    b = step_charge(a["reserved"])
    return step_notify(b["charged"])


def main() -> None:
    config: DBOSConfig = {"name": APP, "system_database_url": os.environ["BENCH_PEER_URL"], "application_version": VERSION,
                          "executor_id": os.environ.get("BENCH_DBOS_EXECUTOR", "bench-0"), "log_level": "WARNING",
                          "notification_listener_polling_interval_sec": 0.01}
    DBOS(config=config)
    DBOS.launch()
    DBOS.register_queue(
        QUEUE,
        worker_concurrency=int(os.environ.get("BENCH_DBOS_CONCURRENCY", "2")),
        polling_interval_sec=float(os.environ.get("BENCH_DBOS_POLL", "0.01")),
        on_conflict="always_update",
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("ready", flush=True)
    stop.wait()
    DBOS.destroy()


if __name__ == "__main__":
    main()
