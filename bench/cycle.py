"""Where a durable run's wall time goes inside a worker: the pool child's cycle.

    python -m bench.cycle --runs 3000 --rounds 3

One worker (prefork, concurrency 2) drains a queued backlog. Every attempt's
ledger row (``job_run``) carries the claim's ``now()`` (``started_at``), the
settle's ``now()`` (``finished_at``) and the pool child that ran it
(``worker`` = node/pid), so for each child, from the database alone:

* **exec** — claim to settle of one run: the engine's own part (three step
  bodies, two flushed step writes; the settle, which stores the third
  step with the result, commits after it);
* **hop** — settle of one run to the claim of the next on the same child:
  the settle's commit, the task returning to Celery, the result and the ack
  in the worker's main process, the next message and its dispatch, and the
  runner's set-up before its claim.

Plain Celery's whole cycle per child (concurrency / drain rate) is measured in
the same round, alternating with the durable side. ``--late-acks`` runs both
sides with late acknowledgements (the engine's default before early acks).
Not part of ``python -m bench``: docs/performance.md quotes it in its notes.
"""

from __future__ import annotations

import argparse
import os

from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from bench.stats import median

_PER_CHILD = text(
    """
    WITH r AS (
      SELECT worker, started_at, finished_at,
             lag(finished_at) OVER (PARTITION BY worker ORDER BY started_at) AS previous_settle
      FROM job_run
    )
    SELECT worker,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - started_at)) AS exec_s,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM started_at - previous_settle)) AS hop_s
    FROM r GROUP BY worker
    """
)


def per_child(url: str) -> tuple[float, float]:
    """Median exec and hop (seconds) over the pool children of the last drain."""
    engine = create_engine(url, poolclass=NullPool)
    with engine.connect() as conn:
        rows = conn.execute(_PER_CHILD).all()
    engine.dispose()
    return median([r.exec_s for r in rows]), median([r.hop_s for r in rows])


def main() -> None:
    from bench.__main__ import prepare_environment
    from bench.throughput import motir_round, plain_round

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--late-acks", action="store_true", help="both sides with task_acks_late")
    args = parser.parse_args()
    url = prepare_environment()
    app = "motir_celery"
    if args.late_acks:
        os.environ["BENCH_LATE_ACKS"] = "1"  # read by bench.plain_app in its workers
        app = "bench.motir_lateacks_app"
    concurrency = 2
    execs, hops, cycles, plain_cycles = [], [], [], []
    for _ in range(args.rounds):
        rate = motir_round(url, args.runs, 1, concurrency, app=app)
        exec_s, hop_s = per_child(url)
        execs.append(exec_s)
        hops.append(hop_s)
        cycles.append(concurrency / rate)
        plain_cycles.append(concurrency / plain_round(args.runs, 1, concurrency))
    ms = lambda xs: f"{median(xs) * 1e3:5.2f} ms  ({', '.join(f'{x * 1e3:.2f}' for x in xs)})"  # noqa: E731
    acks = "late" if args.late_acks else "early (default)"
    print(f"pool child cycle, 1 worker x {concurrency}, {acks} acks, {args.runs} runs x {args.rounds} rounds (medians)")
    print(f"  motir: claim -> settle (exec)           {ms(execs)}")
    print(f"  motir: settle -> next claim (hop)       {ms(hops)}")
    print(f"  motir: whole cycle (2 / runs per s)     {ms(cycles)}")
    print(f"  plain Celery: whole cycle               {ms(plain_cycles)}")


if __name__ == "__main__":
    main()
