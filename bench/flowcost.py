"""Flow control and the stats rollup, measured: what they cost the jobs that do not use them, and what the fold costs.

In-process (no Celery, no broker): ``runner.execute`` of runs written beforehand, on a fresh
database of the shared harness (``harness.Database``); each comparison's sides take turns in
the same run (``harness.interleave``), so a loaded machine's drift falls on both.

1. **A plain run's claim and settle**, flow control's branch as shipped (``on``: the runner asks
   ``flow.options_of`` for every run) against the same runner with that lookup replaced by a
   constant (``off``: the code before it). A plain job sends the same two statements either way
   (tests/core/test_flow_control.py proves it); this is the Python that is left.
2. **The succeeded-duration index** (``ix_job_queue_succeeded``, one more index entry per
   succeeded settle): plain runs with it, and with it dropped between rounds; and the settle's
   UPDATE alone, in a server-side loop (no client, no Python: the index's own cost).
3. **A throttled run that never waits** (``throttle=(1000, 0.01)``) against a plain one: the price
   of the decision's statements, paid by throttled jobs only.
4. **The fold**: finished runs folded into the rollup per second, in its batches of 2,000.
5. **The hot row the rollup does not have**: 16 threads, each UPDATE adding 1 to one counter row
   (the per-settle UPDATE of one row per job the issue rejects), against the same threads each
   on a row of its own; autocommit, as a settle commits.

    python -m bench.flowcost [--runs 600] [--rounds 3] [--no-write]

Writes its block into docs/performance.md (between its markers).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from bench import harness as h
from bench.jobs import PLAIN, THROTTLED


def _runs(job: str, n: int) -> list[Any]:
    from motir_celery.core.producer import events

    out = []
    for i in range(n):
        out += events.send_event(job, {"n": i}, publish=None).run_ids
    return out


def _execute_each(job: str, runs: list[Any]) -> float:
    """Median seconds of one ``runner.execute`` (claim, handler, settle) over ``runs``."""
    from motir_celery.core.worker import runner

    took = []
    for run_id in runs:
        t0 = time.perf_counter()
        outcome = runner.execute(run_id, job_id=job, worker="bench/1")
        took.append(time.perf_counter() - t0)
        assert outcome.state == "succeeded", outcome
    return h.median(took)


def _side(job: str, n: int, before: Callable[[], None] = lambda: None,
          after: Callable[[], None] = lambda: None) -> Callable[[], float]:
    def measure() -> float:
        runs = _runs(job, n)
        before()
        try:
            return _execute_each(job, runs)
        finally:
            after()
    return measure


def lookup_ns(calls: int = 200_000) -> float:
    """Nanoseconds of the one thing the branch adds to a plain run: ``flow.options_of(job)``."""
    from motir_celery.core.worker import flow

    t0 = time.perf_counter()
    for _ in range(calls):
        flow.options_of(PLAIN)
    return (time.perf_counter() - t0) / calls * 1e9


def flow_branch(db: h.Database, n: int, rounds: int) -> dict[str, list[float]]:
    from motir_celery.core.worker import flow

    real = flow.options_of
    _side(PLAIN, n)()  # warm up: the pool, the prepared statements, the caches

    def off() -> None:
        flow.options_of = lambda job_id: None  # type: ignore[assignment]

    def on() -> None:
        flow.options_of = real  # type: ignore[assignment]

    try:
        return h.interleave({"on": _side(PLAIN, n, on), "off": _side(PLAIN, n, off, on)}, rounds, log=print,
                            show=lambda s: f"{s * 1e3:.3f} ms/run")
    finally:
        flow.options_of = real  # type: ignore[assignment]


def succeeded_index(db: h.Database, n: int, rounds: int) -> dict[str, list[float]]:
    create = "CREATE INDEX ix_job_queue_succeeded ON job_queue (job_id, finished_at) WHERE state = 'succeeded'"

    def drop() -> None:
        db.rows("DROP INDEX ix_job_queue_succeeded")

    def restore() -> None:
        db.rows(create)

    return h.interleave({"with": _side(PLAIN, n), "without": _side(PLAIN, n, drop, restore)}, rounds, log=print,
                        show=lambda s: f"{s * 1e3:.3f} ms/run")


def settle_loop(db: h.Database, n: int, rounds: int) -> dict[str, list[float]]:
    """Microseconds of one succeeded settle's UPDATE, server-side (a plpgsql loop over ``n`` running rows,
    no client in between), with ``ix_job_queue_succeeded`` and without it, rounds interleaved."""
    create = "CREATE INDEX ix_job_queue_succeeded ON job_queue (job_id, finished_at) WHERE state = 'succeeded'"
    loop = f"""
    DO $$
    DECLARE r record; t0 timestamptz := clock_timestamp();
    BEGIN
      FOR r IN SELECT id FROM job_queue WHERE state = 'running' LOOP
        UPDATE job_queue SET state = 'succeeded', result = '1'::jsonb, finished_at = now(),
                             claim_token = NULL, lease_expires_at = NULL WHERE id = r.id;
      END LOOP;
      PERFORM set_config('bench.took', (extract(epoch FROM clock_timestamp() - t0) * 1e6 / {n})::text, false);
    END $$;
    """

    def measure(with_index: bool) -> float:
        db.truncate()
        db.rows("INSERT INTO job_queue (job_id, event_name, state, attempts, max_attempts, retry_policy, claim_token) "
                "SELECT 'job.' || (i %% 20), 'e', 'running', 1, 3, 'transient', gen_random_uuid() "
                "FROM generate_series(1, %s) AS i", (n,))
        if not with_index:
            db.rows("DROP INDEX ix_job_queue_succeeded")
        try:
            with h.connect(db.url) as conn:
                conn.autocommit = True
                conn.execute(loop)
                return float(conn.execute("SELECT current_setting('bench.took')").fetchone()[0]) / 1e6  # type: ignore[index]
        finally:
            if not with_index:
                db.rows(create)

    return h.interleave({"with": lambda: measure(True), "without": lambda: measure(False)}, rounds, log=print,
                        show=lambda s: f"{s * 1e6:.1f} µs/settle")


def throttle(db: h.Database, n: int, rounds: int) -> dict[str, list[float]]:
    return h.interleave({"plain": _side(PLAIN, n), "throttled": _side(THROTTLED, n)}, rounds, log=print,
                        show=lambda s: f"{s * 1e3:.3f} ms/run")


def fold(db: h.Database, n: int) -> float:
    """Runs folded per second (``n`` finished runs written by SQL, each with its one attempt)."""
    from motir_celery.core.worker import rollup
    from motir_celery.store.db import get_engine

    db.truncate("job_stats_rollup")
    db.rows("UPDATE job_sweep SET swept_at = '-infinity' WHERE name = 'stats'")
    db.rows(
        """
        WITH q AS (
          INSERT INTO job_queue (job_id, event_name, workspace_id, state, attempts, max_attempts, retry_policy,
                                 created_at, finished_at)
          SELECT 'job.' || (i %% 20), 'e', 'ws-' || (i %% 5), CASE WHEN i %% 40 = 0 THEN 'failed' ELSE 'succeeded' END,
                 1, 3, 'transient', now() - make_interval(secs => i * 0.01 + 1), now() - make_interval(secs => i * 0.01)
          FROM generate_series(1, %s) AS i
          RETURNING id, job_id, workspace_id, created_at, finished_at
        )
        INSERT INTO job_run (run_id, attempt, workspace_id, job_id, event_name, worker, outcome, started_at, finished_at)
        SELECT id, 1, workspace_id, job_id, 'e', 'w', 'succeeded', created_at, finished_at FROM q
        """, (n,))
    db.rows("ANALYZE job_queue")
    engine = get_engine(db.url)
    t0 = time.perf_counter()
    folded = rollup.fold(engine, batches=10**6)
    took = time.perf_counter() - t0
    assert folded == n, (folded, n)
    return n / took


def hot_row(db: h.Database, threads: int, each: int) -> dict[str, float]:
    """UPDATEs a second: every thread on one counter row (a per-settle rollup) vs each on its own row."""
    db.rows("TRUNCATE job_stats_rollup")
    db.rows("INSERT INTO job_stats_rollup (job_id, workspace_id, bucket, duration_buckets) "
            "SELECT 'hot.' || i, NULL, NULL, ARRAY[0]::bigint[] FROM generate_series(0, %s) AS i", (threads,))

    def rate(one_row: bool) -> float:
        barrier = threading.Barrier(threads)

        def work(k: int) -> None:
            with h.connect(db.url) as conn:
                conn.autocommit = True
                barrier.wait()
                for _ in range(each):
                    conn.execute("UPDATE job_stats_rollup SET succeeded_count = succeeded_count + 1 "
                                 "WHERE job_id = %s AND bucket IS NULL", ("hot.0" if one_row else f"hot.{k + 1}",))

        pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        t0 = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        return threads * each / (time.perf_counter() - t0)

    out = {"one row": [], "own rows": []}  # type: dict[str, list[float]]
    for _ in range(3):
        out["one row"].append(rate(True))
        out["own rows"].append(rate(False))
    return {k: h.median(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> None:
    p = h.parser("bench.flowcost", __doc__, write="docs/performance.md")
    p.add_argument("--runs", type=int, default=600, help="runs per side per round (default 600)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per comparison (default 3)")
    p.add_argument("--fold-runs", type=int, default=20_000, help="finished runs the fold measurement folds")
    args = p.parse_args(argv)
    h.need("MOTIR_DATABASE_URL")
    with h.Database.create("motir_bench_flowcost") as db:
        h.use_engine(db.url, "bench-flowcost", imports="bench.jobs")
        branch = flow_branch(db, args.runs, args.rounds)
        index = succeeded_index(db, args.runs, args.rounds)
        loop = settle_loop(db, 5000, 2 * args.rounds + 1)
        thr = throttle(db, args.runs, args.rounds)
        folded = fold(db, args.fold_runs)
        hot = hot_row(db, threads=16, each=100)
        lookup = lookup_ns()
        machine = h.machine(db.url, load=True)
    us = lambda xs: h.median(xs) * 1e6  # noqa: E731
    lines = [
        f"Measured {h.now()} on {machine}: `{h.command('bench.flowcost')}`. Medians of {args.rounds} interleaved "
        f"rounds of {args.runs} runs a side (one `runner.execute`: claim, handler, settle; in process).",
        "",
        "| what | a side | the other side | difference |",
        "|---|---|---|---|",
        f"| flow control's branch, plain job | on: {us(branch['on']):.0f} µs/run | off: {us(branch['off']):.0f} µs/run "
        f"| {us(branch['on']) - us(branch['off']):+.0f} µs (noise: the branch adds one registry lookup, "
        f"{lookup:.0f} ns, and no statement) |",
        f"| `ix_job_queue_succeeded`, plain job | with: {us(index['with']):.0f} µs/run | without: "
        f"{us(index['without']):.0f} µs/run | {us(index['with']) - us(index['without']):+.0f} µs |",
        f"| the same, the settle's UPDATE alone (server-side loop, 5,000 settles) | with: {us(loop['with']):.1f} µs "
        f"| without: {us(loop['without']):.1f} µs | {us(loop['with']) - us(loop['without']):+.1f} µs per succeeded run |",
        f"| `throttle=(1000, 0.01)`, never waiting | throttled: {us(thr['throttled']):.0f} µs/run | plain: "
        f"{us(thr['plain']):.0f} µs/run | {us(thr['throttled']) - us(thr['plain']):+.0f} µs (its jobs only) |",
        "",
        f"The fold: {folded:,.0f} finished runs folded a second ({args.fold_runs:,} runs, 20 jobs × 5 workspaces, "
        "batches of 2,000: one statement each marks, sums and upserts).",
        "",
        f"The hot row it avoids (16 threads × 100 autocommit UPDATEs, as a per-settle counter would be): "
        f"{hot['one row']:,.0f} UPDATEs/s on one row against {hot['own rows']:,.0f}/s on a row each "
        f"({hot['one row'] / hot['own rows']:.2f}×): every settle of a busy job would queue behind the last one's commit.",
    ]
    h.write_block("bench.flowcost", "\n".join(lines), h.ROOT / "docs" / "performance.md", write=not args.no_write)


if __name__ == "__main__":
    main()
