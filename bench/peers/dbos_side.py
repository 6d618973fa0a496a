"""DBOS side: ``throughput`` and ``latency``; prints one JSON object.

    python -m bench.peers.dbos_side throughput --admin-dsn DSN --runs 5000 --workers 2 --concurrency 2 --poll 0.01

Workflows are enqueued with ``DBOSClient`` (one insert each) before the
workers start; each worker is a ``bench.peers.dbos_app`` process with its own
executor id, ``worker_concurrency`` and queue polling interval.
"""

from __future__ import annotations

import argparse
import time

import psycopg

from bench.peers.common import arguments, emit, env, processes, python, recreate_database, wait_until
from bench.stats import drain_rate, percentile

DB = "motir_bench_dbos"


def _url(dsn: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    user = info.get("user", "postgres")
    pw = f":{info['password']}" if info.get("password") else ""
    return f"postgresql://{user}{pw}@{info.get('host', '127.0.0.1')}:{info.get('port', 5432)}/{info['dbname']}"


def _workers(n: int, args: argparse.Namespace, url: str) -> tuple[list[list[str]], list[dict[str, str]]]:
    return [[python(), "-m", "bench.peers.dbos_app"]] * n, [
        env(BENCH_PEER_URL=url, BENCH_DBOS_EXECUTOR=f"bench-{i}", BENCH_DBOS_CONCURRENCY=str(args.concurrency),
            BENCH_DBOS_POLL=str(args.poll))
        for i in range(n)
    ]


def _start(n: int, args: argparse.Namespace, url: str):  # type: ignore[no-untyped-def]
    cmds, envs = _workers(n, args, url)
    return processes(cmds, envs, "dbos")


def _setup(args: argparse.Namespace) -> tuple[str, str]:
    if args.reuse:
        info = psycopg.conninfo.conninfo_to_dict(args.admin_dsn)
        info["dbname"] = DB
        dsn = psycopg.conninfo.make_conninfo(**info)
        return dsn, _url(dsn)
    dsn = recreate_database(args.admin_dsn, DB)
    url = _url(dsn)
    # One launch creates DBOS's schema and registers the queue; then it exits.
    with _start(1, args, url) as procs:
        wait_until(lambda: _ready(), procs, 120, "dbos")
    return dsn, url


def _ready() -> bool:
    try:
        return "ready" in open("/tmp/bench-dbos-0.log").read()
    except FileNotFoundError:
        return False


def _count(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT count(*) FROM dbos.workflow_status WHERE status = 'SUCCESS'").fetchone()[0]


def _client(url: str):  # type: ignore[no-untyped-def]
    from dbos import DBOSClient

    return DBOSClient(system_database_url=url, application_name="motirbench")


def _options() -> dict[str, str]:
    from bench.peers.dbos_app import QUEUE, VERSION

    return {"workflow_name": "three", "queue_name": QUEUE, "app_version": VERSION}


def throughput(args: argparse.Namespace) -> None:
    dsn, url = _setup(args)
    client = _client(url)
    options = _options()
    rates = []
    for _ in range(args.rounds):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("TRUNCATE dbos.workflow_status CASCADE")
        for n in range(args.runs):
            client.enqueue(options, n)  # type: ignore[arg-type]
        with _start(args.workers, args, url) as procs:
            wait_until(lambda: _count(dsn) >= args.runs, procs, args.timeout, "dbos")
        with psycopg.connect(dsn) as conn:
            done = [r[0] / 1000 for r in conn.execute(
                "SELECT updated_at FROM dbos.workflow_status WHERE status = 'SUCCESS'")]
        rates.append(drain_rate(done))
    client.destroy()
    emit({"rounds": rates})


def latency(args: argparse.Namespace) -> None:
    dsn, url = _setup(args)
    client = _client(url)
    options = _options()
    sent: dict[str, float] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE dbos.workflow_status CASCADE")
    with _start(1, args, url) as procs:
        client.enqueue(options, -1)  # type: ignore[arg-type]
        wait_until(lambda: _count(dsn) >= 1, procs, 60, "dbos")
        start = time.perf_counter()
        for i in range(args.events):
            t = time.time()
            sent[client.enqueue(options, i).get_workflow_id()] = t  # type: ignore[arg-type]
            time.sleep(max(0.0, start + (i + 1) * args.interval - time.perf_counter()))
        wait_until(lambda: _count(dsn) >= args.events + 1, procs, 120, "dbos")
    with psycopg.connect(dsn) as conn:
        done = {r[0]: r[1] / 1000 for r in conn.execute(
            "SELECT workflow_uuid, updated_at FROM dbos.workflow_status WHERE status = 'SUCCESS'")}
    client.destroy()
    lat = [done[w] - t for w, t in sent.items()]
    emit({"p50": percentile(lat, 50), "p99": percentile(lat, 99), "n": len(lat)})


def main() -> None:
    args = arguments(timeout=900, poll=(float, 0.01)).parse_args()
    {"throughput": throughput, "latency": latency}[args.section](args)


if __name__ == "__main__":
    main()
