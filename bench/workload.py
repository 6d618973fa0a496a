"""The suite's jobs. ``bench.three``: three trivial steps, the functions (``bench.functions``) that plain
Celery (``bench.plain_app``) and the peers run too, so the sides differ by their machinery alone.
``bench.steps``: ``data["k"]`` steps (each body first sleeping ``data["sleep"]`` s); with
``data["fail_first"]`` its first attempt fails after storing them, so the second is k memo hits.
``fanout_subscribers()``: ``FANOUT`` jobs on ``bench.fanout``, for the fan-out section's driver only.
"""

from __future__ import annotations

import time
from typing import Any

from bench.functions import charge, notify, reserve
from motir_celery import define_job

__all__ = ["reserve", "charge", "notify", "three", "steps", "STEP_TIMES", "fanout_subscribers"]


@define_job("bench.three", event="bench.three", retry_policy="transient")
def three(event: Any, step: Any) -> dict[str, int]:
    n = event.data["n"]
    a = step.run("reserve", reserve, n)
    b = step.run("charge", charge, a["reserved"])
    c = step.run("notify", notify, b["charged"])
    return c


#: Per-attempt lists of step.run wall times (seconds), read by the step-cost section.
STEP_TIMES: list[list[float]] = []


def _after(pause: float, fn: Any, *args: Any) -> Any:
    if pause:
        time.sleep(pause)
    return fn(*args)


class FirstAttemptFails(Exception):
    pass


@define_job("bench.steps", event="bench.steps", retry_policy="transient")
def steps(event: Any, step: Any) -> int:
    times: list[float] = []
    total = 0
    pause = float(event.data.get("sleep", 0))
    for i in range(event.data["k"]):
        t0 = time.perf_counter()
        total += step.run(f"s{i}", _after, pause, reserve, i)["reserved"]
        times.append(time.perf_counter() - t0)
    STEP_TIMES.append(times)
    if event.data.get("fail_first") and event.attempt == 1:
        raise FirstAttemptFails("first attempt fails on purpose: the next one replays every step")
    return total


FANOUT, FANOUT_EVENT = 50, "bench.fanout"


_SUBSCRIBED: list[bool] = []


def fanout_subscribers() -> None:
    """``FANOUT`` jobs subscribed to ``FANOUT_EVENT`` (once per process)."""
    if not _SUBSCRIBED:
        for i in range(FANOUT):
            define_job(f"bench.fanout.{i:02d}", event=FANOUT_EVENT, retry_policy="transient")(_nothing(i))
        _SUBSCRIBED.append(True)


def _nothing(i: int) -> Any:
    def handler(event: Any, step: Any) -> None:
        return None

    handler.__name__ = handler.__qualname__ = f"fanout_{i:02d}"
    return handler
