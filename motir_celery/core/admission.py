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
from typing import TYPE_CHECKING, Any, Sequence

from motir_celery.core.publish import publish_or_log
from motir_celery.errors import ConfigurationError
from motir_celery.store import records
from motir_celery.store.sql import admission as admission_sql

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine

__all__ = ["Admission", "OFF_RECHECK_SECONDS", "DISPATCH_BATCH", "set_quota", "set_in_flight", "turn_off", "quotas"]

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
        try:
            if self._engine.host.eager:
                return False  # runs execute in this process: there is no broker to keep them from
        except ConfigurationError:
            return False  # no broker here: nothing to send (a worker's sweep dispatches instead)
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


# --- the operator's actions (motir quota) ------------------------------------------------------


def set_quota(engine: Engine, workspace_id: str | None, *, weight: int | None = None,
              max_running: int | None = None, clear_cap: bool = False, actor: str) -> records.Quota:
    """Write one workspace's weight and/or cap (None: the system runs). Live: the dispatcher's next
    choice reads it. A value not given is kept; ``clear_cap`` removes the cap."""
    if weight is not None and not 1 <= weight <= 1000:
        raise ValueError(f"weight must be from 1 to 1000, got {weight}")
    if max_running is not None and max_running < 1:
        raise ValueError(f"max_running must be at least 1, got {max_running}")
    with engine.pool().begin() as tx:
        quota = admission_sql.set_quota(tx, workspace_id, weight=weight, max_running=max_running,
                                        clear_cap=clear_cap, actor=actor)
    # Not dispatched from here: an operator's process may have no broker, and a run marked sent
    # that it cannot publish would wait for the sweeper's re-publish. A raised cap lets held runs
    # go at the next attempt's end or sweep (MOTIR_SWEEP_INTERVAL), whichever comes first.
    return quota


def set_in_flight(engine: Engine, limit: int, *, actor: str) -> None:
    """Turn admission on with the fleet's in-flight limit, or change it. Every process reads it at
    its next decision (on within ``OFF_RECHECK_SECONDS``); the held runs a larger limit lets go are
    sent at the next attempt's end or sweep (not from here: see ``set_quota``)."""
    if limit < 1:
        raise ValueError(f"the in-flight limit must be at least 1, got {limit}")
    with engine.pool().begin() as tx:
        admission_sql.set_in_flight(tx, limit, actor=actor)
    engine.admission.forget()


def turn_off(engine: Engine) -> int:
    """Admission off: every held run is marked sent and published from here (how many); with no
    broker here, the sweeper re-publishes them after ``republish_after``. Each process publishes at
    once again within ``OFF_RECHECK_SECONDS``."""
    with engine.pool().begin() as tx:
        released = admission_sql.admission_off(tx)
    for run_id, job_id in released:
        publish_or_log(engine.host.publish, run_id, job_id)
    engine.admission.forget()
    return len(released)


def quotas(engine: Engine, workspace_id: str | None = None, *,
           every: bool = True) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The fleet (its limit, runs in flight and held), and every quota row (or, not ``every``,
    ``workspace_id``'s: None is the system runs') with its runs in flight and held."""
    with engine.pool().begin() as tx:
        return admission_sql.fleet(tx), admission_sql.quotas(tx, workspace_id, every=every)
