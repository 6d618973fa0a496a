"""The stats rollup: finished runs folded into per-job counts and durations, off the hot path.

``fold`` runs in the fleet's sweep slot (core/worker/sweeper.py: one sweeper per period,
fleet-wide) and adds the runs finished since the watermark (``job_sweep`` row ``stats``)
to ``job_stats_rollup`` in set-based batches: one statement per batch locks a batch of
finished runs not counted yet (``FOR UPDATE SKIP LOCKED``), marks each (``folded_at =
finished_at``), upserts the sums of their (job, workspace, 5-minute bucket) and (job,
workspace) totals rows, and moves the watermark. No settle writes the rollup: a busy job's
settles never queue on one row's lock (docs/performance.md has the measurement).

Exact, not approximate: a run is counted when its mark is written, in the statement that
counts it, and never again (the mark is the test); ``motir purge`` counts, in the statement
that deletes them, the runs it deletes that no fold has marked (store/sql/maintenance.py,
PURGE_RUNS). The watermark only bounds the search: ``finished_at`` is the settling
transaction's start, so each fold looks back ``MARGIN`` before it for a settle that
committed late; one later still (a transaction open longer than that) is counted when it
is purged. A run resumed and finished again is counted again: it ended twice.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from motir_celery.store.sql import maintenance as maintenance_sql

if TYPE_CHECKING:
    from motir_celery.store.pg import Pool

__all__ = ["fold", "BATCH", "MARGIN"]

log = logging.getLogger("motir_celery.core.worker.rollup")

#: Runs folded per statement.
BATCH = 2000
#: Seconds each fold looks back before the watermark for settles that committed late.
MARGIN = 60.0


def fold(engine: Pool, *, batches: int = 10, batch: int = BATCH, margin: float = MARGIN) -> int:
    """Fold up to ``batches`` × ``batch`` finished runs into the rollup and prune old buckets;
    how many runs were folded."""
    folded = 0
    for _ in range(batches):
        with engine.begin() as conn:
            n = maintenance_sql.fold_finished(conn, batch=batch, margin_seconds=margin)
        folded += n
        if n < batch:
            break
    with engine.begin() as conn:
        maintenance_sql.prune_rollup(conn, batch=batch)
    if folded:
        log.debug("stats rollup: folded %d finished runs", folded)
    return folded
