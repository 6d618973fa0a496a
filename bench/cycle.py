"""Where a durable run's wall time goes inside a worker: the pool child's cycle (docs/performance.md).

    python -m bench.cycle [--runs 3000 --rounds 3] [--late-acks]
    python -m bench.cycle --io [--runs 2000]     # issue 28's I/O-like workload at -c 8, each step's time too

One worker (prefork x 2; ``--io``: x 8) drains a queued backlog; from the attempts' ``job_run`` rows
(claim's and settle's ``now()``, pool child), per child: exec = claim to settle, hop = settle to the
next claim. With ``--io`` (``bench/io_jobs.py``: three steps, each waiting 5 ms first) also each
step's share of exec, from its record's commit time: claim to the first record, record to record,
the last record to the settle; what a step takes over its 5 ms of waiting is its record's round trip
and flush plus the Python around it. Plain Celery's whole cycle (concurrency / drain rate) in the
same rounds, taking turns (``--io``: ``bench/plain_io_app.py``).
"""

from __future__ import annotations

import os

from bench import harness as h
from bench.targets import IMPORTS, IO_JOB, PlainIO

PER_CHILD = """
    WITH r AS (
      SELECT worker, started_at, finished_at,
             lag(finished_at) OVER (PARTITION BY worker ORDER BY started_at) AS previous_settle
      FROM job_run
    )
    SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - started_at)),
           percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM started_at - previous_settle))
    FROM r GROUP BY worker
"""

#: ``--io``: the medians of claim -> reserve's record -> charge's -> notify's -> settle (bench.three_io).
PER_STEP = """
    SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM a.completed_at - r.started_at)),
           percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM b.completed_at - a.completed_at)),
           percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM c.completed_at - b.completed_at)),
           percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM r.finished_at - c.completed_at))
    FROM job_run r
    JOIN job_step a ON a.run_id = r.run_id AND a.step_id = 'reserve'
    JOIN job_step b ON b.run_id = r.run_id AND b.step_id = 'charge'
    JOIN job_step c ON c.run_id = r.run_id AND c.step_id = 'notify'
    WHERE r.finished_at IS NOT NULL
"""
STEPS = ("claim -> reserve's record", "reserve's -> charge's record", "charge's -> notify's record",
         "notify's record -> settle")


def main() -> None:
    parser = h.parser("bench.cycle", __doc__, write=None)
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--late-acks", action="store_true", help="both sides with task_acks_late")
    parser.add_argument("--io", action="store_true", help="the I/O-like workload (3 steps x 5 ms) at -c 8")
    args = parser.parse_args()
    h.need("MOTIR_DATABASE_URL", "CELERY_BROKER_URL")
    if args.late_acks:
        os.environ["BENCH_LATE_ACKS"] = "1"  # read by both apps in their workers
    concurrency = 8 if args.io else 2
    with h.Database.create("motir_bench_cycle") as db:
        app = "bench.motir_app" if args.late_acks else "motir_celery"
        if args.io:
            motir = h.Motir(db, job=IO_JOB, imports=IMPORTS, app=app)
            plain: h.Side = PlainIO()
        else:
            motir, plain = h.Motir(db, app=app), h.Plain()

        def durable() -> list[float]:
            rate = h.drain(motir, args.runs, 1, concurrency).rate
            per_child = db.rows(PER_CHILD)
            steps = list(db.rows(PER_STEP)[0]) if args.io else []
            return [h.median(r[0] for r in per_child), h.median(r[1] for r in per_child), concurrency / rate, *steps]

        rounds = h.interleave({"motir": durable,
                               "plain": lambda: [concurrency / h.drain(plain, args.runs, 1, concurrency).rate]},
                              args.rounds)
    print(f"pool child cycle, 1 worker x {concurrency}{', 3 steps x 5 ms of waiting' if args.io else ''}, "
          f"{'late' if args.late_acks else 'early (default)'} acks, {args.runs} runs x {args.rounds} rounds (medians)")
    labels = ["motir: claim -> settle (exec)", "motir: settle -> next claim (hop)",
              f"motir: whole cycle ({concurrency} / runs per s)"] + [f"motir:   {s}" for s in STEPS if args.io]
    for i, label in enumerate(labels):
        xs = [float(r[i]) for r in rounds["motir"]]
        print(f"  {label:<42} {h.median(xs) * 1e3:5.2f} ms  ({', '.join(f'{x * 1e3:.2f}' for x in xs)})")
    xs = [r[0] for r in rounds["plain"]]
    print(f"  {'plain Celery: whole cycle':<42} {h.median(xs) * 1e3:5.2f} ms  ({', '.join(f'{x * 1e3:.2f}' for x in xs)})")


if __name__ == "__main__":
    main()
