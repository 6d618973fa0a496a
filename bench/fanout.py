"""Fan-out: one event with 50 subscribers; ``send_event`` time and rows/s.

``send_event`` writes the event and its 50 runs in one transaction, then
publishes 50 messages (the engine's publisher, to the bench queue, purged
afterwards). Measured twice: with publishing (what a caller waits for) and
with ``publish=None`` (the database part alone). Median of ``rounds`` events.
"""

from __future__ import annotations

import time
from typing import Any

from bench.common import MOTIR_QUEUE, purge, truncate
from bench.stats import median


def measure(url: str, rounds: int = 30) -> dict[str, Any]:
    import motir_celery
    from bench import fanout_jobs
    from motir_celery.adapter.celery_app import default_app
    from motir_celery.core.producer import events

    truncate(url)
    purge(default_app(), MOTIR_QUEUE)
    motir_celery.send_event(fanout_jobs.EVENT, {"warm": True})  # pool, prepared statements, broker connection
    with_publish, db_only = [], []
    for i in range(rounds):
        t0 = time.perf_counter()
        r = motir_celery.send_event(fanout_jobs.EVENT, {"i": i})
        with_publish.append(time.perf_counter() - t0)
        assert len(r.run_ids) == fanout_jobs.SUBSCRIBERS
        t0 = time.perf_counter()
        r = events.send_event(fanout_jobs.EVENT, {"i": i}, publish=None)
        db_only.append(time.perf_counter() - t0)
        assert len(r.run_ids) == fanout_jobs.SUBSCRIBERS
    purge(default_app(), MOTIR_QUEUE)
    truncate(url)
    rows = fanout_jobs.SUBSCRIBERS + 1
    t, d = median(with_publish), median(db_only)
    return {"subscribers": fanout_jobs.SUBSCRIBERS, "ms": t * 1e3, "rows_per_s": rows / t,
            "db_ms": d * 1e3, "db_rows_per_s": rows / d}
