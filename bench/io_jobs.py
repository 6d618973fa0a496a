"""The I/O-like workload of issue 28: three steps, each waiting 5 ms (a network call's worth) first.

``bench.three_io`` is ``bench.three`` with a ``time.sleep(IO_SECONDS)`` before each body;
``bench/plain_io_app.py`` runs the same in one plain Celery task. At ``-c 8`` Celery's
ceiling is 8 / 15 ms = 533 runs/s: how close each side gets is what durability costs a
job that mostly waits.
"""

from __future__ import annotations

import time
from typing import Any

from bench.functions import charge, notify, reserve
from motir_celery import define_job

__all__ = ["IO_SECONDS", "three_io", "waited", "direct_noop"]

#: What each step waits before its body.
IO_SECONDS = 0.005


def waited(fn: Any, *args: Any) -> Any:
    time.sleep(IO_SECONDS)
    return fn(*args)


@define_job("bench.three_io", event="bench.three_io", retry_policy="transient")
def three_io(event: Any, step: Any) -> dict[str, int]:
    a = step.run("reserve", waited, reserve, event.data["n"])
    b = step.run("charge", waited, charge, a["reserved"])
    return step.run("notify", waited, notify, b["charged"])  # type: ignore[no-any-return]


@define_job("bench.direct_noop", retry_policy="none")
def direct_noop(step: Any, n: int) -> int:
    """A direct job (``.delay(n)``), for the single-call figure of ``bench/targets.py``."""
    return n
