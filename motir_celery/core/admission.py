"""Who goes next: admission of runs to the broker, decided in Postgres (docs/fair-share.md).

Without admission a run starts when its message reaches a worker: the broker's FIFO decides, so
one workspace's burst of 10,000 runs puts every other workspace's next run behind them, and an
urgent run waits behind the backlog. With admission on (a ``job_admission`` row ``'fleet'``
holding the fleet's in-flight limit) the message *is still the run* — Flower, ``AsyncResult`` and
the dashboard name the run that ran — but it is sent only when it is the run's turn:

* **the gate** (``Admission.publish``): before any run's message leaves this process, one
  decision under the admission lock: while the fleet has fewer runs in flight than its limit,
  nothing is held, and the run's workspace is under its cap, it is published at once, as
  before; otherwise it stays ``queued`` in Postgres, *held* (``dispatched_at = 'infinity'``),
  with no message;
* **the dispatcher** (``dispatch``): when a run leaves the in-flight set (its attempt ends in
  this process: ``runner``; or at each sweep, for what ended elsewhere: a cancel, a lost worker),
  one statement chooses the next held run — the most urgent first (priority 9 before 0), then the
  workspace with the fewest runs in flight per unit of weight (``job_quota.weight``; system runs
  are one more workspace), skipping workspaces at their cap (``job_quota.max_running``), oldest
  first — marks it sent and publishes it after commit.

Nothing is lost: a held run is a committed row; a process that dies between choosing and
publishing leaves it marked sent, and the sweeper re-publishes it after ``republish_after`` like
any run whose message went missing. Nothing runs twice: the claim still admits one holder, and it
refuses a held run (a stale duplicate message: store/sql/worker.py, ``claim``).

A cap counts runs *in flight* (a message sent, or running), so it bounds the running ones: a
worker killed mid-run keeps its run counted (running, then queued and re-sent by the reclaim)
until it settles — the cap holds through the reclaim.

What a single-tenant deployment pays: nothing while no ``'fleet'`` row exists — each process
learns that admission is off from one read every ``OFF_RECHECK_SECONDS`` and publishes as before.
With it on: two statements (lock, gate) before each publish and two after each attempt ends.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Sequence

from motir_celery.core.publish import publish_or_log
from motir_celery.store import records
from motir_celery.store.sql import admission as admission_sql

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine

__all__ = ["Admission", "OFF_RECHECK_SECONDS", "DISPATCH_BATCH"]

log = logging.getLogger("motir_celery.admission")

#: How long a process trusts "admission is off" before reading the ``'fleet'`` row again: the delay
#: with which turning admission on reaches every process (docs/fair-share.md, "Turning it on").
#: "On" is never cached: every decision reads the row under the lock.
OFF_RECHECK_SECONDS = 5.0
#: The most runs one ``dispatch`` call sends (each one statement): a sweep after a cap was raised or
#: many runs ended elsewhere; the next sweep takes the rest.
DISPATCH_BATCH = 1000


class Admission:
    """One process's side of admission: the gate its publishes go through and its dispatcher."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        #: monotonic instant until which "off" is trusted without a read (0: read at the next use).
        self._off_until = 0.0

    def forget(self) -> None:
        """Read the ``'fleet'`` row at the next publish (a test, ``motir quota admission``)."""
        with self._lock:
            self._off_until = 0.0

    def _maybe_on(self) -> bool:
        """False while this process knows admission is off (read within ``OFF_RECHECK_SECONDS``)."""
        if self._engine.host.eager:
            return False  # runs execute in this process: there is no broker to keep them from
        with self._lock:
            return time.monotonic() >= self._off_until

    def _learned_off(self) -> None:
        with self._lock:
            self._off_until = time.monotonic() + OFF_RECHECK_SECONDS

    # --- the gate -------------------------------------------------------------------------

    def admitted(self, runs: Sequence[tuple[uuid.UUID, str]]) -> list[tuple[uuid.UUID, str]]:
        """Of ``runs`` (committed, queued, about to be published): those to publish now. The others
        are held in Postgres for the dispatcher. Admission off: all of them, at no cost once known."""
        if not runs or not self._maybe_on():
            return list(runs)
        with self._engine.pool().begin() as tx:
            limit = admission_sql.lock_admission(tx)
            if limit is None:
                decided: list[records.Admitted] | None = None
            else:
                decided = admission_sql.admit(tx, [run_id for run_id, _ in runs], limit=limit)
        if decided is None:
            self._learned_off()
            return list(runs)
        by_id = {d.run_id: d for d in decided}
        # A run the gate did not list is no longer queued (cancelled, or claimed through a stale
        # message meanwhile): there is nothing to send.
        admitted = [(run_id, job_id) for run_id, job_id in runs if run_id in by_id and by_id[run_id].admitted]
        if len(admitted) < len(decided) and any(d.room > 0 for d in decided):
            # Held although the fleet had room: runs held before these wait ahead of them, and
            # the dispatcher sends the first in order now rather than at the next attempt's end.
            self.dispatch(limit=sum(1 for d in decided if not d.admitted))
        return admitted

    # --- the dispatcher -------------------------------------------------------------------

    def dispatch(self, *, limit: int = DISPATCH_BATCH) -> int:
        """Send up to ``limit`` held runs, one choice (one statement, under the lock) each, until
        none is chosen; how many were sent. Admission off: nothing, at no cost once known."""
        if not self._maybe_on():
            return 0
        sent = 0
        while sent < limit:
            with self._engine.pool().begin() as tx:
                fleet_limit = admission_sql.lock_admission(tx)
                chosen = None if fleet_limit is None else admission_sql.choose_next(tx, limit=fleet_limit)
            if fleet_limit is None:
                self._learned_off()
                return sent
            if chosen is None:
                return sent
            sent += 1
            # Marked sent and committed: published now, through the host itself (the gate decided
            # already). A broker that refuses leaves it to the sweeper, as any lost message.
            if not publish_or_log(self._engine.host.publish, chosen.run_id, chosen.job_id):
                return sent
        return sent
