"""Runs executed in this process, at once: Celery's eager mode, ``job.apply()`` and the test kit.

``Inline`` is a ``Publish`` callable that, instead of handing a run to a broker, runs
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
from dataclasses import dataclass, field

from motir_celery.core.worker.runner import Outcome, execute
from motir_celery.settings import Settings

__all__ = ["Inline"]


@dataclass
class Inline:
    """A publish that runs each run in this process (``drain`` runs what is queued)."""

    settings: Settings | None = None
    worker: str = field(default_factory=lambda: f"inline/{os.getpid()}")
    #: Every outcome, in the order the runs were executed.
    outcomes: list[tuple[uuid.UUID, Outcome]] = field(default_factory=list)
    _pending: deque[tuple[uuid.UUID, str]] = field(default_factory=deque)
    _draining: bool = False

    def __call__(self, run_id: uuid.UUID, job_id: str, countdown: float = 0.0) -> None:
        self._pending.append((run_id, job_id))
        if not self._draining:
            self.drain()

    def drain(self) -> list[tuple[uuid.UUID, Outcome]]:
        """Execute every queued run and what they publish; the outcomes of this drain."""
        if self._draining:
            return []
        self._draining = True
        done: list[tuple[uuid.UUID, Outcome]] = []
        try:
            while self._pending:
                run_id, job_id = self._pending.popleft()
                outcome = execute(run_id, job_id=job_id, worker=self.worker, publish=self, settings=self.settings)
                done.append((run_id, outcome))
        finally:
            self._draining = False
        self.outcomes += done
        return done
