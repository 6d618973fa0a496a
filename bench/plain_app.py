"""Plain Celery running the same three functions, no durability: the transport's floor.

Each task records its completion instant (``time.time()``) in a Redis hash,
one round trip, so the driver can time the drain and the latency without a
result backend. (The durable side's equivalent is its settle's ``finished_at``.)
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

from bench.functions import charge, notify, reserve

app = Celery("bench_plain", broker=os.environ["CELERY_BROKER_URL"], set_as_current=False)
app.conf.update(
    # The same delivery settings the engine puts on its app (early acks, Celery's default).
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    task_default_queue=os.environ.get("BENCH_PLAIN_QUEUE", "bench-plain"),
    broker_connection_retry_on_startup=True,
)
if os.environ.get("BENCH_NO_ACK_EMULATION") == "1":
    # The transport setting motir-celery's own app makes (celery_app.create_app), for
    # the side that shows what it alone is worth to plain Celery.
    app.conf.broker_transport_options = {"ack_emulation": False}
_done = redis.Redis.from_url(os.environ.get("BENCH_COUNTER_URL", os.environ["CELERY_BROKER_URL"]))


@app.task(name="bench.plain")
def plain(n: int, key: str) -> None:
    a = reserve(n)
    b = charge(a["reserved"])
    notify(b["charged"])
    _done.hset(key, str(n), repr(time.time()))
