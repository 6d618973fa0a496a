"""Scale with depth: claim + settle and the sweeper's queries with 10k vs 1M rows in job_queue.

The table is filled with ``INSERT ... SELECT generate_series``: 90 % finished runs (succeeded,
with a result) and 10 % queued runs, due and dispatched just now (a deep, healthy backlog:
nothing for the sweeper to re-publish). At each depth, after VACUUM ANALYZE: fresh runs are
claimed and settled with the engine's statements on one autocommit connection, as a worker
does, and the sweeper's two statements run in their own transactions; medians of each.
"""

from __future__ import annotations

import time
from typing import Any

from bench import harness as h

SEED = """
    INSERT INTO job_queue (job_id, scheduled_for, event_name, max_attempts, retry_policy, state, attempts,
                           run_at, dispatched_at, created_at, finished_at, result)
    SELECT 'bench.depth', timestamptz '2000-01-01' + make_interval(secs => g), 'scheduled.bench.depth', 3,
           'transient',
           CASE WHEN g %% 10 = 0 THEN 'queued' ELSE 'succeeded' END,
           CASE WHEN g %% 10 = 0 THEN 0 ELSE 1 END,
           now() - interval '1 minute', now(), now() - interval '1 hour',
           CASE WHEN g %% 10 = 0 THEN NULL ELSE now() - interval '30 minutes' END,
           CASE WHEN g %% 10 = 0 THEN NULL ELSE jsonb_build_object('ok', true) END
    FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) g
"""


def seed(db: h.Database, lo: int, hi: int) -> None:
    for a in range(lo, hi + 1, 200_000):
        db.rows(SEED, {"lo": a, "hi": min(hi, a + 199_999)})
    db.rows("VACUUM ANALYZE job_queue")


def timings(runs: int, sweeps: int) -> dict[str, float]:
    from motir_celery.core.producer.events import send_event
    from motir_celery.store.db import get_engine
    from motir_celery.store.sql import maintenance, worker

    ids = [send_event("bench.three", {"n": i}, publish=None).run_ids[0] for i in range(runs)]
    t: dict[str, list[float]] = {"claim_ms": [], "settle_ms": [], "reclaim_ms": [], "republish_ms": []}
    with get_engine().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for run_id in ids:
            t0 = time.perf_counter()
            c = worker.claim(conn, run_id, job_id="bench.three", worker="bench/depth", lease_seconds=60)
            t1 = time.perf_counter()
            assert c is not None and worker.settle_succeeded(conn, c, '{"ok":true}')
            t["claim_ms"].append(t1 - t0)
            t["settle_ms"].append(time.perf_counter() - t1)
    for _ in range(sweeps):
        for key, sweep in (("reclaim_ms", lambda c: maintenance.reclaim_expired(c)),
                           ("republish_ms", lambda c: maintenance.republish_due(c, after_seconds=3600))):
            with get_engine().begin() as conn:
                t0 = time.perf_counter()
                found = sweep(conn)
                t[key].append(time.perf_counter() - t0)
                assert key == "reclaim_ms" or not found
    return {k: h.median(v) * 1e3 for k, v in t.items()}


def measure(db: h.Database, small: int = 10_000, large: int = 1_000_000, runs: int = 300,
            sweeps: int = 20) -> dict[str, Any]:
    db.truncate()
    t0 = time.perf_counter()
    seed(db, 1, small)
    shallow = timings(runs, sweeps)
    seed(db, small + 1, large)
    seeded = time.perf_counter() - t0
    deep = timings(runs, sweeps)
    db.truncate()
    return {"small": small, "large": large, "shallow": shallow, "deep": deep, "seed_s": seeded,
            "ratio": {k: deep[k] / shallow[k] for k in shallow}}
