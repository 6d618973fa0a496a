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

from bench.peers.common import arguments, emit, env, processes, python, recreate_database, wait_until
from bench.stats import drain_rate, percentile

DB = "motir_bench_procrastinate"


def _setup(admin_dsn: str, reuse: bool = False) -> str:
    """A fresh database with Procrastinate's schema (``reuse``: the one a previous call made)."""
    if reuse:
        info = psycopg.conninfo.conninfo_to_dict(admin_dsn)
        info["dbname"] = DB
        dsn = psycopg.conninfo.make_conninfo(**info)
        os.environ["BENCH_PEER_DSN"] = dsn
        return dsn
    dsn = recreate_database(admin_dsn, DB)
    os.environ["BENCH_PEER_DSN"] = dsn
    from bench.peers.procrastinate_app import app

    with app.open():
        app.schema_manager.apply_schema()
    return dsn


def _workers(n: int, concurrency: int, dsn: str) -> list[list[str]]:
    return [
        [python(), "-m", "procrastinate", "--app", "bench.peers.procrastinate_app.app", "--log-level", "warning",
         "worker", "-q", "bench", "-c", str(concurrency), "-n", f"bench-{i}"]
        for i in range(n)
    ]


def _count(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'").fetchone()[0]


def throughput(args: argparse.Namespace) -> None:
    dsn = _setup(args.admin_dsn, args.reuse)
    from bench.peers.procrastinate_app import app, three

    rates = []
    for _ in range(args.rounds):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("TRUNCATE procrastinate_jobs CASCADE")
        with app.open():
            for i in range(0, args.runs, 1000):
                three.batch_defer(*({"n": n} for n in range(i, min(args.runs, i + 1000))))
        with processes(_workers(args.workers, args.concurrency, dsn), env(BENCH_PEER_DSN=dsn), "procrastinate") as procs:
            wait_until(lambda: _count(dsn) >= args.runs, procs, args.timeout, "procrastinate")
        with psycopg.connect(dsn) as conn:
            done = [r[0] for r in conn.execute(
                "SELECT extract(epoch FROM at)::float8 FROM procrastinate_events WHERE type = 'succeeded'")]
        rates.append(drain_rate(done))
    emit({"rounds": rates})


def latency(args: argparse.Namespace) -> None:
    dsn = _setup(args.admin_dsn)
    from bench.peers.procrastinate_app import app, three

    sent: dict[int, float] = {}
    with processes(_workers(1, args.concurrency, dsn), env(BENCH_PEER_DSN=dsn), "procrastinate") as procs, app.open():
        three.defer(n=-1)
        wait_until(lambda: _count(dsn) >= 1, procs, 60, "procrastinate")  # the worker is up
        start = time.perf_counter()
        for i in range(args.events):
            t = time.time()
            sent[three.defer(n=i)] = t
            time.sleep(max(0.0, start + (i + 1) * args.interval - time.perf_counter()))
        wait_until(lambda: _count(dsn) >= args.events + 1, procs, 120, "procrastinate")
    with psycopg.connect(dsn) as conn:
        done = dict(conn.execute(
            "SELECT job_id, extract(epoch FROM at)::float8 FROM procrastinate_events WHERE type = 'succeeded'").fetchall())
    lat = [done[j] - t for j, t in sent.items()]
    emit({"p50": percentile(lat, 50), "p99": percentile(lat, 99), "n": len(lat)})


def main() -> None:
    args = arguments(timeout=600).parse_args()
    {"throughput": throughput, "latency": latency}[args.section](args)


if __name__ == "__main__":
    main()
