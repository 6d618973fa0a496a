"""What admission costs one workspace (docs/fair-share.md), private, in one interleaved run.

    python -m bench.admission --baseline /tmp/before            # sides: base, off, on
    python -m bench.admission --baseline /tmp/before --rounds 1 --runs 300 --events 30   # smoke

Sides, taking turns each round: ``base`` (another checkout's engine, e.g. the commit before
admission), ``off`` (this checkout, no ``job_admission`` row: what every deployment that does not
turn it on runs), ``on`` (this checkout with the fleet's in-flight limit set to ``--limit``, one
workspace and one priority: the gate before each publish and the choice after each attempt). For
each: the trivial job's drain rate at 1 x 2 (runs queued beforehand: with admission on, all but the
limit are held, then sent one per settle), the I/O-like workload's (``bench/io_jobs.py``: 3 steps
x 5 ms of waiting) at 1 x 8, and p50 enqueue -> completion at one event every 20 ms.
Medians of the rounds, the rounds in parentheses, and each side's ratio to ``base``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

import psycopg

from bench import harness as h
from bench.floor import DB, QUEUE


def _admission(db: Any, limit: int | None) -> None:
    """Turn admission on with ``limit`` (None: off) in the bench's database."""
    url = db.url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DELETE FROM job_admission")
        conn.execute("UPDATE job_queue SET dispatched_at = now() WHERE dispatched_at = 'infinity'")
        if limit is not None:
            conn.execute("INSERT INTO job_admission (name, max_in_flight) VALUES ('fleet', %s)", (limit,))
    time.sleep(6)  # every process's "off" is trusted for 5 s (core/admission.py OFF_RECHECK_SECONDS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.admission", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="a checkout before admission (git worktree add --detach)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--runs", type=int, default=2000, help="runs a drain (default 2000)")
    p.add_argument("--events", type=int, default=150, help="events a p50 turn (default 150)")
    p.add_argument("--io-runs", type=int, default=1000, help="runs an I/O-like drain at 1 x 8 (0: none)")
    p.add_argument("--limit", type=int, default=16, help="the fleet's in-flight limit of the 'on' side")
    args = p.parse_args(argv)
    t0, load = time.monotonic(), h.machine(load=True)
    with h.private_stack(DB) as stack:
        db = stack.db
        env = dict(h.WORKER_ENV)
        engines = {"base": (args.baseline, None), "off": (None, None), "on": (None, args.limit)}
        sides = {name: (h.Motir(db, queue=QUEUE, imports=h.IMPORTS, env=env, engine=path), limit)
                 for name, (path, limit) in engines.items()}
        io_sides = {name: (h.Motir(db, job=h.IO_JOB, queue=QUEUE, imports=h.IMPORTS, env=env, engine=path), limit)
                    for name, (path, limit) in engines.items()}
        turns: dict[str, Callable[[], Any]] = {}
        for name, (side, limit) in io_sides.items():
            if args.io_runs:
                def io(side: Any = side, limit: int | None = limit, name: str = name) -> float:
                    _admission(db, limit)
                    return float(h.drain(side, args.io_runs, 1, 8, tag=f"adm-io-{name}").rate)

                turns[f"io {name}"] = io
        for name, (side, limit) in sides.items():
            def rate(side: Any = side, limit: int | None = limit, name: str = name) -> float:
                _admission(db, limit)
                return float(h.drain(side, args.runs, 1, 2, tag=f"adm-r-{name}").rate)

            def p50(side: Any = side, limit: int | None = limit) -> float:
                _admission(db, limit)
                return float(h.latency(side, args.events)["p50"] * 1000)

            turns[f"rate {name}"] = rate
            turns[f"p50 {name}"] = p50
        rounds = h.interleave(turns, args.rounds, log=lambda m: print(m[:120], file=sys.stderr, flush=True))
        _admission(db, None)
    print(f"{h.command('bench.admission', argv)} ({h.now()}, {(time.monotonic() - t0) / 60:.1f} min; {load}; "
          f"commit {h.describe()}; 'on': at most {args.limit} in flight)")
    for key, rs in rounds.items():
        vals = [float(v) for v in rs]
        base = [float(v) for v in rounds[key.split()[0] + " base"]]
        print(f"{key:<10} {h.median(vals):9.3f}  ({', '.join(f'{v:.3f}' for v in vals)})"
              f"  x{h.median(vals) / h.median(base):.3f} of base")
    return 0


if __name__ == "__main__":
    sys.exit(main())
