"""Plain Celery running the same three functions, no durability: the transport's floor.

Completion is counted with one Redis INCR per task (the durable side's
equivalent is its settle), so the drain can be timed without a result backend.
"""

from __future__ import annotations

import os

import redis
from celery import Celery

from bench.workload import charge, notify, reserve

app = Celery("bench_plain", broker=os.environ["CELERY_BROKER_URL"], set_as_current=False)
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    task_default_queue="bench-plain",
)
_counter = redis.Redis.from_url(os.environ.get("BENCH_COUNTER_URL", os.environ["CELERY_BROKER_URL"]))


@app.task(name="bench.plain")
def plain(n: int, key: str) -> None:
    a = reserve(n)
    b = charge(a["reserved"])
    notify(b["charged"])
    _counter.incr(key)
