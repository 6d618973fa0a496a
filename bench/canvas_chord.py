"""A chord of N trivial members, durable (ours) against Celery's own chord on the Redis result backend, same run.

    python -m bench.canvas_chord [--members 1000] [--rounds 3] [--concurrency 2] [--no-write]

Each side: one worker of ``--concurrency`` prefork processes, started once and warmed up;
then, round after round (the sides taking turns, ``harness.interleave``), the time from
``chord(header, body).delay()`` to the body's result in the caller's ``get()``. Celery's
chord is Celery's defaults with ``result_backend = redis://`` (the native join: each header
task's return INCRs a counter in Redis, the last one applies the body; no ``chord_unlock``
polling task). Ours is ``motir_celery.chord``: one canvas run whose header members are runs
of their own, woken by the last member's settle in Postgres.

**Exactly once, checked.** Every member's and every body's *execution* (not its stored
result) does ``HINCRBY <round key> <member> 1`` in Redis on both sides — ours in the
handler, outside ``step.run``, so a second execution would count twice. After each round
the hash must hold every member exactly once and the body exactly once, and the body's
result must be the sum; a round that fails the check is printed as such and fails the run.

The ratio printed is our median over Celery's. Writes its block into docs/performance.md
(below the notes marker, which the suite keeps) unless ``--no-write``.
"""

from __future__ import annotations

import os
import time
import uuid

from bench import harness as h
from bench.canvas_chord_jobs import COUNTS, body, check, member
from motir_celery import chord

MOTIR_QUEUE, PLAIN_QUEUE = "bench-chord-motir", "bench-chord-plain"
DOC = h.ROOT / "docs" / "performance.md"
def main() -> None:
    parser = h.parser("bench.canvas_chord", __doc__, write="docs/performance.md")
    parser.add_argument("--members", type=int, default=1000, help="header members (default 1000)")
    parser.add_argument("--rounds", type=int, default=3, help="turns each side takes (default 3)")
    parser.add_argument("--concurrency", type=int, default=2, help="each worker's processes (default 2)")
    opts = parser.parse_args()
    h.need("MOTIR_DATABASE_URL", "CELERY_BROKER_URL")
    n = opts.members
    # Celery's results in another database of the same Redis (the broker's is 0 in the bench's set-up).
    backend = os.environ.get("BENCH_CHORD_BACKEND") or os.environ["CELERY_BROKER_URL"].rsplit("/", 1)[0] + "/1"
    load = os.getloadavg()
    with h.Database.create("motir_bench_chord") as db:
        where = h.machine(db.url)
        h.use_engine(db.url, MOTIR_QUEUE, imports="bench.canvas_chord_jobs")
        h.purge_queue(MOTIR_QUEUE)
        h.purge_queue(PLAIN_QUEUE)
        plain_env = h.child_env(BENCH_CHORD_BACKEND=backend, BENCH_PLAIN_QUEUE=PLAIN_QUEUE, BENCH_COUNTER_URL=COUNTS)
        ours_env = h.child_env(MOTIR_DATABASE_URL=db.url, MOTIR_QUEUE=MOTIR_QUEUE, MOTIR_IMPORTS="bench.canvas_chord_jobs",
                               BENCH_COUNTER_URL=COUNTS)
        os.environ.update(BENCH_CHORD_BACKEND=backend, BENCH_PLAIN_QUEUE=PLAIN_QUEUE)
        from celery import chord as celery_chord

        from bench.canvas_chord_plain import add, tsum

        failures: list[str] = []

        def ours() -> float:
            key = f"bench-chord-{uuid.uuid4().hex}"
            t0 = time.monotonic()
            handle = chord([member.s(i, key) for i in range(n)], body.s(key)).delay()
            result = handle.get(timeout=1800)
            took = time.monotonic() - t0
            wrong = check(key, n, result)
            if wrong:
                failures.append(f"motir: {wrong}")
            return took

        def celerys() -> float:
            key = f"bench-chord-{uuid.uuid4().hex}"
            t0 = time.monotonic()
            result = celery_chord([add.s(i, key) for i in range(n)])(tsum.s(key)).get(timeout=1800)
            took = time.monotonic() - t0
            wrong = check(key, n, result)
            if wrong:
                failures.append(f"celery: {wrong}")
            return took

        with h.workers("motir_celery", MOTIR_QUEUE, 1, opts.concurrency, env=ours_env, tag="chord-motir",
                       loglevel="INFO", ready=True), \
                h.workers("bench.canvas_chord_plain", PLAIN_QUEUE, 1, opts.concurrency, env=plain_env,
                          tag="chord-celery", loglevel="INFO", ready=True):
            sides = {"celery chord (redis backend)": celerys, "motir chord (durable)": ours}
            warm = n
            n = min(50, warm)  # warm-up: imports, connections, the Redis lane's plan
            for side in sides.values():
                side()
            n = warm
            failures.clear()
            rounds = h.interleave(sides, opts.rounds, log=print, show=lambda s: f"{s:.2f}s")
        h.purge_queue(MOTIR_QUEUE)
        h.purge_queue(PLAIN_QUEUE)
    celery_median = h.median(rounds["celery chord (redis backend)"])
    ours_median = h.median(rounds["motir chord (durable)"])
    print(f"chord of {n}: from .delay() to the body's result, median of {opts.rounds} rounds")
    h.report(rounds, "celery chord (redis backend)", "s", digits=2)
    exactly = "every member and the body ran exactly once in every round, on both sides" if not failures else \
        "NOT exactly once: " + "; ".join(failures)
    print(exactly)
    block = "\n".join([
        f"### A chord of {n} trivial members, durable against Celery's own (`python -m bench.canvas_chord`)",
        "",
        f"{h.now()}, {where}, load at start {' '.join(f'{x:.2f}' for x in load)}; one worker of "
        f"{opts.concurrency} prefork processes a side, warmed up; {opts.rounds} rounds, the sides taking turns.",
        "",
        "| side | `.delay()` to the body's result (median) | rounds | exactly once (members, body) |",
        "|---|---|---|---|",
        f"| Celery's chord, Redis result backend (native join, no `chord_unlock`) | {celery_median:.2f} s | "
        f"{', '.join(f'{x:.2f}' for x in rounds['celery chord (redis backend)'])} | "
        f"{'yes' if not any(f.startswith('celery') for f in failures) else 'NO'} |",
        f"| motir-celery's durable chord (Postgres) | {ours_median:.2f} s | "
        f"{', '.join(f'{x:.2f}' for x in rounds['motir chord (durable)'])} | "
        f"{'yes' if not any(f.startswith('motir') for f in failures) else 'NO'} |",
        "",
        f"Ratio: ours takes **x{ours_median / celery_median:.2f}** Celery's time. Every execution of a member or "
        "a body counted once in Redis (`HINCRBY`, outside any step), checked after each round.",
    ])
    h.write_block("bench.canvas_chord", block, DOC, write=not getattr(opts, "no_write", False))
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
