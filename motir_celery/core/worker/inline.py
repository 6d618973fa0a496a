"""Runs executed in this process, at once: Celery's eager mode, ``job.apply()`` and the test kit.

``Inline`` is a host (``core/publish.py``) that, instead of handing a run to a broker, runs
it here through the real runner — claim, steps, settle, the same statements a worker
sends — and every run that one publishes in turn (a retry due now, a child, a woken
waiter, the next run of a concurrency key), depth first, before it returns. A run
that is not due (a retry's backoff, a countdown, a sleep) is refused by its claim and
stays queued for a worker or for the sweeper, exactly as a message that arrived early.

It is re-entrant: a publish made while a run of this ``Inline`` is executing (a step's
``send_event``, a child of ``step.invoke``) is queued and executed when that run has
settled, as a worker would take the next message.
"""

from __future__ import annotations

import os
import uuid
from collections import deque
from typing import TYPE_CHECKING, Sequence

from motir_celery.core.publish import Publish
from motir_celery.core.worker.runner import Outcome

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine

__all__ = ["Inline"]


class Inline:
    """A host that runs each run it is handed in this process, through ``engine`` (``drain``
    runs what is queued)."""

    eager = True

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.worker = f"inline/{os.getpid()}"
        #: Every outcome, in the order the runs were executed.
        self.outcomes: list[tuple[uuid.UUID, Outcome]] = []
        self._pending: deque[tuple[uuid.UUID, str]] = deque()
        self._draining = False

    def publish(self, run_id: uuid.UUID, job_id: str, countdown: float = 0.0) -> None:
        self._pending.append((run_id, job_id))
        if not self._draining:
            self.drain()

    def publish_many(self, runs: Sequence[tuple[uuid.UUID, str]]) -> None:
        for run_id, job_id in runs:
            self.publish(run_id, job_id)

    def routed(self, queue: str | None, priority: int | None) -> Publish:
        return self.publish  # run here: a queue means nothing

    def drain(self) -> list[tuple[uuid.UUID, Outcome]]:
        """Execute every queued run and what they publish; the outcomes of this drain."""
        if self._draining:
            return []
        self._draining = True
        done: list[tuple[uuid.UUID, Outcome]] = []
        try:
            while self._pending:
                run_id, job_id = self._pending.popleft()
                done.append((run_id, self.engine.execute(run_id, job_id=job_id, worker=self.worker)))
        finally:
            self._draining = False
        self.outcomes += done
        return done
