"""DBOS side: ``throughput`` and ``latency``; prints one JSON object.

    python -m bench.peers.dbos_side throughput --admin-dsn DSN --runs 5000 --workers 2 --concurrency 2 --poll 0.01

Workflows are enqueued with ``DBOSClient`` (one insert each) before the
workers start; each worker is a ``bench.peers.dbos_app`` process with its own
executor id, ``worker_concurrency`` and queue polling interval.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import psycopg

from bench import harness as h
from bench.peers import PYTHON, arguments, count, database, emit, processes

DB = "motir_bench_dbos"
DONE = "SELECT count(*) FROM dbos.workflow_status WHERE status = 'SUCCESS'"


def _url(dsn: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    user = info.get("user", "postgres")
    pw = f":{info['password']}" if info.get("password") else ""
    return f"postgresql://{user}{pw}@{info.get('host', '127.0.0.1')}:{info.get('port', 5432)}/{info['dbname']}"


def _start(n: int, args: argparse.Namespace, url: str) -> h.Procs:
    """``n`` ``bench.peers.dbos_app`` processes, each with its own executor id."""
    return processes("dbos", [[PYTHON, "-m", "bench.peers.dbos_app"]] * n, [
        {"BENCH_PEER_URL": url, "BENCH_DBOS_EXECUTOR": f"bench-{i}", "BENCH_DBOS_CONCURRENCY": str(args.concurrency),
         "BENCH_DBOS_POLL": str(args.poll)} for i in range(n)])


def _setup(args: argparse.Namespace) -> tuple[str, str]:
    dsn = database(args.admin_dsn, DB, reuse=args.reuse)
    if not args.reuse:  # one launch creates DBOS's schema and registers the queue; then it exits
        with _start(1, args, _url(dsn)) as procs:
            procs.wait_logged("ready")
    return dsn, _url(dsn)


def _client(url: str) -> Any:
    from dbos import DBOSClient

    return DBOSClient(system_database_url=url, application_name="motirbench")


def _options() -> dict[str, str]:
    from bench.peers.dbos_app import QUEUE, VERSION

    return {"workflow_name": "three", "queue_name": QUEUE, "app_version": VERSION}


def throughput(args: argparse.Namespace) -> None:
    dsn, url = _setup(args)
    client, options, rates = _client(url), _options(), []
    for _ in range(args.rounds):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("TRUNCATE dbos.workflow_status CASCADE")
        for n in range(args.runs):
            client.enqueue(options, n)
        with _start(args.workers, args, url) as procs:
            procs.wait(lambda: count(dsn, DONE) >= args.runs, args.timeout)
        with psycopg.connect(dsn) as conn:
            rates.append(h.drain_rate(r[0] / 1000 for r in conn.execute(
                "SELECT updated_at FROM dbos.workflow_status WHERE status = 'SUCCESS'")))
    client.destroy()
    emit({"rounds": rates})


def latency(args: argparse.Namespace) -> None:
    dsn, url = _setup(args)
    client, options, sent = _client(url), _options(), {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE dbos.workflow_status CASCADE")
    with _start(1, args, url) as procs:
        client.enqueue(options, -1)
        procs.wait(lambda: count(dsn, DONE) >= 1, 60)
        start = time.perf_counter()
        for i in range(args.events):
            t = time.time()
            sent[client.enqueue(options, i).get_workflow_id()] = t
            time.sleep(max(0.0, start + (i + 1) * args.interval - time.perf_counter()))
        procs.wait(lambda: count(dsn, DONE) >= args.events + 1, 120)
    with psycopg.connect(dsn) as conn:
        done = {r[0]: r[1] / 1000 for r in conn.execute(
            "SELECT workflow_uuid, updated_at FROM dbos.workflow_status WHERE status = 'SUCCESS'")}
    client.destroy()
    emit(h.latencies(done, sent))


def main() -> None:
    args = arguments(timeout=900, poll=(float, 0.01)).parse_args()
    {"throughput": throughput, "latency": latency}[args.section](args)


if __name__ == "__main__":
    main()
