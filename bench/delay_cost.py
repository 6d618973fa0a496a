"""Per-call cost of ``job.delay()`` against Celery's own ``task.delay()``, in the same run.

    MOTIR_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1:5432/postgres \
    CELERY_BROKER_URL=redis://127.0.0.1:6379/0 .venv/bin/python -m bench.delay_cost [--calls 2000]

No worker: what a call site pays. Celery's ``delay`` publishes one message
(kombu). Ours writes the run — one statement, its own committed (flushed)
transaction: the event with the arguments and the run — then publishes its
message; ``task_id=`` adds nothing on a first call; ``delay_async`` is the same
write over psycopg's async connection, awaited one after the other. The
variants take turns in rounds (``--rounds``), so drift of a shared machine
touches all of them; the median per call of each is printed, and the ratio to
Celery's. Informative, not a pass/fail: the difference is the Postgres commit,
which is what makes the run durable (Celery's message alone is not).

A fresh database (``motir_bench_delay``) is created and dropped; the two
queues it publishes to are purged at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from typing import Any, Callable

from bench.common import create_bench_database, drop_database

DB = "motir_bench_delay"
PLAIN_QUEUE, MOTIR_QUEUE = "bench-delay-plain", "bench-delay-motir"


def _timed(fn: Callable[[int], Any], calls: int) -> list[float]:
    out = []
    for i in range(calls):
        started = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - started)
    return out


async def _timed_async(fn: Callable[[int], Any], calls: int) -> list[float]:
    out = []
    for i in range(calls):
        started = time.perf_counter()
        await fn(i)
        out.append(time.perf_counter() - started)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per variant (default 2000)")
    parser.add_argument("--rounds", type=int, default=5, help="turns the variants take (default 5)")
    opts = parser.parse_args()
    broker = os.environ["CELERY_BROKER_URL"]
    os.environ.setdefault("BENCH_SERVER_URL", os.environ["MOTIR_DATABASE_URL"])  # the server, for the drop
    url = create_bench_database(DB)
    os.environ["MOTIR_DATABASE_URL"] = url
    os.environ["MOTIR_QUEUE"] = MOTIR_QUEUE
    from celery import Celery

    import motir_celery
    from motir_celery import define_job
    from motir_celery.settings import reset_settings
    from motir_celery.store.db import dispose_engines

    reset_settings()
    plain = Celery("bench_plain", broker=broker, set_as_current=False)
    plain.conf.update(task_default_queue=PLAIN_QUEUE, task_ignore_result=True)

    @plain.task(name="bench.plain.noop")
    def noop(order_id: int) -> None: ...

    @define_job("bench.delay.noop", retry_policy="none")
    def durable(step: Any, order_id: int) -> None: ...

    motir_app = motir_celery.app  # the engine's app, built from the environment
    per_round = max(1, opts.calls // opts.rounds)
    variants: dict[str, Callable[[int], Any]] = {
        "celery task.delay()": lambda i: noop.delay(i),
        "motir job.delay()": lambda i: durable.delay(i),
        "motir job.apply_async(task_id=)": lambda i: durable.apply_async(args=[i], task_id=str(uuid.uuid4())),
    }
    timings: dict[str, list[float]] = {name: [] for name in [*variants, "motir await job.delay_async()"]}
    try:
        for fn in variants.values():  # warm up: connections, the Redis lane's plan, imports
            _timed(fn, 20)
        asyncio.run(_timed_async(lambda i: durable.delay_async(i), 20))
        for _ in range(opts.rounds):
            for name, fn in variants.items():
                timings[name] += _timed(fn, per_round)
            timings["motir await job.delay_async()"] += asyncio.run(
                _timed_async(lambda i: durable.delay_async(i), per_round))
    finally:
        for app, queue in ((plain, PLAIN_QUEUE), (motir_app, MOTIR_QUEUE)):
            with app.connection_for_write() as conn:
                conn.default_channel.queue_purge(queue)
        dispose_engines()
        drop_database(DB)
    base = statistics.median(timings["celery task.delay()"])
    print(f"per-call cost, median of {per_round * opts.rounds} calls each ({opts.rounds} rounds), broker {broker}:")
    for name, samples in timings.items():
        med = statistics.median(samples)
        p99 = sorted(samples)[int(len(samples) * 0.99) - 1]
        print(f"  {name:34s} {med * 1e6:8.0f} us   p99 {p99 * 1e6:8.0f} us   x{med / base:.2f} of Celery's delay()")


if __name__ == "__main__":
    main()
