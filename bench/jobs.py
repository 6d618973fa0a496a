"""The durable jobs of the benches beside the suite's (``bench.workload``), one module for MOTIR_IMPORTS:
``fleet.two`` (bench.fleet) and ``retention.live`` (bench.retention).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from motir_celery import define_job
from motir_celery.store import driver

# --- fleet ---------------------------------------------------------------------------------

LEDGER_DDL = (
    "CREATE SCHEMA IF NOT EXISTS bench;"
    " CREATE TABLE IF NOT EXISTS bench.side_effect ("
    " id bigserial PRIMARY KEY, run_id text NOT NULL, step text NOT NULL, attempt int NOT NULL,"
    " host text NOT NULL, pid int NOT NULL, at timestamptz NOT NULL DEFAULT now())"
)
_local = threading.local()


def _effect(event: Any, name: str) -> dict[str, str]:
    """A row of the ledger before the step returns, on a connection of the process's own (through the
    fleet's PgBouncer): "each step executed once" is counted from what ran, not from what was stored."""
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed or getattr(_local, "pid", None) != os.getpid():
        # prepare_threshold=None: through a transaction pooler, as the engine's own connections.
        conn = _local.conn = psycopg.connect(os.environ["MOTIR_DATABASE_URL"].replace("+psycopg", "", 1),
                                             autocommit=True, prepare_threshold=None, application_name="fleet-ledger")
        _local.pid = os.getpid()
    host = os.environ.get("BENCH_HOST") or socket.gethostname()
    conn.execute("INSERT INTO bench.side_effect (run_id, step, attempt, host, pid) VALUES (%s, %s, %s, %s, %s)",
                 (str(event.run_id), name, event.attempt, host, os.getpid()))
    return {"step": name, "host": host}


@define_job("fleet.two", event="fleet.two", retry_policy="transient")
def two_steps(event: Any, step: Any) -> int:
    step.run("one", _effect, event, "one")
    step.run("two", _effect, event, "two")
    return int(event.data["n"])


# --- retention -----------------------------------------------------------------------------

TIMED = ("claim", "store_step", "settle_succeeded")
_rows, _out = driver.rows, {}


def _timed_rows(conn: Any, statement: Any, params: dict[str, Any]) -> list[dict[str, Any]]:
    """With $RETENTION_TIMINGS set, each ``TIMED`` statement's round trip, as the worker sees it, is
    appended to a file of the process's own there (``name wall_end seconds``)."""
    t0 = time.perf_counter()
    try:
        return _rows(conn, statement, params)
    finally:
        if statement.name in TIMED:
            if _out.get("pid") != os.getpid():  # a prefork child: a file of its own
                path = Path(os.environ["RETENTION_TIMINGS"]) / f"{os.getpid()}.txt"
                _out.update(pid=os.getpid(), file=open(path, "a", buffering=1))
            _out["file"].write(f"{statement.name} {time.time():.6f} {time.perf_counter() - t0:.6f}\n")


if os.environ.get("RETENTION_TIMINGS"):
    driver.rows = _timed_rows  # driver.first looks rows up at call time


def _body(n: int, name: str) -> dict[str, Any]:
    return {"step": name, "n": n}


@define_job("retention.live", event="retention.live", retry_policy="transient")
def live(event: Any, step: Any) -> int:
    step.run("one", _body, int(event.data["n"]), "one")
    step.run("two", _body, int(event.data["n"]), "two")
    return int(event.data["n"])
