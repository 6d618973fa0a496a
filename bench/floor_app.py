"""Celery carrying the engine's statements and nothing else: a durable engine's floor (bench/floor.py).

One task, ``bench.floor(run_id, n)``: the run's claim, its three step records (each body
first waits ``BENCH_FLOOR_IO_SECONDS``, as ``bench/io_jobs.py``'s do) and its settle, sent
on one autocommit connection a process keeps, through the engine's own libpq path; a run
that is not claimed, stored or settled fails the task. ``BENCH_FLOOR_STATEMENTS`` chooses
the set (``bench/floor.py``: the engine's, or the least the invariants need). No runner,
no steps API, no JSON checks, no leases, no sweeper. Delivery as the engine's own app sets
it: early acks, prefetch 1, Redis ack emulation off.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import psycopg
from celery import Celery

from bench.floor import one_run
from bench.harness import dsn

app = Celery("bench_floor", broker=os.environ["CELERY_BROKER_URL"], set_as_current=False)
app.conf.update(worker_prefetch_multiplier=1, task_ignore_result=True, broker_connection_retry_on_startup=True,
                task_default_queue=os.environ.get("BENCH_FLOOR_QUEUE", "bench-floor"),
                broker_transport_options={"ack_emulation": False})
STATEMENTS = os.environ.get("BENCH_FLOOR_STATEMENTS", "engine")
IO_SECONDS = float(os.environ.get("BENCH_FLOOR_IO_SECONDS", "0"))
STEPS = int(os.environ.get("BENCH_FLOOR_STEPS", "3"))
#: This process's connection (a pool child's: made at its first task, after the fork).
_conn: dict[int, psycopg.Connection[Any]] = {}


@app.task(name="bench.floor")
def floor(run_id: str, n: int) -> None:
    conn = _conn.get(os.getpid())
    if conn is None:
        conn = _conn[os.getpid()] = psycopg.connect(dsn(os.environ["MOTIR_DATABASE_URL"]), autocommit=True)
    if not one_run(conn, STATEMENTS, uuid.UUID(run_id), n, f"floor@{os.getpid()}", io_seconds=IO_SECONDS,
                   steps=STEPS):
        raise RuntimeError(f"run {run_id}: a statement wrote nothing")
