"""``concurrency=(limit, key)``: at most ``limit`` running runs per key of a job.

A key is counted within the run's workspace (tenants' keys never share slots); the
job-wide limit (``concurrency=5``: no key) counts every workspace's runs together.
The claim of such a run counts the key's running runs and claims in one
transaction, under the key's advisory lock, so two workers cannot both take the
last slot (``claim.py``); a refused claim leaves the run queued. The run that frees a
slot (settled, suspended, cancelled or lost) publishes the next in line (``free_slot``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from motir_celery.core.publish import publish_or_log
from motir_celery.store import records
from motir_celery.store.sql import worker as worker_sql

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine

__all__ = ["free_slot"]

log = logging.getLogger("motir_celery.concurrency")


def free_slot(engine: Engine, claim: records.Claim) -> None:
    """This run no longer holds its slot: hand it to the next queued run of the key."""
    try:
        with engine.pool().begin() as tx:
            next_run = worker_sql.next_in_line(tx, claim.job_id, claim.concurrency_key or "", claim.workspace_id)
    except Exception:  # noqa: BLE001 — the sweeper re-publishes waiting runs anyway
        log.warning("run %s: could not hand its concurrency slot on", claim.run_id, exc_info=True)
        return
    if next_run is not None:
        publish_or_log(engine.publish, next_run, claim.job_id)
