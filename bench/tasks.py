"""A Celery task made durable (``@app.task(durable=True)``) against plain Celery and a direct job (issue 43).

    python -m bench.tasks [--runs 2000] [--rounds 3] [--stat-runs 300] [--no-write]

Private Postgres (with ``pg_stat_statements``) and Redis (``harness.private_stack``). Two parts:

* **Statements a run**: for the durable task and for the direct job of the same body
  (``bench/durable_app.py``), every statement per run while the producer sends them (``apply_async`` /
  ``delay``: the enqueue) and a warm worker drains them, from ``pg_stat_statements`` (every
  top-level statement of the bench database, the sweeper's included).
* **Trivial 1 x 2**: a backlog of ``--runs`` drained by one worker of concurrency 2, plain Celery
  (``bench/plain_app.py``), the durable task and the direct job taking turns for ``--rounds`` rounds,
  with kombu's Redis ack emulation on (an attached app keeps it) and off (what ``create_app`` sets);
  and the floor: plain Celery sending a run's claim and settle alone (``bench/floor_app.py`` with no
  step). Runs/s over the middle 90 % of each drain, each side's median as a ratio to plain Celery's
  with the same transport.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any

from bench import harness as h
from bench.floor import Floor

DB = "motir_bench_tasks"
QUEUE = "bench-durable"
#: pg_stat_statements on the private server (PRIVATE_SETTINGS otherwise).
SETTINGS = (*h.PRIVATE_SETTINGS, "shared_preload_libraries=pg_stat_statements", "pg_stat_statements.track=top")
_BLANKS = re.compile(r"\s+")


@dataclass
class Task(h.Motir):
    """Runs of ``task``: the durable Celery task (``bench.durable``) or the direct job
    (``bench.direct``), sent by their own call (``apply_async`` / ``delay``: the producer writes the run)."""

    task: str = "bench.durable"

    def prequeue(self, n: int, offset: int = 0) -> None:
        from bench.durable_app import app, direct

        if self.task == "bench.durable":
            durable = app.tasks["bench.durable"]
            for i in range(offset, offset + n):
                durable.apply_async((i,))
        else:
            for i in range(offset, offset + n):
                direct.delay(i)


def statements(stack: Any) -> list[tuple[str, float]]:
    """Top-level statements of the bench database since the last reset: (query's start, calls)."""
    rows = stack.db.rows("SELECT s.query, s.calls FROM pg_stat_statements s"
                         " WHERE s.toplevel AND s.dbid = (SELECT oid FROM pg_database WHERE datname = %s)", (DB,))
    return [(_BLANKS.sub(" ", str(q)).strip()[:70], float(c)) for q, c in rows
            if "pg_stat_statements" not in str(q) and not str(q).lstrip().upper().startswith(("BEGIN", "COMMIT"))]


def per_run(stack: Any, side: Task, runs: int) -> dict[str, Any]:
    """Every statement per run while ``runs`` runs of ``side`` are sent and drained by a warm
    worker: (query's start, calls a run), most frequent first, and their total."""
    side.reset()
    with side.workers(1, 2, f"stat-{side.task}") as procs:
        side.prequeue(20)
        h.settle(side, procs, 20, timeout=300)
        stack.db.rows("SELECT pg_stat_statements_reset()")
        side.prequeue(runs, offset=20)
        h.settle(side, procs, runs + 20, timeout=600)
        found = statements(stack)
    each = sorted(((q, c / runs) for q, c in found if c >= runs / 2), key=lambda x: -x[1])
    return {"each": each, "total": sum(c for _, c in found) / runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tasks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stat-runs", type=int, default=300)
    parser.add_argument("--no-write", action="store_true", help="print the block only")
    args = parser.parse_args(argv)
    h.need("CELERY_BROKER_URL")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with h.private_stack(DB, SETTINGS) as stack:
        durable = Task(stack.db, imports="bench.durable_app", app="bench.durable_app", queue=QUEUE,
                       env=dict(h.WORKER_ENV), task="bench.durable")
        direct = Task(stack.db, imports="bench.durable_app", app="bench.durable_app", queue=QUEUE,
                      env=dict(h.WORKER_ENV), task="bench.direct")
        plain = h.Plain()
        stack.db.rows("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        counts = {"durable task": per_run(stack, durable, args.stat_runs),
                  "direct job": per_run(stack, direct, args.stat_runs)}
        off = {"BENCH_NO_ACK_EMULATION": "1"}
        sides: dict[str, Any] = {
            "plain Celery": plain, "durable task": durable, "direct job": direct,
            "plain Celery, ack emulation off": h.Plain(env=off),
            "durable task, ack emulation off": Task(stack.db, imports="bench.durable_app", app="bench.durable_app",
                                                    queue=QUEUE, env={**h.WORKER_ENV, **off}, task="bench.durable"),
            "floor: Celery sending the claim and the settle alone": Floor(stack.db, steps=0),
        }
        rates = h.interleave({name: (lambda s=side: h.drain(s, args.runs).rate) for name, side in sides.items()},
                             rounds=args.rounds, log=print, show=lambda r: f"{r:.0f} runs/s")
    lines = [f"Measured {started} at {h.describe()}, `python -m bench.tasks --runs {args.runs} --rounds "
             f"{args.rounds} --stat-runs {args.stat_runs}` (private Postgres and Redis; a shared 2-core machine: "
             "read the ratios).", "", "Statements a run, sent and drained (`pg_stat_statements`: the producer's,"
             " the worker's, the sweeper's):", "", "| side | all | each, a run (those at least every other run) |",
             "|---|---|---|"]
    for name, c in counts.items():
        each = "; ".join(f"`{q[:40]}…` {n:.2f}" for q, n in c["each"])
        lines.append(f"| {name} | {c['total']:.2f} | {each} |")
    lines += ["", f"Trivial 1 x 2 ({args.runs} runs a drain, {args.rounds} rounds, turn about), each side against "
              "plain Celery with the same Redis transport (kombu's ack emulation on, as an attached app keeps it, or "
              "off, as `create_app` sets it; the floor's app has it off):", "",
              "| side | runs/s (median) | rounds | x plain Celery |", "|---|---|---|---|"]
    for name, xs in rates.items():
        base = statistics.median(rates["plain Celery" if name in ("plain Celery", "durable task", "direct job")
                                       else "plain Celery, ack emulation off"])
        lines.append(f"| {name} | {statistics.median(xs):.0f} | {', '.join(f'{x:.0f}' for x in xs)} | "
                     f"{statistics.median(xs) / base:.2f} |")
    h.write_block("bench.tasks", "\n".join(lines), h.PERFORMANCE_DOC, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
