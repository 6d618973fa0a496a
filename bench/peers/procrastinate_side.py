"""Procrastinate side: ``throughput`` and ``latency``; prints one JSON object.

    python -m bench.peers.procrastinate_side throughput --admin-dsn DSN --runs 5000 --workers 1 --concurrency 2 --rounds 3
    python -m bench.peers.procrastinate_side latency --admin-dsn DSN --events 250 --interval 0.02

Workers: ``procrastinate worker`` processes (asyncio; the sync task runs in a
thread), ``--concurrency`` jobs at once each, LISTEN/NOTIFY on (its default).
"""

from __future__ import annotations

import argparse
import os
import time

import psycopg

from bench import harness as h
from bench.peers import PYTHON, arguments, count, database, emit, processes

DB = "motir_bench_procrastinate"
DONE = "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
FINISHED = "SELECT job_id, extract(epoch FROM at)::float8 FROM procrastinate_events WHERE type = 'succeeded'"


def _setup(args: argparse.Namespace, reuse: bool) -> str:
    """A database with Procrastinate's schema (``reuse``: the one a previous call made)."""
    os.environ["BENCH_PEER_DSN"] = dsn = database(args.admin_dsn, DB, reuse=reuse)
    if not reuse:
        from bench.peers.procrastinate_app import app

        with app.open():
            app.schema_manager.apply_schema()
    return dsn


def _start(n: int, concurrency: int, dsn: str) -> h.Procs:
    return processes("procrastinate", [
        [PYTHON, "-m", "procrastinate", "--app", "bench.peers.procrastinate_app.app", "--log-level", "warning",
         "worker", "-q", "bench", "-c", str(concurrency), "-n", f"bench-{i}"] for i in range(n)],
        [{"BENCH_PEER_DSN": dsn}] * n)


def throughput(args: argparse.Namespace) -> None:
    dsn = _setup(args, args.reuse)
    from bench.peers.procrastinate_app import app, three

    rates = []
    for _ in range(args.rounds):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("TRUNCATE procrastinate_jobs CASCADE")
        with app.open():
            for i in range(0, args.runs, 1000):
                three.batch_defer(*({"n": n} for n in range(i, min(args.runs, i + 1000))))
        with _start(args.workers, args.concurrency, dsn) as procs:
            procs.wait(lambda: count(dsn, DONE) >= args.runs, args.timeout)
        with psycopg.connect(dsn) as conn:
            rates.append(h.drain_rate(r[1] for r in conn.execute(FINISHED)))
    emit({"rounds": rates})


def latency(args: argparse.Namespace) -> None:
    dsn = _setup(args, False)
    from bench.peers.procrastinate_app import app, three

    sent: dict[int, float] = {}
    with _start(1, args.concurrency, dsn) as procs, app.open():
        three.defer(n=-1)
        procs.wait(lambda: count(dsn, DONE) >= 1, 60)  # the worker is up
        start = time.perf_counter()
        for i in range(args.events):
            t = time.time()
            sent[three.defer(n=i)] = t
            time.sleep(max(0.0, start + (i + 1) * args.interval - time.perf_counter()))
        procs.wait(lambda: count(dsn, DONE) >= args.events + 1, 120)
    with psycopg.connect(dsn) as conn:
        done = dict(conn.execute(FINISHED).fetchall())
    emit(h.latencies(done, sent))


def main() -> None:
    args = arguments(timeout=600).parse_args()
    {"throughput": throughput, "latency": latency}[args.section](args)


if __name__ == "__main__":
    main()
