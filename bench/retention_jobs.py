"""The retention bench's live job (``bench/retention.py``), and a timer for the engine's statements.

``retention.live`` has two trivial steps, the shape of the finished runs the bench
loads. Imported by the workers (``MOTIR_IMPORTS=bench.retention_jobs``), this module
also wraps ``motir_celery.store.driver.rows`` — the one function every catalogued
statement (claim, store_step, settle_succeeded, …) goes through — so that each
call's round trip, as the worker sees it, is appended to a file of the worker
process's own under ``$RETENTION_TIMINGS`` (one ``name wall_end seconds`` line per
call). Nothing changes for the statements themselves; the timer costs a
``perf_counter`` pair and one line write.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from motir_celery import define_job
from motir_celery.store import driver

__all__ = ["live", "TIMED"]

#: The statements whose latency the bench reports.
TIMED = ("claim", "store_step", "settle_succeeded")

_original = driver.rows
_out: dict[str, Any] = {}


def _file() -> Any:
    pid = os.getpid()
    if _out.get("pid") != pid:  # a prefork child: a file of its own
        folder = os.environ.get("RETENTION_TIMINGS")
        _out["pid"], _out["f"] = pid, (open(Path(folder) / f"{pid}.txt", "a", buffering=1) if folder else None)
    return _out["f"]


def _timed_rows(conn: Any, statement: Any, params: dict[str, Any]) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    try:
        return _original(conn, statement, params)
    finally:
        if statement.name in TIMED and (f := _file()) is not None:
            f.write(f"{statement.name} {time.time():.6f} {time.perf_counter() - t0:.6f}\n")


driver.rows = _timed_rows  # driver.first looks rows up at call time


def _body(n: int, name: str) -> dict[str, Any]:
    return {"step": name, "n": n}


@define_job("retention.live", event="retention.live", retry_policy="transient")
def live(event: Any, step: Any) -> int:
    step.run("one", _body, int(event.data["n"]), "one")
    step.run("two", _body, int(event.data["n"]), "two")
    return int(event.data["n"])
