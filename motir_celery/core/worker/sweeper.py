"""The sweeper: what makes "nothing is lost" true when processes and brokers fail.

Each sweep, in one transaction per half:

1. **Expired leases** — a worker died, hung or was partitioned. Its run goes
   back to ``queued`` (the attempt was charged at claim, so a run that keeps
   killing its worker spends its attempts) or, with none left, to ``failed``
   with its DLQ row — and a parent that failure woke (the trigger) is published
   in the same pass (``invoke.publish_woken``), not a republish period later.
2. **Lost messages** — a due ``queued`` run whose last message is older than
   ``republish_after`` (broker restarted without persistence, or a crash
   between commit and publish) is published again, oldest first, in bounded
   batches. Each re-publish stamps ``dispatched_at``, so a deep but healthy
   backlog is re-sent at most once per ``republish_after``; the duplicates a
   re-publish may create are harmless, because the claim admits one.
3. **Admission** — with admission on (core/admission.py), the held runs whose turn came
   while no attempt ended in this process (a cancel, a lost worker, a cap raised) are sent.
4. **The stats rollup** — runs finished since the last fold are added to
   ``job_stats_rollup`` (``rollup.py``), in set-based batches, in the fleet's slot.

Any number of sweepers may run: ``FOR UPDATE SKIP LOCKED`` splits the rows.
Workers run one in a background thread (``MOTIR_SWEEP_INTERVAL``; see
``adapter/worker.py``) with ``once_per_period``: each first takes the fleet's sweep
slot (``job_sweep``, one conditional UPDATE), so whatever the number of hosts one
sweep per period does the work, batch after batch while batches come back full.
The others' attempt writes nothing. A direct call (``motir`` commands, tests)
sweeps at once.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from motir_celery.core.publish import publish_or_log
from motir_celery.core.worker import rollup
from motir_celery.core.worker.invoke import publish_woken
from motir_celery.store.sql import maintenance as maintenance_sql

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine

__all__ = ["SweepReport", "sweep"]

log = logging.getLogger("motir_celery.core.worker.sweeper")


#: A period's sweep takes at most this many batches of each half: a backlog beyond
#: ``batch`` × this is left for the next period (and bounds one sweep's length).
MAX_BATCHES = 10
#: The slot is free again after this share of the period: a lone sweeper, whose ticks
#: are a period apart at least, never finds its own last sweep too recent.
SLOT_SHARE = 0.9


@dataclass(frozen=True)
class SweepReport:
    requeued: int = 0
    failed: int = 0
    republished: int = 0
    #: False: another sweeper took this period (``once_per_period``); nothing was done.
    swept: bool = True
    #: Finished runs folded into the stats rollup (rollup.py) by this sweep.
    folded: int = 0
    #: Held runs admission sent because their turn came (core/admission.py).
    dispatched: int = 0


def sweep(engine: Engine, *, batch: int = 500, once_per_period: bool = False) -> SweepReport:
    """One sweep (see the module docstring); ``once_per_period``: only if this process takes the
    fleet's sweep slot for the period (a worker's engine thread)."""
    settings = engine.settings
    pool = engine.pool()
    batches = 1
    if once_per_period:
        with pool.begin() as conn:
            if not maintenance_sql.take_sweep_slot(conn, worker=f"{socket.gethostname()}/{os.getpid()}",
                                                   period_seconds=SLOT_SHARE * settings.sweep_interval):
                return SweepReport(swept=False)
        # The fleet's only sweep this period: it also takes what the other hosts' sweeps
        # would have, up to MAX_BATCHES a half.
        batches = MAX_BATCHES
    reclaimed: list[tuple[uuid.UUID, str, str]] = []
    lost: list[tuple[uuid.UUID, str]] = []
    for _ in range(batches):
        with pool.begin() as conn:
            taken = maintenance_sql.reclaim_expired(conn, batch=batch)
        reclaimed += taken
        if len(taken) < batch:
            break
    for _ in range(batches):
        with pool.begin() as conn:
            stale = maintenance_sql.republish_due(conn, after_seconds=settings.republish_after, batch=batch)
        lost += stale
        if len(stale) < batch:
            break
    requeued = [(run_id, job_id) for run_id, job_id, state in reclaimed if state == "queued"]
    failed = [run_id for run_id, _, state in reclaimed if state == "failed"]
    if failed:
        with pool.connect() as conn:  # a failed child may have woken its parent: send it now
            publish_woken(engine.publish, conn, failed)
    pending = requeued + lost
    for i, (run_id, job_id) in enumerate(pending):
        if not publish_or_log(engine.publish, run_id, job_id):
            # The broker is away: stop here rather than wait out its retries once per
            # run. Every row was stamped, so the next re-publish pass takes them.
            log.warning("sweep: broker unavailable; %d runs left for the next pass", len(pending) - i)
            break
    try:  # admission (core/admission.py): the held runs whose turn came while no attempt ended here
        dispatched = engine.admission.dispatch()
    except Exception:  # noqa: BLE001 — held runs stay held, committed; the next sweep sends them
        log.warning("sweep: admission's dispatch failed; the next sweep sends the held runs", exc_info=True)
        dispatched = 0
    try:  # third, once nothing is lost: the period's fold of finished runs into the stats rollup
        folded = rollup.fold(pool, batches=batches)
    except Exception:  # noqa: BLE001 — the next period folds them (nothing is marked until counted)
        log.warning("sweep: the stats rollup's fold failed; the next sweep folds those runs", exc_info=True)
        folded = 0
    report = SweepReport(len(requeued), len(reclaimed) - len(requeued), len(lost), folded=folded,
                         dispatched=dispatched)
    if reclaimed or lost or dispatched:
        log.info("sweep: %s", report)
    return report
