"""Scale with depth: claim + settle and the sweeper's queries with 10k vs 1M rows in job_queue.

The table is filled with one INSERT ... SELECT generate_series: 90% finished
runs (succeeded, with a result) and 10% queued runs that are due and were
dispatched just now (a deep, healthy backlog: nothing for the sweeper to
re-publish). Then, at each depth, after VACUUM ANALYZE:

* claim + settle: fresh runs are claimed and settled with the engine's own
  statements (``worker_sql.claim`` / ``worker_sql.settle_succeeded``) on one autocommit
  connection, as a worker does; the median of each is reported;
* sweep: ``maintenance_sql.reclaim_expired`` and ``maintenance_sql.republish_due`` (each in its
  own transaction, as ``sweeper.sweep`` runs them), median of several calls.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from bench.common import truncate
from bench.stats import median

_SEED = text(
    """
    INSERT INTO job_queue (job_id, scheduled_for, event_name, max_attempts, retry_policy, state, attempts,
                           run_at, dispatched_at, created_at, finished_at, result)
    SELECT 'bench.depth', timestamptz '2000-01-01' + make_interval(secs => g), 'scheduled.bench.depth', 3,
           'transient',
           CASE WHEN g % 10 = 0 THEN 'queued' ELSE 'succeeded' END,
           CASE WHEN g % 10 = 0 THEN 0 ELSE 1 END,
           now() - interval '1 minute', now(), now() - interval '1 hour',
           CASE WHEN g % 10 = 0 THEN NULL ELSE now() - interval '30 minutes' END,
           CASE WHEN g % 10 = 0 THEN NULL ELSE jsonb_build_object('ok', true) END
    FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint)) g
    """
)


def _seed(url: str, lo: int, hi: int) -> None:
    engine = create_engine(url, poolclass=NullPool)
    step = 200_000
    for a in range(lo, hi + 1, step):
        with engine.begin() as conn:
            conn.execute(_SEED, {"lo": a, "hi": min(hi, a + step - 1)})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE job_queue"))
    engine.dispose()


def _measure(url: str, runs: int, sweeps: int) -> dict[str, float]:
    from motir_celery.core.producer.events import send_event
    from motir_celery.store.sql import maintenance as maintenance_sql
    from motir_celery.store.sql import worker as worker_sql

    ids = [send_event("bench.three", {"n": i}, publish=None).run_ids[0] for i in range(runs)]
    engine = create_engine(url, poolclass=NullPool)
    claim_t, settle_t = [], []
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for run_id in ids:
            t0 = time.perf_counter()
            c = worker_sql.claim(conn, run_id, job_id="bench.three", worker="bench/depth", lease_seconds=60)
            t1 = time.perf_counter()
            assert c is not None
            assert worker_sql.settle_succeeded(conn, c, '{"ok":true}')
            t2 = time.perf_counter()
            claim_t.append(t1 - t0)
            settle_t.append(t2 - t1)
    reclaim_t, republish_t = [], []
    for _ in range(sweeps):
        with engine.begin() as conn:
            t0 = time.perf_counter()
            maintenance_sql.reclaim_expired(conn)
            reclaim_t.append(time.perf_counter() - t0)
        with engine.begin() as conn:
            t0 = time.perf_counter()
            found = maintenance_sql.republish_due(conn, after_seconds=3600)
            republish_t.append(time.perf_counter() - t0)
            assert not found
    engine.dispose()
    return {"claim_ms": median(claim_t) * 1e3, "settle_ms": median(settle_t) * 1e3,
            "reclaim_ms": median(reclaim_t) * 1e3, "republish_ms": median(republish_t) * 1e3}


def measure(url: str, small: int = 10_000, large: int = 1_000_000, runs: int = 300, sweeps: int = 20) -> dict[str, Any]:
    truncate(url)
    t0 = time.perf_counter()
    _seed(url, 1, small)
    shallow = _measure(url, runs, sweeps)
    _seed(url, small + 1, large)
    seeded = time.perf_counter() - t0
    deep = _measure(url, runs, sweeps)
    truncate(url)
    return {"small": small, "large": large, "shallow": shallow, "deep": deep, "seed_s": seeded,
            "ratio": {k: deep[k] / shallow[k] for k in shallow}}
