"""The jobs of bench/flowcost.py: a plain event job, and the same with a throttle that never makes it wait."""

from __future__ import annotations

from typing import Any

from motir_celery import define_job

PLAIN, THROTTLED = "bench.flow.plain", "bench.flow.throttled"


@define_job(PLAIN, event=PLAIN, retry_policy="none")
def plain(event: Any, step: Any) -> int:
    return int(event.data["n"])


@define_job(THROTTLED, event=THROTTLED, retry_policy="none", throttle=(1000, 0.01))
def throttled(event: Any, step: Any) -> int:
    return int(event.data["n"])
