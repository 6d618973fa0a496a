"""The claim: the first act of every attempt, one conditional UPDATE that makes the run ours.

``claim(engine, conn, ...)`` is the one entry. What it sends depends on the job's options,
and nothing else:

* a plain run: ``worker_sql.CLAIM`` alone, on the runner's autocommit connection — one
  statement, one commit (not flushed: ``Tuning.claim_async_commit``);
* ``concurrency=(limit, key)``: the same statement, counting the key's running runs, in one
  transaction under the key's advisory lock (``lock_concurrency``), so two workers cannot both
  take the last slot;
* ``throttle=`` / ``debounce=`` / ``batch=``: flow control decides first, in one transaction
  (``flow.py``): the run may be left queued with its turn set, and what it scheduled is
  published after that commit.

No row back means the message was a duplicate, stale, early, or forged: the worker
acknowledges it and does nothing.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from motir_celery.core.jobs import find_job
from motir_celery.core.worker import flow
from motir_celery.store import records
from motir_celery.store.sql import worker as worker_sql

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine
    from motir_celery.store.driver import Conn

__all__ = ["Ask", "claim"]


@dataclass(frozen=True)
class Ask:
    """What one claim asks for: this run, for this worker, under this token, for this long."""

    run_id: uuid.UUID
    job_id: str
    worker: str
    token: uuid.UUID
    lease_seconds: float
    async_commit: bool
    #: The job's concurrency limit (``concurrency=``), or None.
    limit: int | None = None

    def claim(self, conn: Conn) -> records.Claim | None:
        """The claim statement in ``conn``'s transaction (under the key's lock for a limited job)."""
        if self.limit is not None:
            worker_sql.lock_concurrency(conn, self.run_id)
        return worker_sql.claim(conn, self.run_id, job_id=self.job_id, worker=self.worker,
                                lease_seconds=self.lease_seconds, async_commit=self.async_commit,
                                concurrency_limit=self.limit, token=self.token)


def claim(engine: Engine, conn: Conn, run_id: uuid.UUID, *, job_id: str, worker: str,
          token: uuid.UUID) -> records.Claim | None:
    """Claim ``run_id`` for ``worker`` (see the module docstring); None: not ours to run.

    ``conn`` is the attempt's connection, in autocommit. An unknown job is claimed as a plain
    run, so that the attempt fails with a clear error rather than staying queued."""
    job = find_job(job_id)
    options = job.run_options if job is not None else None
    ask = Ask(run_id, job_id, worker, token, engine.settings.lease_seconds, engine.tuning.claim_async_commit,
              options.concurrency_limit if options is not None else None)
    if options is not None and options.flow:
        return flow.claim(engine, ask, options)
    if ask.limit is not None:
        with engine.pool().begin() as tx:
            return ask.claim(tx)
    return ask.claim(conn)
