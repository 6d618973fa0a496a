"""End-to-end throughput: durable 3-step runs vs plain Celery, measured in the same run.

    make bench-throughput            # or: python -m bench.throughput --runs 2000 --repeat 3

Both sides: one `celery worker` process, prefork, concurrency 2, prefetch 1,
acks late, on the same broker. The clock starts when the first message is
published and stops when the last run is final (durable: every run
``succeeded`` in Postgres; plain: a Redis counter reaches N). Runs for the
durable side are created beforehand (not timed), so both sides time the same
thing: publish N messages and drain them. Medians of ``--repeat`` rounds,
sides alternating so drift on a shared machine hits both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import redis
from sqlalchemy import create_engine, make_url, text

ROOT = Path(__file__).resolve().parent.parent


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(ROOT), **extra})
    return env


@contextmanager
def worker(app: str, queue: str, concurrency: int, env: dict[str, str]) -> Iterator[None]:
    log = Path(f"/tmp/bench-worker-{queue}.log")
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", app, "worker", "-l", "WARNING", "-c", str(concurrency),
             "-P", "prefork", "-Q", queue, "-n", f"{queue}@%h", "--without-gossip", "--without-mingle"],
            stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        )
    try:
        time.sleep(4)  # -l WARNING hides "ready."; give the pool time to fork and connect
        if proc.poll() is not None:
            raise RuntimeError(log.read_text())
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def bench_database(server_url: str) -> str:
    server = make_url(server_url)
    name = "motir_bench"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    url = server.set(database=name).render_as_string(hide_password=False)
    from motir_celery.migrate import upgrade

    upgrade(url)
    return url


def durable_round(n: int, url: str) -> float:
    from motir_celery import events
    from motir_celery.celery_app import default_app, publisher

    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE job_run_dlq, job_step, job_run, job_queue, job_event CASCADE"))
    run_ids = [events.send_event("bench.three", {"n": i}).run_ids[0] for i in range(n)]  # not timed
    publish = publisher(default_app())
    start = time.perf_counter()
    for run_id in run_ids:
        publish(run_id, "bench.three", 0.0)
    while True:
        with engine.connect() as conn:
            done = conn.execute(text("SELECT count(*) FROM job_queue WHERE state = 'succeeded'")).scalar_one()
        if done >= n:
            break
        time.sleep(0.05)
    elapsed = time.perf_counter() - start
    engine.dispose()
    return n / elapsed


def plain_round(n: int, broker: str) -> float:
    from bench.plain_app import app

    counter = redis.Redis.from_url(os.environ.get("BENCH_COUNTER_URL", broker))
    key = f"bench-plain-{uuid.uuid4().hex}"
    start = time.perf_counter()
    for i in range(n):
        app.send_task("bench.plain", args=[i, key])
    while int(counter.get(key) or 0) < n:
        time.sleep(0.05)
    elapsed = time.perf_counter() - start
    counter.delete(key)
    return n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()

    broker = os.environ["CELERY_BROKER_URL"]
    url = bench_database(os.environ["MOTIR_DATABASE_URL"])
    os.environ.update(MOTIR_DATABASE_URL=url, MOTIR_IMPORTS="bench.workload", MOTIR_QUEUE="bench-motir")
    from motir_celery.settings import reset_settings

    reset_settings()
    import bench.workload  # noqa: F401

    durable: list[float] = []
    plain: list[float] = []
    with worker("motir_celery", "bench-motir", args.concurrency, _env()), \
            worker("bench.plain_app", "bench-plain", args.concurrency, _env()):
        plain_round(100, broker)  # warm both pools
        durable_round(100, url)
        for _ in range(args.repeat):
            durable.append(durable_round(args.runs, url))
            plain.append(plain_round(args.runs, broker))

    d, p = statistics.median(durable), statistics.median(plain)
    print(f"\nthroughput, {args.runs} runs x {args.repeat} rounds, 1 worker x concurrency {args.concurrency}, "
          f"broker {broker.split('://')[0]}")
    print(f"{'side':<38} {'runs/s (median)':>16} {'rounds':>28}")
    print(f"{'plain Celery, 3 functions, no durability':<38} {p:>16.1f} {str([round(x) for x in plain]):>28}")
    print(f"{'motir-celery, 3 durable steps':<38} {d:>16.1f} {str([round(x) for x in durable]):>28}")
    print(f"ratio durable / plain: {d / p:.2f}")


if __name__ == "__main__":
    main()
