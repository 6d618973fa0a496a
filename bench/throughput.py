"""Throughput and latency of the Celery sides (durable and plain), and pgbench's ceiling.

    python -m bench.throughput --runs 2000 --rounds 3     # this section alone; `python -m bench` runs all

Throughput: N runs are queued first (durable: the rows, then one message per
run through the engine's publisher; plain: N messages), then the workers start
and drain them. The rate is taken from each run's completion instant (durable:
``finished_at`` written by the settle; plain: a Redis hash the task writes) over
the 5%..95% span of the drain (``bench.stats.drain_rate``). Both sides run
prefork ``celery worker`` processes with prefetch 1 and early acks. The durable
side's app has kombu's Redis ack emulation off (``celery_app.create_app``); plain
Celery keeps Celery's default, and ``plain_round(env=...)`` with
``BENCH_NO_ACK_EMULATION=1`` runs it with the same setting.

Latency: workers up; one event every ``interval`` seconds; enqueue->completion
is the completion instant minus the instant just before ``send_event`` (plain:
before ``send_task``). One host clock for both ends.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time
import uuid
from typing import Any

import redis
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.pool import NullPool

from bench.common import MOTIR_QUEUE, PLAIN_QUEUE, celery_workers, child_env, purge, succeeded, truncate, wait_for
from bench.stats import drain_rate, percentile

_PREQUEUE = text(
    """
    WITH ev AS (
      INSERT INTO job_event (name, data)
      SELECT :event, jsonb_build_object('n', g) FROM generate_series(1, :n) g
      RETURNING id, name
    )
    INSERT INTO job_queue (event_id, job_id, event_name, max_attempts, retry_policy)
    SELECT id, :job, name, :max_attempts, :policy FROM ev
    RETURNING id
    """
)


def _redis() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("BENCH_COUNTER_URL", os.environ["CELERY_BROKER_URL"]))


def prequeue_motir(url: str, n: int, job: str = "bench.three") -> list[uuid.UUID]:
    """The rows send_event would write for ``n`` events (one statement, not timed), then one message each."""
    from motir_celery.adapter.celery_app import default_app, publisher
    from motir_celery.core.jobs import get_job

    policy = get_job(job).retry_policy
    engine = create_engine(url, poolclass=NullPool)
    with engine.begin() as conn:
        ids = list(conn.execute(_PREQUEUE, {"event": job, "n": n, "job": job, "max_attempts": policy.max_attempts,
                                            "policy": policy.name}).scalars())
    engine.dispose()
    publish = publisher(default_app())
    for run_id in ids:
        publish(run_id, job, 0.0)
    return ids


def motir_round(url: str, n: int, workers: int, concurrency: int, *, timeout: float = 900,
                env: dict[str, str] | None = None, app: str = "motir_celery") -> float:
    from motir_celery.adapter.celery_app import default_app

    truncate(url)
    purge(default_app(), MOTIR_QUEUE)
    prequeue_motir(url, n)
    with celery_workers(app, MOTIR_QUEUE, workers, concurrency, env, tag="motir") as procs:
        wait_for(lambda: succeeded(url) >= n, procs, timeout=timeout, tag="motir", poll=0.25)
    engine = create_engine(url, poolclass=NullPool)
    with engine.connect() as conn:
        finished = list(conn.execute(text(
            "SELECT extract(epoch FROM finished_at)::float8 FROM job_queue WHERE state = 'succeeded'")).scalars())
        bad = conn.execute(text("SELECT count(*) FROM job_queue WHERE state <> 'succeeded'")).scalar_one()
    engine.dispose()
    if bad:
        raise RuntimeError(f"{bad} durable runs did not succeed")
    return drain_rate(finished)


def plain_round(n: int, workers: int, concurrency: int, *, timeout: float = 900,
                env: dict[str, str] | None = None) -> float:
    from bench.plain_app import app

    r = _redis()
    key = f"bench-plain-{uuid.uuid4().hex}"
    purge(app, PLAIN_QUEUE)
    for i in range(n):
        app.send_task("bench.plain", args=[i, key], queue=PLAIN_QUEUE)
    try:
        with celery_workers("bench.plain_app", PLAIN_QUEUE, workers, concurrency, env, tag="plain") as procs:
            wait_for(lambda: r.hlen(key) >= n, procs, timeout=timeout, tag="plain", poll=0.25)
        return drain_rate([float(v) for v in r.hvals(key)])
    finally:
        r.delete(key)


def motir_latency(url: str, events: int, interval: float, concurrency: int,
                  env: dict[str, str] | None = None, app: str = "motir_celery") -> dict[str, float]:
    import motir_celery

    try:
        from motir_celery.adapter.celery_app import default_app
    except ModuleNotFoundError:  # the sender of a --baseline from before the layers' folders (bench/__main__.py)
        from motir_celery.celery_app import default_app  # type: ignore[no-redef]

    truncate(url)
    purge(default_app(), MOTIR_QUEUE)
    engine = create_engine(url, poolclass=NullPool)
    sent: dict[uuid.UUID, float] = {}
    with celery_workers(app, MOTIR_QUEUE, 1, concurrency, env, tag="motir-lat") as procs:
        motir_celery.send_event("bench.three", {"n": -1})
        wait_for(lambda: succeeded(url) >= 1, procs, timeout=120, tag="motir-lat")  # workers are up
        start = time.perf_counter()
        for i in range(events):
            t = time.time()
            sent[motir_celery.send_event("bench.three", {"n": i}).run_ids[0]] = t
            time.sleep(max(0.0, start + (i + 1) * interval - time.perf_counter()))
        wait_for(lambda: succeeded(url) >= events + 1, procs, timeout=120, tag="motir-lat")
    with engine.connect() as conn:
        done = dict(conn.execute(text(
            "SELECT id, extract(epoch FROM finished_at)::float8 FROM job_queue WHERE state = 'succeeded'")).all())
    engine.dispose()
    lat = [done[run_id] - t for run_id, t in sent.items()]
    return {"p50": percentile(lat, 50), "p99": percentile(lat, 99), "n": len(lat)}


def plain_latency(events: int, interval: float, concurrency: int) -> dict[str, float]:
    from bench.plain_app import app

    r = _redis()
    key = f"bench-plain-lat-{uuid.uuid4().hex}"
    purge(app, PLAIN_QUEUE)
    sent: dict[str, float] = {}
    try:
        with celery_workers("bench.plain_app", PLAIN_QUEUE, 1, concurrency, tag="plain-lat") as procs:
            app.send_task("bench.plain", args=[-1, key], queue=PLAIN_QUEUE)
            wait_for(lambda: r.hlen(key) >= 1, procs, timeout=120, tag="plain-lat")
            start = time.perf_counter()
            for i in range(events):
                sent[str(i)] = time.time()
                app.send_task("bench.plain", args=[i, key], queue=PLAIN_QUEUE)
                time.sleep(max(0.0, start + (i + 1) * interval - time.perf_counter()))
            wait_for(lambda: r.hlen(key) >= events + 1, procs, timeout=120, tag="plain-lat")
        done = {k.decode(): float(v) for k, v in r.hgetall(key).items()}
    finally:
        r.delete(key)
    lat = [done[i] - t for i, t in sent.items()]
    return {"p50": percentile(lat, 50), "p99": percentile(lat, 99), "n": len(lat)}


def pgbench(url: str, clients: int, seconds: int) -> dict[str, Any]:
    """Commits/s of a one-row INSERT per transaction at ``clients`` connections: the ceiling."""
    u = make_url(url)
    engine = create_engine(url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE IF EXISTS bench_pgbench"))
        conn.execute(text("CREATE TABLE bench_pgbench (id bigserial PRIMARY KEY, v int NOT NULL, "
                          "at timestamptz NOT NULL DEFAULT now())"))
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as fh:
        fh.write("INSERT INTO bench_pgbench (v) VALUES (1);\n")
    env = child_env()
    if u.password:
        env["PGPASSWORD"] = u.password
    try:
        out = subprocess.run(
            ["pgbench", "-n", "-c", str(clients), "-j", str(clients), "-T", str(seconds), "-f", fh.name,
             "-h", u.host or "127.0.0.1", "-p", str(u.port or 5432), "-U", u.username or "postgres", u.database or ""],
            capture_output=True, text=True, env=env, check=True,
        ).stdout
    finally:
        os.unlink(fh.name)
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE IF EXISTS bench_pgbench"))
        engine.dispose()
    tps = float(re.search(r"tps = ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    return {"tps": tps, "clients": clients}


def main() -> None:
    from bench.__main__ import prepare_environment
    from bench.stats import median

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--rounds", "--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()
    url = prepare_environment()
    durable, plain = [], []
    for _ in range(args.rounds):
        durable.append(motir_round(url, args.runs, args.workers, args.concurrency))
        plain.append(plain_round(args.runs, args.workers, args.concurrency))
    d, p = median(durable), median(plain)
    print(f"throughput, {args.runs} runs x {args.rounds} rounds, {args.workers} worker(s) x concurrency {args.concurrency}")
    print(f"  plain Celery   {p:8.1f} runs/s  {[round(x) for x in plain]}")
    print(f"  motir-celery   {d:8.1f} runs/s  {[round(x) for x in durable]}")
    print(f"  ratio durable / plain: {d / p:.2f}")


if __name__ == "__main__":
    main()
