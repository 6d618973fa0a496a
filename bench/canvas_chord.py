"""A chord of N trivial members, durable (ours) against Celery's own chord on the Redis result backend, same run.

    python -m bench.canvas_chord [--members 1000] [--rounds 3] [--concurrency 2] [--no-write]

Each side: one worker of ``--concurrency`` prefork processes, started once and warmed up; then,
the sides taking turns, the time from ``chord(header, body).delay()`` to the body's result in
the caller's ``get()``. Celery's side (``bench.canvas_chord_plain``) joins natively on Redis;
ours is ``motir_celery.chord`` (``bench.jobs``). Every execution of a member or a body counts
itself in Redis on both sides: after each round every member and the body must have run exactly
once and the result be the sum, else the run fails. Writes its block into docs/performance.md.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any, Callable

from bench import harness as h

MOTIR_QUEUE, PLAIN_QUEUE = "bench-chord-motir", "bench-chord-plain"
CELERY, OURS = "celery chord (redis backend)", "motir chord (durable)"


def check(key: str, n: int, result: Any) -> str:
    """'' when every member and the body ran exactly once and the result is the sum; else what is wrong."""
    from bench.jobs import counter

    seen = {k.decode(): int(v) for k, v in counter().hgetall(key).items()}
    counter().delete(key)
    members, wrong = [seen.get(str(i), 0) for i in range(n)], []
    if any(c != 1 for c in members):
        wrong.append(f"members not run exactly once: {members.count(0)} never, "
                     f"{sum(1 for c in members if c > 1)} more than once")
    if seen.get("body", 0) != 1:
        wrong.append(f"body ran {seen.get('body', 0)} times")
    if result != sum(range(n)):
        wrong.append(f"body's result {result!r}, not {sum(range(n))}")
    return "; ".join(wrong)


def main() -> None:
    parser = h.parser("bench.canvas_chord", __doc__, write="docs/performance.md")
    parser.add_argument("--members", type=int, default=1000, help="header members (default 1000)")
    parser.add_argument("--rounds", type=int, default=3, help="turns each side takes (default 3)")
    parser.add_argument("--concurrency", type=int, default=2, help="each worker's processes (default 2)")
    opts = parser.parse_args()
    h.need("MOTIR_DATABASE_URL", "CELERY_BROKER_URL")
    # Celery's results in another database of the same Redis (the broker's is 0 in the bench's set-up).
    backend = os.environ.get("BENCH_CHORD_BACKEND") or os.environ["CELERY_BROKER_URL"].rsplit("/", 1)[0] + "/1"
    os.environ.update(BENCH_CHORD_BACKEND=backend, BENCH_PLAIN_QUEUE=PLAIN_QUEUE)
    load, failures = os.getloadavg(), []
    with h.Database.create("motir_bench_chord") as db:
        where = h.machine(db.url)
        h.use_engine(db.url, MOTIR_QUEUE, imports="bench.jobs")
        from celery import chord as celery_chord

        from bench.canvas_chord_plain import add, tsum
        from bench.jobs import body, member
        from motir_celery import chord

        def side(name: str, run: Callable[[list[int], str], Any], members: int) -> Callable[[], float]:
            def measure() -> float:
                key, t0 = f"bench-chord-{uuid.uuid4().hex}", time.monotonic()
                result = run(list(range(members)), key).get(timeout=1800)
                took = time.monotonic() - t0
                if wrong := check(key, members, result):
                    failures.append(f"{name}: {wrong}")
                return took
            return measure

        def sides(members: int) -> dict[str, Callable[[], float]]:
            return {CELERY: side("celery", lambda ns, k: celery_chord([add.s(i, k) for i in ns])(tsum.s(k)), members),
                    OURS: side("motir", lambda ns, k: chord([member.s(i, k) for i in ns], body.s(k)).delay(), members)}

        h.purge_queue(MOTIR_QUEUE)
        h.purge_queue(PLAIN_QUEUE)
        with h.workers("motir_celery", MOTIR_QUEUE, 1, opts.concurrency, tag="chord-motir", loglevel="INFO",
                       ready=True, env=h.engine_env(db.url, MOTIR_QUEUE, "bench.jobs")), \
                h.workers("bench.canvas_chord_plain", PLAIN_QUEUE, 1, opts.concurrency, tag="chord-celery",
                          loglevel="INFO", ready=True):
            for warm in sides(min(50, opts.members)).values():  # imports, connections, the Redis lane's plan
                warm()
            failures.clear()
            rounds = h.interleave(sides(opts.members), opts.rounds, log=print, show=lambda s: f"{s:.2f}s")
        h.purge_queue(MOTIR_QUEUE)
        h.purge_queue(PLAIN_QUEUE)
    print(f"chord of {opts.members}: from .delay() to the body's result, median of {opts.rounds} rounds")
    h.report(rounds, CELERY, "s", digits=2)
    print("every member and the body ran exactly once in every round, on both sides" if not failures else
          "NOT exactly once: " + "; ".join(failures))

    def row(label: str, name: str, who: str) -> str:
        once = "NO" if any(f.startswith(who) for f in failures) else "yes"
        return f"| {label} | {h.median(rounds[name]):.2f} s | {', '.join(f'{x:.2f}' for x in rounds[name])} | {once} |"

    block = "\n".join([
        f"### A chord of {opts.members} trivial members, durable against Celery's own "
        "(`python -m bench.canvas_chord`)", "",
        f"{h.now()}, {where}, load at start {' '.join(f'{x:.2f}' for x in load)}; one worker of "
        f"{opts.concurrency} prefork processes a side, warmed up; {opts.rounds} rounds, the sides taking turns.", "",
        "| side | `.delay()` to the body's result (median) | rounds | exactly once (members, body) |",
        "|---|---|---|---|",
        row("Celery's chord, Redis result backend (native join, no `chord_unlock`)", CELERY, "celery"),
        row("motir-celery's durable chord (Postgres)", OURS, "motir"), "",
        f"Ratio: ours takes **x{h.median(rounds[OURS]) / h.median(rounds[CELERY]):.2f}** Celery's time. Every "
        "execution of a member or a body counted once in Redis (`HINCRBY`, outside any step), checked after each round.",
    ])
    h.write_block("bench.canvas_chord", block, h.ROOT / "docs" / "performance.md", write=not opts.no_write)
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
