"""Plain Celery running issue 28's I/O-like workload (``bench/io_jobs.py``) in one task, no durability.

Three waits of ``IO_SECONDS`` and the three functions, then the completion instant into a
Redis hash (one round trip), as ``bench/plain_app.py`` does for the trivial workload.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

from bench.functions import charge, notify, reserve

IO_SECONDS = 0.005  # bench/io_jobs.py's (that module imports the engine; this one must not)

app = Celery("bench_plain_io", broker=os.environ["CELERY_BROKER_URL"], set_as_current=False)
app.conf.update(worker_prefetch_multiplier=1, task_ignore_result=True, broker_connection_retry_on_startup=True,
                task_default_queue=os.environ.get("BENCH_PLAIN_QUEUE", "bench-plain"))
_done = redis.Redis.from_url(os.environ["CELERY_BROKER_URL"])


@app.task(name="bench.plain_io")
def plain_io(n: int, key: str) -> None:
    time.sleep(IO_SECONDS)
    a = reserve(n)
    time.sleep(IO_SECONDS)
    b = charge(a["reserved"])
    time.sleep(IO_SECONDS)
    notify(b["charged"])
    _done.hset(key, str(n), repr(time.time()))
