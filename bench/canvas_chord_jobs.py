"""The durable side of ``bench.canvas_chord``: a trivial member and the body, each execution counted in Redis."""

from __future__ import annotations

import os
from typing import Any

from motir_celery import define_job

COUNTS = os.environ.get("BENCH_COUNTER_URL") or os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")


def _counter() -> Any:
    import redis

    return redis.Redis.from_url(COUNTS)
@define_job("bench.chord.member", retry_policy="transient")
def member(step: Any, i: int, key: str) -> int:
    _counter().hincrby(key, str(i), 1)  # every execution counts: outside step.run on purpose
    return i


@define_job("bench.chord.body", retry_policy="transient")
def body(step: Any, results: list[int], key: str) -> int:
    _counter().hincrby(key, "body", 1)
    return sum(results)


def check(key: str, n: int, result: Any) -> str:
    """'' when every member and the body ran exactly once and the result is the sum; else what is wrong."""
    seen = {k.decode(): int(v) for k, v in _counter().hgetall(key).items()}
    _counter().delete(key)
    wrong = []
    members = [seen.get(str(i), 0) for i in range(n)]
    if any(c != 1 for c in members):
        wrong.append(f"members not run exactly once: {sum(1 for c in members if c == 0)} never, "
                     f"{sum(1 for c in members if c > 1)} more than once")
    if seen.get("body", 0) != 1:
        wrong.append(f"body ran {seen.get('body', 0)} times")
    if result != sum(range(n)):
        wrong.append(f"body's result {result!r}, not {sum(range(n))}")
    return "; ".join(wrong)


