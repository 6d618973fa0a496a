"""The modules one durable run and one chord pass through: ``python -m bench.walk [--engine CHECKOUT]``.

Traces (``sys.setprofile``, this thread only) every call into ``motir_celery`` while

* **a run**: ``job.delay(2, 3)`` on an attached Celery app (the message pushed to the broker),
  then the job's Celery task applied to that message in this process — the adoption check,
  the claim, one step, the settle — as a worker's pool process runs it;
* **a chord**: ``chord([add.s(i, i) for i in range(3)], tsum.s()).apply()``: the canvas run and
  its members executed here, at once, through the engine (as Celery's eager mode runs them).

and prints, for each, the package modules entered (in the order first entered), how many, and how
many times a reader following them in that order comes back to a room already left (a room:
``core/worker``, ``core/producer``, ``core/operator``, the rest of ``core``, ``adapter``,
``store``, the package's face, its base modules), and how many times the calls cross from one
room to another. ``--engine CHECKOUT`` runs the same walk on another checkout's package (before/after).
Needs ``MOTIR_DATABASE_URL`` (a database at the schema's head) and ``CELERY_BROKER_URL``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from types import FrameType
from typing import Any

HERE = Path(__file__).resolve().parent


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "face"
    if parts[1] == "core" and len(parts) > 2 and parts[2] in ("worker", "producer", "operator"):
        return f"core/{parts[2]}"
    if parts[1] in ("core", "adapter", "store", "ops", "contrib", "testing", "dev"):
        return parts[1]
    return "base"  # settings, errors, forks, beat


class Trace:
    def __init__(self) -> None:
        self.modules: list[str] = []
        self.rooms: list[str] = []

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not isinstance(module, str) or not module.startswith("motir_celery") or module == __name__:
            return
        if module not in self.modules:
            self.modules.append(module)
        here = room(module)
        if not self.rooms or self.rooms[-1] != here:
            self.rooms.append(here)

    def summary(self) -> dict[str, Any]:
        order = [room(m) for m in self.modules]
        left: set[str] = set()
        returns = 0
        for before, here in zip(order, order[1:]):
            if here != before:
                left.add(before)
                returns += here in left
        return {"modules": len(self.modules), "room_returns": returns, "crossings": len(self.rooms) - 1,
                "path": self.modules}


def walk() -> dict[str, Any]:
    """Both walks in this process (the package on sys.path is the one measured)."""
    from celery import Celery

    from motir_celery import attach, chord, define_job

    @define_job("bench.walk.add", name="bench.walk.add")
    def add(step: Any, x: int, y: int) -> int:
        return int(step.run("add", lambda: x + y))

    @define_job("bench.walk.tsum", name="bench.walk.tsum")
    def tsum(step: Any, values: list[int]) -> int:
        return int(step.run("sum", lambda: sum(values)))

    app = Celery("bench-walk", set_as_current=False)
    url = os.environ["CELERY_BROKER_URL"]
    app.conf.update(broker_url=url, broker_read_url=url, broker_write_url=url,
                    task_default_queue=f"bench-walk-{os.getpid()}")
    attach(app)
    add.delay(0, 0)  # the first message of a job sets its route up (a queue declared once): not walked

    run = Trace()
    sys.setprofile(run)
    try:
        handle = add.delay(2, 3)
        app.tasks[add.task_name].apply(args=[str(handle.id)], task_id=str(handle.id))
    finally:
        sys.setprofile(None)
    assert handle.get(timeout=10) == 5, "the walked run did not succeed"

    canvas = Trace()
    sys.setprofile(canvas)
    try:
        result = chord([add.s(i, i) for i in range(3)], tsum.s()).apply()
    finally:
        sys.setprofile(None)
    assert result.get(timeout=10) == 6, "the walked chord did not succeed"
    return {"run": run.summary(), "chord": canvas.summary()}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.walk", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", help="another checkout whose package is walked (before/after)")
    parser.add_argument("--json", action="store_true", help="print the walks as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(walk()))
        return
    sides = {"this checkout": None, **({"--engine": args.engine} if args.engine else {})}
    found = {}
    for label, checkout in sides.items():
        # The side's package first on the path; this script run by its path, with its jobs.
        env = {**os.environ, "PYTHONPATH": checkout or str(HERE.parent)}
        out = subprocess.run([sys.executable, str(HERE / "walk.py"), "--child"], env=env,
                             cwd=checkout or HERE.parent, capture_output=True, text=True, check=False)
        if out.returncode:
            raise SystemExit(f"{label}: the walk failed:\n{out.stderr[-3000:]}")
        found[label] = json.loads(out.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(found, indent=2))
        return
    for what in ("run", "chord"):
        print(f"{what}:")
        for label, result in found.items():
            w = result[what]
            print(f"  {label:14s} {w['modules']:3d} modules, back to a room it had left {w['room_returns']:3d} times, "
                  f"{w['crossings']:4d} calls from one room to another")
    for label, result in found.items():
        print(f"\n{label}, the run's modules in first-entry order:\n  " + "\n  ".join(result["run"]["path"]))


if __name__ == "__main__":
    main()
