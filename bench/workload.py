"""The benchmark workload: three trivial steps, each returning a small dict.

The same three functions run as a durable motir job (``bench.three``) and as a
plain Celery task without durability (``bench.plain_app``), so the difference
between the two is the cost of durability and nothing else.
"""

from __future__ import annotations

from typing import Any

from motir_celery import define_job


def reserve(n: int) -> dict[str, int]:
    return {"reserved": n}


def charge(n: int) -> dict[str, int]:
    return {"charged": n * 2}


def notify(n: int) -> dict[str, int]:
    return {"notified": n + 1}


@define_job("bench.three", event="bench.three", retry_policy="transient")
def three(event: Any, step: Any) -> dict[str, int]:
    n = event.data["n"]
    a = step.run("reserve", reserve, n)
    b = step.run("charge", charge, a["reserved"])
    c = step.run("notify", notify, b["charged"])
    return c
