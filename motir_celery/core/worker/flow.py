"""Flow control at the claim: ``throttle=``, and the end of a ``debounce=`` / ``batch=`` run's gathering.

Only the runs of jobs with one of those options come here (``claim.py``); every other run is
claimed by the claim statement alone.
A flow claim is one transaction, in this order, each lock taken in a statement of its own
before the statements that depend on it (store/sql/flow.py):

1. **gathering** (debounce= / batch=): a run no producer gathered (a fan-out path that does
   not, a previous release's producer) is gathered now — but not a ``step.invoke`` child,
   whose parent waits for that very run: it runs as a plain one (a batch of one event). A gathering run whose run_at has
   come is closed under its key's lock — the lock its senders take — so an event either
   joined it before or opens the next one; one whose message came early schedules one
   message for its run_at (``schedule_early``) and is not claimed.
2. **throttle** (a run's first start only: retries, resumes after a sleep or a wait are
   not throttled again): under the key's lock, the run is admitted when fewer than
   ``limit`` runs of the key started within the period before the decision's instant and
   no run of the key waits ahead of it (higher priority, or as urgent and older); it is
   then claimed and its start recorded (``throttle_at``). Else it waits, queued, with its
   ``run_at`` at its estimated turn: a countdown message, or the sweeper, brings it back,
   and the claim decides again — an estimate, never a promise, so the limit holds however
   late or early a run comes back.
3. **concurrency=**, when the job has it too: the claim statement under the key's lock
   (``claim.Ask``).

Nothing here is dropped: a run that is not claimed stays queued with a message or a sweep
set for its run_at. A crash anywhere rolls the whole decision back.
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from motir_celery.core.publish import publish_or_log
from motir_celery.core.runspec import RunOptions, gather_of, throttle_key
from motir_celery.store import records
from motir_celery.store.sql import flow as flow_sql

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine
    from motir_celery.core.worker.claim import Ask
    from motir_celery.store.driver import Conn

__all__ = ["claim", "turn", "event_data", "batch_events", "GATHERING"]

log = logging.getLogger("motir_celery.flow")

#: flow_wait of a run still gathering events.
GATHERING = ("debounce", "batch")


def event_data(row: dict[str, Any]) -> Any:
    """The data the handler sees, which keys are computed from (a cron run's: its slot)."""
    if row["event_id"] is not None:
        return row["event_data"]
    when = row["scheduled_for"]
    return {"scheduled_for": when.isoformat() if when else None}


def turn(at: datetime, recent: list[datetime], ahead: int, limit: int, period: float) -> datetime:
    """When a throttled run's turn comes, if the ``ahead`` runs before it each start at theirs.

    ``recent``: the key's starts within the period (any order, at most ``limit``). Of the next
    start slots the first ``limit - len(recent)`` are free now, then each start frees one a
    period after it. Never sooner than a moment from now (one emission interval, at most 1 s):
    a run that waits for another to go first does not spin."""
    starts: list[datetime | None] = [None] * (limit - len(recent)) + sorted(recent)
    base, rounds = starts[ahead % limit], ahead // limit
    slot = (at if base is None else base + timedelta(seconds=period)) + timedelta(seconds=period * rounds)
    return max(slot, at + timedelta(seconds=min(1.0, period / limit)))


def claim(engine: Engine, ask: Ask, opts: RunOptions) -> records.Claim | None:
    """Claim a run of a flow-controlled job, or leave it queued with its turn set (None)."""
    later: list[tuple[uuid.UUID, float]] = []  # (run, countdown) to publish after the commit
    with engine.pool().begin() as tx:
        found = _decide(tx, ask, opts, engine.settings.republish_after, later)
    for run, countdown in later:
        publish_or_log(engine.publish, run, ask.job_id, countdown)
    return found


def _decide(tx: Conn, ask: Ask, opts: RunOptions, republish_after: float,
            later: list[tuple[uuid.UUID, float]]) -> records.Claim | None:
    run_id, job_id = ask.run_id, ask.job_id
    row = flow_sql.flow_run(tx, run_id, job_id)
    if row is None or row["state"] != "queued":
        return None  # running, finished, or no such run: a stale or duplicate message
    data, workspace = event_data(row), row["workspace_id"]
    if opts.gathers and row["flow_key"] is None and not row["started"] and not row["child"]:
        gathered = _gather_now(tx, run_id, job_id, opts, data, workspace, later)
        if gathered is None:
            return None
        row = gathered
    if not row["due"]:
        _schedule(tx, run_id, republish_after, later)
        return None
    if row["flow_wait"] in GATHERING:
        flow_sql.lock_flow_key(tx, "gather", job_id, workspace, row["flow_key"])
        if not flow_sql.close_gather(tx, run_id):
            # Since our read a sender moved its run_at (not due: one message for the new one), or
            # filled the batch and closed it (due: claim it), or another claim took it (nothing).
            row = flow_sql.flow_run(tx, run_id, job_id)
            if row is None or row["state"] != "queued":
                return None
            if row["flow_wait"] is not None or not row["due"]:
                _schedule(tx, run_id, republish_after, later)
                return None
    if opts.throttle is not None and not row["started"]:
        return _throttled(tx, ask, opts, data, workspace, republish_after, later)
    return ask.claim(tx)


def _gather_now(tx: Conn, run_id: uuid.UUID, job_id: str, opts: RunOptions, data: Any,
                workspace: str | None, later: list[tuple[uuid.UUID, float]]) -> dict[str, Any] | None:
    """Gather a run its producer did not (dispatch_event, a previous release): the row after it,
    or None when the run was folded into its key's open run (and is gone)."""
    spec = gather_of(opts, data, workspace)
    assert spec is not None
    found = flow_sql.gather(tx, [(run_id, spec.kind, spec.key, spec.wait, spec.limit)])
    if found and found[0]["into_run"] != run_id:
        if found[0]["due"]:
            later.append((found[0]["into_run"], 0.0))  # a batch it filled: due now
        return None
    return flow_sql.flow_run(tx, run_id, job_id)  # its flow columns and run_at as gathering left them


def _schedule(tx: Conn, run_id: uuid.UUID, republish_after: float, later: list[tuple[uuid.UUID, float]]) -> None:
    due_in = flow_sql.schedule_early(tx, run_id, republish_after)
    if due_in is not None:
        later.append((run_id, due_in))


def _throttled(tx: Conn, ask: Ask, opts: RunOptions, data: Any, workspace: str | None, republish_after: float,
               later: list[tuple[uuid.UUID, float]]) -> records.Claim | None:
    run_id, job_id = ask.run_id, ask.job_id
    throttle = opts.throttle
    assert throttle is not None
    key = throttle_key(opts, data, workspace)
    # A key is per workspace; the job-wide one ("") spans them, and so does its lock.
    flow_sql.lock_flow_key(tx, "throttle", job_id, workspace if key else None, key)
    state = flow_sql.throttle_state(tx, run_id, job_id, key, workspace, throttle.limit, throttle.period)
    at, recent, ahead = state["at"], list(state["recent"]), int(state["ahead"])
    if ahead == 0 and len(recent) < throttle.limit:
        claimed = ask.claim(tx)
        if claimed is not None:
            flow_sql.throttle_admit(tx, run_id, claimed.token, key, at)
        return claimed
    until = turn(at, recent, ahead, throttle.limit, throttle.period)
    due_in = flow_sql.throttle_park(tx, run_id, key, until, republish_after)
    if due_in is not None and due_in <= republish_after:
        later.append((run_id, due_in))
    log.debug("run %s of %s waits for a throttle slot of %r (%d ahead) until %s", run_id, job_id, key, ahead, until)
    return None


def batch_events(conn: Conn, run_id: uuid.UUID) -> list[dict[str, Any]]:
    """batch=: the events a run gathered, in order (``id``, ``name``, ``data``, ``workspace_id``)."""
    return flow_sql.batch_events(conn, run_id)
