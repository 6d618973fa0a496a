"""Engine checkouts side by side, beside the floor: the A/B of one change, private.

    python -m bench.sides base=/tmp/before this=             # each NAME=CHECKOUT (empty: this one)
    python -m bench.sides a=/tmp/a b=/tmp/b --rounds 5 --what cpu
    python -m bench.sides base=/tmp/before this= --spy /tmp/spy   # py-spy profiles of one drain each

Each round, the sides taking turns: CPU ms a run of every process (``Stack.cpu_per_run``, one
worker x 2 draining ``--runs`` queued runs after 200), the trivial job's drain rate at 1 x 2, and
p50 enqueue -> completion at one event every 20 ms (``--what`` also takes ``pss``: the worker's PSS MB
after 500 runs); the floor's CPU a run too (``bench/floor.py``:
Celery carrying the engine's statements alone), so each side's ratio to it is printed. A side is
``NAME=CHECKOUT[|VAR=VALUE...]`` (the variables go to its workers). Medians of the rounds, the
rounds in parentheses. ``--spy DIR``: after the rounds, one drain a side under ``py-spy record
--gil`` (the samples of threads holding the GIL: CPU in Python, not waits) of the worker's main
process and each pool child, collapsed stacks in DIR, summed by where they are (``BUCKETS``).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import harness as h
from bench.floor import DB, QUEUE, Floor
from bench.targets import memory_mb


def memory(side: Any, runs: int, tag: str) -> float:
    """PSS MB of a worker x 2 (its main process and pool children) after ``runs`` runs."""
    side.reset()
    side.prequeue(runs)
    with side.workers(1, 2, tag) as procs:
        procs.wait(lambda: side.settled() >= runs, 600, poll=0.1)
        return memory_mb(procs)["pss"]


def spied(stack: h.Stack, side: Any, tag: str, runs: int, out: Path, rate: int, warmup: int = 200) -> None:
    """One drain of ``side`` with py-spy on its worker's main process and pool children."""
    side.reset()
    side.prequeue(warmup + runs)
    with side.workers(1, 2, tag) as procs:
        procs.wait(lambda: side.settled() >= warmup, 600, poll=0.05)
        main = procs.pids[0]
        kids = subprocess.run(["pgrep", "-P", str(main)], capture_output=True, text=True).stdout.split()
        spies = [subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid),
                                   "--rate", str(rate), "--format", "raw", "--nonblocking", "--gil",
                                   "--output", str(out / f"{tag}-{name}.txt")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for name, pid in [("main", main), *((f"child{i}", int(k)) for i, k in enumerate(kids))]]
        procs.wait(lambda: side.settled() >= warmup + runs, 1200, poll=0.05)
        for s in spies:
            s.send_signal(signal.SIGINT)
        for s in spies:
            s.wait(30)


#: Where a sample's CPU goes: the first bucket whose frame is on its stack (py-spy's raw lines).
BUCKETS = (("statements (driver)", ("rows (motir_celery/store/driver.py", "through_libpq_prepared (")),
           ("lease hold", ("LeaseKeeper.hold (",)),
           ("pool checkout and return", ("Pool.connect (", "PooledConnection.__exit__ (",
                                         "PooledConnection.execution_options (", "Engine.pool (")),
           ("step.run, but its statement", ("Step.run (",)),
           ("runner, claim, settle, sweeper, but their statements", ("motir_celery/core/worker/",)),
           ("task body, the rest", ("_task_of.<locals>.task (", "floor (bench/floor_app.py")),
           ("Celery around the task", ("fast_trace_task (",)),
           ("lease renewer thread", ("motir_celery/adapter/renewer.py",)),
           ("Celery and the rest", ("",)))


