"""Where a durable run's wall time goes inside a worker: the pool child's cycle (docs/performance.md).

    python -m bench.cycle [--runs 3000 --rounds 3] [--late-acks]
    python -m bench.cycle --io [--runs 2000]     # issue 28's I/O-like workload at -c 8, each step's time too
    python -m bench.cycle --latency [--events 250]   # the p50 of issue 28, leg by leg, at one event every 20 ms

One worker (prefork x 2; ``--io``: x 8) drains a queued backlog; from the attempts' ``job_run`` rows
(claim's and settle's ``now()``, pool child), per child: exec = claim to settle, hop = settle to the
next claim. With ``--io`` (``bench/io_jobs.py``: three steps, each waiting 5 ms first) also each
step's share of exec, from its record's commit time: claim to the first record, record to record,
the last record to the settle; what a step takes over its 5 ms of waiting is its record's round trip
and flush plus the Python around it. Plain Celery's whole cycle (concurrency / drain rate) in the
same rounds, taking turns (``--io``: ``bench/plain_io_app.py``).

``--latency``: the targets' p50 setting (one ``send_event`` every 20 ms, 1 worker x 2), each
event's way from the instant before the call to its settle, leg by leg: the call itself (the
sender's whole ``send_event``: its flushed write, then the publish); the instant before the call
to its write's transaction start; that start to the claim (the write, its flush, the publish,
Celery's delivery to a pool child); the claim to the first step's record, record to record, the
last record to the settle. Instants from the database (each statement's ``now()``) and the
sender's clock, one host. Plain Celery's p50 of the same job in the same rounds beside it.
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
#: ``--latency``: each sent run's instants (its write's transaction start, the claim, the first and
#: last step records, the settle), epoch seconds.
PER_RUN = """
    SELECT q.id::text, extract(epoch FROM q.created_at)::float8, extract(epoch FROM r.started_at)::float8,
           extract(epoch FROM min(s.completed_at))::float8, extract(epoch FROM max(s.completed_at))::float8,
           extract(epoch FROM q.finished_at)::float8
    FROM job_queue q
    JOIN job_run r ON r.run_id = q.id
    JOIN job_step s ON s.run_id = q.id
    WHERE q.state = 'succeeded'
    GROUP BY q.id, r.started_at
"""
LEGS = ("send_event, the whole call", "before the call -> its write's transaction start",
        "write -> claim (flush, publish, delivery)", "claim -> first step's record", "first -> last record (2 steps)",
        "last record -> settle", "before the call -> settle (p50)")

STEPS = ("claim -> reserve's record", "reserve's -> charge's record", "charge's -> notify's record",
         "notify's record -> settle")


def main() -> None:
    parser = h.parser("bench.cycle", __doc__, write=None)
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--late-acks", action="store_true", help="both sides with task_acks_late")
    parser.add_argument("--io", action="store_true", help="the I/O-like workload (3 steps x 5 ms) at -c 8")
    parser.add_argument("--latency", action="store_true", help="p50 leg by leg at one event every 20 ms")
    parser.add_argument("--events", type=int, default=250, help="--latency: events a round")
    args = parser.parse_args()
    h.need("MOTIR_DATABASE_URL", "CELERY_BROKER_URL")
    if args.latency:
        legs(args.events, args.rounds)
        return
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


def legs(events: int, rounds: int) -> None:
    """``--latency``: the medians of each leg (LEGS) for the durable side, plain Celery's p50 beside it."""
    with h.Database.create("motir_bench_cycle") as db:
        motir, plain = h.Motir(db), h.Plain()

        def durable() -> list[float]:
            motir.reset()
            calls: dict[str, float] = {}
            with motir.workers(1, 2, "latency") as procs:
                sent = h.send_paced(motir, procs, events, 0.02, calls=calls)
            times: list[list[float]] = [[] for _ in LEGS]
            for run_id, written, claimed, first, last, settled in db.rows(PER_RUN):
                if run_id in sent:
                    before = sent[run_id]
                    for leg, x in zip(times, (calls[run_id], written - before, claimed - written, first - claimed,
                                             last - first, settled - last, settled - before)):
                        leg.append(x)
            return [h.median(leg) for leg in times]

        got = h.interleave({"motir": durable, "plain": lambda: [h.latency(plain, events, 0.02, 2)["p50"]]}, rounds)
    print(f"p50 leg by leg, one event every 20 ms, 1 worker x 2, {events} events x {rounds} rounds "
          "(medians of the rounds; each round's in parentheses)")
    for i, label in enumerate(LEGS):
        xs = [r[i] for r in got["motir"]]
        print(f"  {label:<50} {h.median(xs) * 1e3:5.2f} ms  ({', '.join(f'{x * 1e3:.2f}' for x in xs)})")
    xs = [r[0] for r in got["plain"]]
    print(f"  {'plain Celery: before the call -> done (p50)':<50} {h.median(xs) * 1e3:5.2f} ms  "
          f"({', '.join(f'{x * 1e3:.2f}' for x in xs)})")


if __name__ == "__main__":
    main()
