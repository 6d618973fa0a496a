"""Flow control and the stats rollup (issue 30): what they cost the jobs that do not use them, and what the fold costs.

    python -m bench.flowcost [--runs 600] [--rounds 3] [--no-write]

In process, on a fresh database, ``runner.execute`` (claim, handler, settle) of runs written
beforehand, each comparison's sides taking turns: flow control's branch on and off (``flow.options_of``
replaced by a constant); ``ix_job_queue_succeeded`` kept and dropped (and the settle's UPDATE alone, in
a server-side loop); a throttled job that never waits against a plain one. Then the fold's rate, and 16
threads' UPDATEs on one counter row against a row each. Writes its block into docs/performance.md.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from bench import harness as h
from bench.jobs import PLAIN, THROTTLED

SUCCEEDED_INDEX = "CREATE INDEX ix_job_queue_succeeded ON job_queue (job_id, finished_at) WHERE state = 'succeeded'"
SETTLE_LOOP = """
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
FINISHED_RUNS = """
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
"""


def side(job: str, n: int, before: Callable[[], Any] = lambda: None,
         after: Callable[[], Any] = lambda: None) -> Callable[[], float]:
    """Median seconds of one ``runner.execute`` over ``n`` runs of ``job`` sent first (``before`` and
    ``after`` around the executes)."""
    from motir_celery.core.producer import events
    from motir_celery.core.worker import runner

    def execute(run_id: Any) -> None:
        outcome = runner.execute(run_id, job_id=job, worker="bench/1")
        assert outcome.state == "succeeded", outcome

    def measure() -> float:
        runs = [i for k in range(n) for i in events.send_event(job, {"n": k}, publish=None).run_ids]
        before()
        try:
            return h.median(h.timed(lambda i: execute(runs[i]), len(runs)))
        finally:
            after()
    return measure


def compare(sides: dict[str, Callable[[], float]], rounds: int, unit: str = "ms/run", scale: float = 1e3) -> dict:
    return h.interleave(sides, rounds, log=print, show=lambda s: f"{s * scale:.{1 if scale > 1e3 else 3}f} {unit}")


def settle_loop(db: h.Database, n: int, with_index: bool) -> float:
    """Seconds of one succeeded settle's UPDATE, server-side (a plpgsql loop over ``n`` running rows)."""
    db.truncate()
    db.rows("INSERT INTO job_queue (job_id, event_name, state, attempts, max_attempts, retry_policy, claim_token) "
            "SELECT 'job.' || (i %% 20), 'e', 'running', 1, 3, 'transient', gen_random_uuid() "
            "FROM generate_series(1, %s) AS i", (n,))
    if not with_index:
        db.rows("DROP INDEX ix_job_queue_succeeded")
    try:
        with h.connect(db.url) as conn:
            conn.execute(SETTLE_LOOP.format(n=n))  # type: ignore[arg-type]
            return float(conn.execute("SELECT current_setting('bench.took')").fetchone()[0]) / 1e6  # type: ignore[index]
    finally:
        if not with_index:
            db.rows(SUCCEEDED_INDEX)


def fold(db: h.Database, n: int) -> float:
    """Runs folded per second (``n`` finished runs written by SQL, each with its one attempt)."""
    from motir_celery.core.worker import rollup
    from motir_celery.store.db import get_engine

    db.truncate("job_stats_rollup")
    db.rows("UPDATE job_sweep SET swept_at = '-infinity' WHERE name = 'stats'")
    db.rows(FINISHED_RUNS, (n,))
    db.rows("ANALYZE job_queue")
    t0 = time.perf_counter()
    folded = rollup.fold(get_engine(db.url), batches=10**6)
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

    out: dict[str, list[float]] = {"one row": [], "own rows": []}
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
    n, rounds = args.runs, args.rounds
    with h.Database.create("motir_bench_flowcost") as db:
        h.use_engine(db.url, "bench-flowcost", imports="bench.jobs")
        from motir_celery.core.worker import flow

        real = flow.options_of
        side(PLAIN, n)()  # warm up: the pool, the prepared statements, the caches
        try:
            branch = compare({"on": side(PLAIN, n, lambda: setattr(flow, "options_of", real)),
                              "off": side(PLAIN, n, lambda: setattr(flow, "options_of", lambda job_id: None),
                                          lambda: setattr(flow, "options_of", real))}, rounds)
        finally:
            flow.options_of = real  # type: ignore[assignment]
        index = compare({"with": side(PLAIN, n), "without": side(PLAIN, n, lambda: db.rows("DROP INDEX ix_job_queue_succeeded"),
                                                                 lambda: db.rows(SUCCEEDED_INDEX))}, rounds)
        loop = compare({"with": lambda: settle_loop(db, 5000, True), "without": lambda: settle_loop(db, 5000, False)},
                       2 * rounds + 1, "µs/settle", 1e6)
        thr = compare({"plain": side(PLAIN, n), "throttled": side(THROTTLED, n)}, rounds)
        folded = fold(db, args.fold_runs)
        hot = hot_row(db, threads=16, each=100)
        t0 = time.perf_counter()
        for _ in range(200_000):  # the one thing the branch adds to a plain run
            flow.options_of(PLAIN)
        lookup = (time.perf_counter() - t0) / 200_000 * 1e9
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
