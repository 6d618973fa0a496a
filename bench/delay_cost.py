"""Per-call cost of ``job.delay()`` against Celery's own ``task.delay()``, in the same run.

    python -m bench.delay_cost [--calls 2000] [--rounds 5]

No worker: what a call site pays. Celery's ``delay`` publishes one message. Ours writes
the run (one statement in its own flushed transaction: the event with the arguments and
the run), then publishes its message; ``task_id=`` adds nothing on a first call;
``delay_async`` is the same write over psycopg's async connection. The variants take
turns in rounds; the median per call of each and its ratio to Celery's are printed. The
difference is the Postgres commit, which is what makes the run durable.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any, Callable

from celery import Celery

from bench import harness as h
from motir_celery import define_job
from motir_celery.store.db import dispose_engines

PLAIN_QUEUE, MOTIR_QUEUE = "bench-delay-plain", "bench-delay-motir"


async def _timed_async(fn: Callable[[int], Any], calls: int) -> list[float]:
    out = []
    for i in range(calls):
        t0 = time.perf_counter()
        await fn(i)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = h.parser("bench.delay_cost", __doc__, write=None)
    parser.add_argument("--calls", type=int, default=2000, help="calls per variant (default 2000)")
    parser.add_argument("--rounds", type=int, default=5, help="turns the variants take (default 5)")
    opts = parser.parse_args()
    h.need("MOTIR_DATABASE_URL", "CELERY_BROKER_URL")
    with h.Database.create("motir_bench_delay") as db:
        h.use_engine(db.url, MOTIR_QUEUE, imports="")
        plain = Celery("bench_plain", broker=os.environ["CELERY_BROKER_URL"], set_as_current=False)
        plain.conf.update(task_default_queue=PLAIN_QUEUE, task_ignore_result=True)

        @plain.task(name="bench.plain.noop")
        def noop(order_id: int) -> None: ...

        @define_job("bench.delay.noop", retry_policy="none")
        def durable(step: Any, order_id: int) -> None: ...

        n = max(1, opts.calls // opts.rounds)
        variants: dict[str, Callable[[], list[float]]] = {
            "celery task.delay()": lambda: h.timed(lambda i: noop.delay(i), n),
            "motir job.delay()": lambda: h.timed(lambda i: durable.delay(i), n),
            "motir job.apply_async(task_id=)": lambda: h.timed(
                lambda i: durable.apply_async(args=[i], task_id=str(uuid.uuid4())), n),
            "motir await job.delay_async()": lambda: asyncio.run(_timed_async(lambda i: durable.delay_async(i), n)),
        }
        try:
            for warm in variants.values():  # connections, the Redis lane's plan, imports
                warm()
            rounds = h.interleave(variants, opts.rounds)
        finally:
            h.purge_queue(PLAIN_QUEUE)
            h.purge_queue(MOTIR_QUEUE)
            dispose_engines()
    samples = {name: [x for r in rs for x in r] for name, rs in rounds.items()}
    print(f"per-call cost, median of {n * opts.rounds} calls each ({opts.rounds} rounds), us; p99 "
          + ", ".join(f"{k} {h.percentile(v, 99) * 1e6:.0f}" for k, v in samples.items()))
    h.report({k: [h.median(r) for r in rs] for k, rs in rounds.items()}, "celery task.delay()", "us", 1e6, 0)


if __name__ == "__main__":
    main()
