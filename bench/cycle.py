"""Where a durable run's wall time goes inside a worker: the pool child's cycle (docs/performance.md).

    python -m bench.cycle [--runs 3000 --rounds 3] [--late-acks]

One worker (prefork x 2) drains a queued backlog; from the attempts' ``job_run`` rows (claim's and
settle's ``now()``, pool child), per child: exec = claim to settle, hop = settle to the next claim.
Plain Celery's whole cycle (concurrency / drain rate) in the same rounds, taking turns.
"""

from __future__ import annotations

import os

from bench import harness as h

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


def main() -> None:
    parser = h.parser("bench.cycle", __doc__, write=None)
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--late-acks", action="store_true", help="both sides with task_acks_late")
    args = parser.parse_args()
    h.need("MOTIR_DATABASE_URL", "CELERY_BROKER_URL")
    if args.late_acks:
        os.environ["BENCH_LATE_ACKS"] = "1"  # read by both apps in their workers
    with h.Database.create("motir_bench_cycle") as db:
        motir = h.Motir(db, app="bench.motir_app" if args.late_acks else "motir_celery")

        def durable() -> tuple[float, float, float]:
            rate = h.drain(motir, args.runs, 1, 2).rate
            per_child = db.rows(PER_CHILD)
            return h.median(r[0] for r in per_child), h.median(r[1] for r in per_child), 2 / rate

        rounds = h.interleave({"motir": durable, "plain": lambda: 2 / h.drain(h.Plain(), args.runs).rate}, args.rounds)
    print(f"pool child cycle, 1 worker x 2, {'late' if args.late_acks else 'early (default)'} acks, "
          f"{args.runs} runs x {args.rounds} rounds (medians)")
    for label, xs in (("motir: claim -> settle (exec)", [r[0] for r in rounds["motir"]]),
                      ("motir: settle -> next claim (hop)", [r[1] for r in rounds["motir"]]),
                      ("motir: whole cycle (2 / runs per s)", [r[2] for r in rounds["motir"]]),
                      ("plain Celery: whole cycle", rounds["plain"])):
        print(f"  {label:<38} {h.median(xs) * 1e3:5.2f} ms  ({', '.join(f'{x * 1e3:.2f}' for x in xs)})")


if __name__ == "__main__":
    main()