def summary(folder: Path, name: str, runs: int, rate: int) -> str:
    """``spied``'s samples of one side, ms a run by bucket, for its main process and its pool children."""
    lines = []
    for kind, pattern in (("main", f"{name}-main.txt"), ("children", f"{name}-child*.txt")):
        got: dict[str, int] = {}
        for path in folder.glob(pattern):
            for line in path.read_text().splitlines():
                stack, _, n = line.rpartition(" ")
                bucket = next(b for b, marks in BUCKETS if any(m in stack for m in marks))
                got[bucket] = got.get(bucket, 0) + int(n)
        ms = {b: n * 1000 / rate / runs for b, n in got.items()}
        lines.append(f"  {name} {kind}: {sum(ms.values()):.3f} ms a run in Python (GIL held): "
                     + ", ".join(f"{b} {v:.3f}" for b, v in sorted(ms.items(), key=lambda x: -x[1])))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sides", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sides", nargs="+", help="NAME=CHECKOUT[|VAR=VALUE...] (an empty CHECKOUT: this one)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--runs", type=int, default=2000, help="runs a CPU turn and a drain (default 2000)")
    p.add_argument("--events", type=int, default=150, help="events a p50 turn (default 150)")
    p.add_argument("--what", default="cpu,rate,p50")
    p.add_argument("--no-floor", action="store_true")
    p.add_argument("--spy", type=Path, help="py-spy profiles of one drain a side into this folder")
    p.add_argument("--spy-rate", type=int, default=250)
    p.add_argument("--json", type=Path, help="every round's figures, as JSON")
    args = p.parse_args(argv)
    what, t0, load = args.what.split(","), time.monotonic(), h.machine(load=True)
    with h.private_stack(DB) as stack:
        db, sides = stack.db, dict[str, h.Motir]()
        for item in args.sides:
            name, _, rest = item.partition("=")
            path, *envs = rest.split("|")
            env = dict(h.WORKER_ENV, **dict(e.split("=", 1) for e in envs))
            sides[name] = h.Motir(db, queue=QUEUE, imports=h.IMPORTS, env=env, engine=path or None)
        turns: dict[str, Any] = {}
        if not args.no_floor and "cpu" in what:
            turns["cpu floor"] = lambda: stack.cpu_per_run(Floor(db), args.runs, 200, tag="sides-floor")
        for name, s in sides.items():
            if "cpu" in what:
                turns[f"cpu {name}"] = lambda s=s, name=name: stack.cpu_per_run(s, args.runs, 200, tag=f"sides-{name}")
            if "rate" in what:
                turns[f"rate {name}"] = lambda s=s, name=name: h.drain(s, args.runs, 1, 2, tag=f"sides-r-{name}").rate
            if "pss" in what:
                turns[f"pss {name}"] = lambda s=s, name=name: memory(s, 500, f"sides-m-{name}")
            if "p50" in what:
                turns[f"p50 {name}"] = lambda s=s: h.latency(s, args.events)["p50"] * 1000
        rounds = h.interleave(turns, args.rounds, log=lambda m: print(m[:120], file=sys.stderr, flush=True))
        if args.spy:
            args.spy.mkdir(parents=True, exist_ok=True)
            spies: dict[str, Any] = {"floor": Floor(db), **sides}
            for name, side in spies.items():
                spied(stack, side, name, args.runs, args.spy, args.spy_rate)
    if args.json:
        args.json.write_text(json.dumps(rounds))
    print(f"{h.command('bench.sides', argv)} ({h.now()}, {(time.monotonic() - t0) / 60:.1f} min; {load}; "
          f"commit {h.describe()})")
    for key, rs in rounds.items():
        if not rs:
            continue
        vals = [r["total"] if isinstance(r, dict) else r for r in rs]
        split = "" if not isinstance(rs[0], dict) else "  " + " ".join(
            f"{k} {h.median(r[k] for r in rs):.3f}" for k in ("main", "children", "pg_clients", "redis"))
        print(f"{key:<16} {h.median(vals):8.3f}  ({', '.join(f'{v:.3f}' for v in vals)}){split}")
    if args.spy:
        print(f"py-spy --gil at {args.spy_rate} Hz, one drain of {args.runs} runs a side:")
        for name in ("floor", *sides):
            print(summary(args.spy, name, args.runs, args.spy_rate))
    if rounds.get("cpu floor"):
        floor = [r["total"] for r in rounds["cpu floor"]]
        for name in sides:
            me = [r["total"] for r in rounds[f"cpu {name}"]]
            print(f"{name} / floor: x{h.median(me) / h.median(floor):.3f} "
                  f"(rounds {', '.join(f'{a / b:.2f}' for a, b in zip(me, floor))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
