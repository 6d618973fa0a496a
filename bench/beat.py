"""Beat: ``enqueue_scheduled`` calls/s with 3 concurrent beats hammering the same slots.

Three processes (spawned, each with its own pool) walk the same ``slots`` cron slots of
one job in the same order, each call in its own transaction as a beat makes it. Every
slot must come out exactly once (one ``Queued``, the other calls ``AlreadyQueued``).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import create_engine, text

from bench import harness as h

JOB = "bench.beat"


def _beat(url: str, slots: int, start_at: float, out: Any) -> None:
    from motir_celery.store import records
    from motir_celery.store.sql import producer

    engine = create_engine(url, pool_size=1)
    base = datetime(2030, 1, 1, tzinfo=timezone.utc)
    with engine.connect() as conn:  # connected before the start line
        conn.execute(text("SELECT 1"))
    time.sleep(max(0.0, start_at - time.time()))
    queued, t0 = 0, time.perf_counter()
    for i in range(slots):
        with engine.begin() as conn:
            r = producer.enqueue_scheduled(conn, JOB, base + timedelta(minutes=i), max_attempts=3, policy="transient")
        queued += isinstance(r, records.Queued)
    out.put((queued, time.perf_counter() - t0))
    engine.dispose()


def measure(db: h.Database, slots: int = 2000, beats: int = 3) -> dict[str, Any]:
    db.truncate()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 3.0
    procs = [ctx.Process(target=_beat, args=(db.url, slots, start_at, out)) for _ in range(beats)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    rows = db.value("SELECT count(*) FROM job_queue WHERE job_id = %s", (JOB,))
    db.truncate()
    queued, elapsed = sum(r[0] for r in results), max(r[1] for r in results)
    if queued != slots or rows != slots:
        raise RuntimeError(f"beat: {queued} Queued and {rows} rows for {slots} slots")
    return {"beats": beats, "slots": slots, "calls_per_s": beats * slots / elapsed, "slots_per_s": slots / elapsed}
