"""Celery's own chord for ``bench.canvas_chord``: plain tasks, Celery's defaults, the Redis result backend
(a native join: no ``chord_unlock`` task); every execution counts itself in Redis, as ours do."""

from __future__ import annotations

import os

import redis
from celery import Celery

app = Celery("bench_chord_plain", broker=os.environ["CELERY_BROKER_URL"],
             backend=os.environ.get("BENCH_CHORD_BACKEND", "redis://127.0.0.1:6379/1"), set_as_current=False)
app.conf.update(task_default_queue=os.environ.get("BENCH_PLAIN_QUEUE", "bench-chord-plain"),
                broker_connection_retry_on_startup=True)
_counts = redis.Redis.from_url(os.environ.get("BENCH_COUNTER_URL", os.environ["CELERY_BROKER_URL"]))


@app.task(name="bench.chord.plain.add")
def add(i: int, key: str) -> int:
    _counts.hincrby(key, str(i), 1)
    return i


@app.task(name="bench.chord.plain.sum")
def tsum(results: list[int], key: str) -> int:
    _counts.hincrby(key, "body", 1)
    return sum(results)
