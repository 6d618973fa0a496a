"""``concurrency=(limit, key)``: at most ``limit`` running runs per key of a job.

A key is counted within the run's workspace (tenants' keys never share slots); the
job-wide limit (``concurrency=5``: no key) counts every workspace's runs together.
The claim of such a run counts the key's running runs and claims in one
transaction, under the key's advisory lock, so two workers cannot both take the
last slot; a refused claim leaves the run queued. The run that frees a slot
(settled, suspended, cancelled or lost) publishes the next in line.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING

from motir_celery.core.jobs import get_job
from motir_celery.core.publish import Publish, publish_or_log
from motir_celery.errors import UnknownJobError
from motir_celery.store import records
from motir_celery.store.sql import worker as worker_sql

if TYPE_CHECKING:
    from motir_celery.store.pg import Pool

__all__ = ["limit_of", "claim_limited", "free_slot"]

log = logging.getLogger("motir_celery.concurrency")


def limit_of(job_id: str) -> int | None:
    try:
        return get_job(job_id).run_options.concurrency_limit
    except UnknownJobError:
        return None  # claimed normally; the attempt then fails with the clear error


def claim_limited(engine: Pool, run_id: uuid.UUID, job_id: str, worker: str, lease_seconds: float,
                  limit: int, token: uuid.UUID | None = None) -> records.Claim | None:
    with engine.begin() as tx:
        worker_sql.lock_concurrency(tx, run_id)
        return worker_sql.claim(tx, run_id, job_id=job_id, worker=worker, lease_seconds=lease_seconds,
                                concurrency_limit=limit, token=token)


def free_slot(engine: Pool, claim: records.Claim, publish: Publish | None) -> None:
    """This run no longer holds its slot: hand it to the next queued run of the key."""
    try:
        with engine.begin() as tx:
            next_run = worker_sql.next_in_line(tx, claim.job_id, claim.concurrency_key or "", claim.workspace_id)
    except Exception:  # noqa: BLE001 — the sweeper re-publishes waiting runs anyway
        log.warning("run %s: could not hand its concurrency slot on", claim.run_id, exc_info=True)
        return
    if next_run is not None and publish is not None:
        publish_or_log(publish, next_run, claim.job_id)
