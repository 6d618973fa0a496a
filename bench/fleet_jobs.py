"""The fleet bench's job (``bench/fleet.py``): two steps, each recorded in a side-effect ledger.

Each step body first inserts a row ``(run_id, step, attempt, host, pid)`` into
``bench.side_effect`` — on the bench's own database, through the same PgBouncer
as the engine, on one connection kept per process — so "each step executed
once" is counted from what really ran, not from what the engine says it stored.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

import psycopg

from motir_celery import define_job

__all__ = ["two_steps", "LEDGER_DDL"]

LEDGER_DDL = (
    "CREATE SCHEMA IF NOT EXISTS bench;"
    " CREATE TABLE IF NOT EXISTS bench.side_effect ("
    " id bigserial PRIMARY KEY, run_id text NOT NULL, step text NOT NULL, attempt int NOT NULL,"
    " host text NOT NULL, pid int NOT NULL, at timestamptz NOT NULL DEFAULT now())"
)

_local = threading.local()


def _ledger() -> psycopg.Connection[Any]:
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed or getattr(_local, "pid", None) != os.getpid():
        dsn = os.environ["MOTIR_DATABASE_URL"].replace("postgresql+psycopg://", "postgresql://", 1)
        # prepare_threshold=None: through a transaction pooler, as the engine's own connections.
        conn = psycopg.connect(dsn, autocommit=True, prepare_threshold=None, application_name="fleet-ledger")
        _local.conn, _local.pid = conn, os.getpid()
    return conn


def _effect(event: Any, name: str) -> dict[str, str]:
    host = os.environ.get("BENCH_HOST") or socket.gethostname()
    _ledger().execute("INSERT INTO bench.side_effect (run_id, step, attempt, host, pid) VALUES (%s, %s, %s, %s, %s)",
                      (str(event.run_id), name, event.attempt, host, os.getpid()))
    return {"step": name, "host": host}


@define_job("fleet.two", event="fleet.two", retry_policy="transient")
def two_steps(event: Any, step: Any) -> int:
    step.run("one", _effect, event, "one")
    step.run("two", _effect, event, "two")
    return int(event.data["n"])
