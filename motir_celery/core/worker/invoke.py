"""``step.invoke`` / ``step.gather``: child runs awaited durably.

``value = step.invoke("charge", "payments.charge", {"order": 42})`` starts one run of
job ``payments.charge`` — the child — and returns its result once it has settled;
``step.gather("kids", [(job, data), ...])`` starts several and returns their results
in order. How:

1. **One child per (parent run, step)**, decided by the database: the child's event
   has the idempotency key ``motir.invoke:<parent run>:<step>`` and its run row the
   unique ``(parent_run_id, parent_step_id)`` (migration 0006), both written by one
   statement fenced on the parent's claim (``store/compose.py``, ``START_CHILDREN``).
   A parent that reaches the step again — retry, crash, redelivery, resume — starts
   nothing new. The child carries the parent's workspace and trace context
   (``traceparent``); it is published after that commit.
2. **The parent suspends without holding a worker**: under a per-parent advisory
   lock it reads its children; while any is unfinished it is queued again with
   ``wait_event = 'motir.children'`` (``worker_sql.suspend``, no attempt charged) and
   the worker is given back.
3. **The child's settle wakes the parent**: the trigger ``motir_run_settled`` (in the
   settle's own transaction, under the same lock) makes the parent due once *no*
   child of it is unfinished — so a gather of 50 resumes its parent once, and a
   parent that checked just before its last child settled is already suspended when
   the trigger looks. Whoever settled the child publishes the parent after that
   commit (``publish_woken``: the settling worker, the sweeper that failed an expired
   child, an operator's cancel), claimed by one conditional UPDATE so only one of them
   does; a settle made anywhere else is published by the next sweep (the trigger marks
   the woken parent as never sent, migration 0011).
4. **The outcome is memoized** as the step's record: the child's result, or its
   final failure, which is raised into the parent as ``ChildFailed`` (a
   ``NonRetriableError``: retrying the parent would read the same stored failure),
   carrying the child's stored error. The handler may catch it.

``timeout=`` (seconds or timedelta) bounds the wait on the database's clock (a
memoized window, like ``wait_for_event``): children unfinished when it passes are
cancelled and come back as ``ChildFailed`` with ``error["type"] == "ChildTimeout"``.
Cancelling the parent cancels its unfinished children (the same trigger; their
children in turn) — unless started with ``detach=True``: such a child outlives its
parent's cancel and timeout (the parent, timed out, stops waiting for it).

``gather`` waits for **every** child to settle (collect, not fail-fast): a failed
child does not cancel its siblings, whose work is kept. Then, by default, the first
failure (in call order) is raised as ``ChildFailed`` with ``.results`` — every
child's value or ``ChildFailed`` — attached; ``return_exceptions=True`` returns that
list instead of raising.

A handler awaits one invoke or gather at a time (a run waits on one step), so "no
unfinished child of this parent" is "the current step's children have settled".
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Sequence

from motir_celery.core.jobs import Job, get_job
from motir_celery.core.publish import Publish, publish_or_log
from motir_celery.core.shapes import CHILD_EVENT_PREFIX
from motir_celery.core.tracing import current_traceparent
from motir_celery.errors import NonRetriableError, PayloadError, Suspended, checked_delay
from motir_celery.store import records
from motir_celery.store.records import RunSpec
from motir_celery.store.sql import worker as worker_sql

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine
    from motir_celery.core.worker.steps import Step
    from motir_celery.store.driver import Conn

__all__ = ["ChildFailed", "invoke", "gather", "publish_woken", "Member", "await_members", "MAX_CHILDREN",
           "MEMBER_BATCH"]

log = logging.getLogger("motir_celery.core.worker.invoke")

#: The most children one gather starts.
MAX_CHILDREN = 1000
#: A wait without a timeout: the parent is due again only when woken (or after this long).
_FOREVER = 10 * 365 * 86400.0
_FINAL = ("succeeded", "failed", "cancelled")


class ChildFailed(NonRetriableError):
    """A child run ended failed or cancelled (or its wait timed out): raised into the parent
    at its step.invoke / step.gather, which the handler may catch. ``error`` is the stored
    error of the child's last attempt ({"type", "message", ...}); ``state`` is the child's.
    From a gather, ``results`` holds every child's value or ChildFailed, in call order."""

    def __init__(self, step_id: str, run_id: uuid.UUID | str | None, job_id: str, state: str,
                 error: dict[str, Any] | None) -> None:
        self.step_id, self.run_id, self.job_id, self.state = step_id, run_id, job_id, state
        self.error = error or {}
        self.results: list[Any] = []
        super().__init__(f"child run {run_id} ({job_id}) of step {step_id!r} {state}: "
                         f"{self.error.get('type', '')}: {self.error.get('message', '')}")

    def __motir_error__(self) -> dict[str, Any]:
        """What the parent's failure stores besides its type and message (failures.storable_error):
        which child failed (``child``) and the run whose own failure it was (``origin``: the child,
        or the run the child's failure came from) — what ``resume_dlq`` resumes."""
        return {"type": f"{type(self).__module__}.{type(self).__qualname__}", "message": str(self),
                "child": {"run_id": None if self.run_id is None else str(self.run_id), "job_id": self.job_id,
                          "step": self.step_id, "state": self.state},
                "origin": str(self.error.get("origin") or self.run_id or "") or None}


def invoke(step: Step, step_id: str, job: Job | str, data: Any, *,
           timeout: float | timedelta | None = None, detach: bool = False) -> Any:
    """``step.invoke``: start one child run and return its result (or raise ChildFailed)."""
    key = step.next_key(step_id)
    (outcome,) = _await(step, key, [(key, job, data)], timeout, detach)
    if "ok" not in outcome:
        raise _failure(outcome)
    return outcome["ok"]


def gather(step: Step, step_id: str, calls: Sequence[tuple[Job | str, Any]], *,
           timeout: float | timedelta | None = None, return_exceptions: bool = False,
           detach: bool = False) -> list[Any]:
    """``step.gather``: start one child per ``(job, data)`` at once; once all have settled,
    their results in call order (the first failure raised, unless ``return_exceptions``)."""
    key = step.next_key(step_id)
    if not isinstance(calls, (list, tuple)) or not 1 <= len(calls) <= MAX_CHILDREN:
        raise PayloadError(f"step.gather({step_id!r}) takes a list of 1 to {MAX_CHILDREN} (job, data) pairs")
    children = [(f"{key}[{i}]", job, data) for i, (job, data) in enumerate(calls)]
    outcomes = _await(step, key, children, timeout, detach)
    values = [o["ok"] if "ok" in o else _failure(o) for o in outcomes]
    if not return_exceptions:
        failed = next((v for v in values if isinstance(v, ChildFailed)), None)
        if failed is not None:
            failed.results = values
            raise failed
    return values


def _failure(outcome: dict[str, Any]) -> ChildFailed:
    return ChildFailed(outcome["step"], outcome.get("run_id"), outcome.get("job_id", ""), outcome["state"],
                       outcome.get("error"))


def _child_rows(step: Step, children: Sequence[tuple[str, Job | str, Any]]) -> list[tuple[str, str, str, str, Any]]:
    claim = step.claim
    out = []
    for child_key, job_ref, data in children:
        job = job_ref if isinstance(job_ref, Job) else get_job(job_ref)
        event_data = {"args": [data], "kwargs": {}} if job.direct else data
        try:
            encoded = json.dumps(event_data, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise PayloadError(f"data of child {child_key!r} ({job.id}) is not JSON: {exc}") from None
        if "\\u0000" in encoded:
            raise PayloadError(f"data of child {child_key!r} ({job.id}) contains a NUL character")
        out.append((child_key, f"{CHILD_EVENT_PREFIX}{job.id}", encoded,
                    f"motir.invoke:{claim.run_id}:{child_key}", job.spec(event_data, claim.workspace_id)))
    return out


def _await(step: Step, key: str, children: Sequence[tuple[str, Job | str, Any]],
           timeout: float | timedelta | None, detach: bool) -> list[dict[str, Any]]:
    if key in step.records:
        return step.records[key]  # type: ignore[no-any-return]
    claim = step.claim
    step.ensure_held(key)
    rows = _child_rows(step, children)
    # 1. The children, once per (parent, step): a conflict is the child already started.
    with step.transaction() as tx:
        held, created = worker_sql.start_children(tx, claim, rows, traceparent=current_traceparent() or claim.traceparent,
                                               detach=detach)
        reason = "" if held else worker_sql.why_fenced(tx, claim)
    if not held:
        step.stop(key, reason)
    for run_id, job_id in created:  # after the commit that created them
        if not publish_or_log(step.engine.publish, run_id, job_id):
            break  # the broker is away: the sweeper publishes the rest
    # 2. The wait's window, memoized on the database's clock (a timeout only).
    until, now = None, None
    if timeout is not None:
        seconds = checked_delay(f"step invoke/gather {key!r:.100} timeout",
                                timeout.total_seconds() if isinstance(timeout, timedelta) else timeout)
        window, now = step.window(f"{key}:invoke", seconds=seconds)
        until = datetime.fromisoformat(window["until"])
    keys = [c[0] for c in rows]
    run_at, timed_out, reason = None, [], ""
    expired = until is not None and now is not None and now >= until
    with step.transaction() as tx:
        if expired:
            # The wait is over: cancel what is unfinished *before* taking the parent's lock,
            # in the order a child's settle takes them (its row, then the lock), so the two
            # cannot deadlock. A child that settled first stays as it ended.
            timed_out = worker_sql.cancel_children(tx, claim.run_id, keys)
        # The trigger's lock: every child settle committed so far is visible below, and a
        # later one sees this suspension and wakes it.
        worker_sql.lock_parent(tx, claim.run_id)
        kids = worker_sql.children(tx, claim.run_id, keys)
        unfinished = [k for k in keys if k in kids and kids[k]["state"] not in _FINAL]
        if unfinished and not expired:
            run_at = worker_sql.suspend(tx, claim, outcome="suspended", until=until,
                                        delay=None if until is not None else _FOREVER,
                                        wait=(worker_sql.CHILD_WAIT, [], None),
                                        republish_after=step.republish_after)
            reason = "" if run_at is not None else worker_sql.why_fenced(tx, claim)
    if reason:
        step.stop(key, reason)
    if run_at is not None:
        raise Suspended(run_at)  # committed: the parent waits in the queue, not in this process
    # Cut short by the timeout: cancelled by it, or detached and still running.
    cut = {str(r) for r in timed_out} | {str(kids[k]["run_id"]) for k in unfinished}
    outcomes = [_outcome(k, kids.get(k), str(kids[k]["run_id"]) in cut if k in kids else False, timeout)
                for k in keys]
    return step.record(key, json.dumps(outcomes, separators=(",", ":")), 0.0)  # type: ignore[no-any-return]


# --- members of a canvas (core/worker/canvas.py) ----------------------------------------


@dataclass(frozen=True)
class Member:
    """One run a canvas step starts: its key (its ``parent_step_id``), its job and event data,
    its id (chosen by the canvas: ``member_id``), and how it starts (signature options)."""

    key: str
    job: Job
    #: The run's event data: ``{"args": [...], "kwargs": {...}}`` for a direct job.
    data: Any
    run_id: uuid.UUID
    delay: float | None = None
    eta: datetime | None = None
    priority: int | None = None
    queue: str | None = None


#: Members started per statement (each batch its own fenced transaction): a group of 10,000
#: is ten statements, and the memory of one batch's parameters, not of the whole group.
MEMBER_BATCH = 1000


def await_members(step: Step, key: str, members: Sequence[Member]) -> list[dict[str, Any]]:
    """One canvas step: start ``members`` (once per (canvas run, member key), batched), give the
    worker back until every one has settled, then their outcomes in order — ``{"ok": result}``
    for a success (compact: a chord of 10,000 stores 10,000 results, not 10,000 records), the
    ``_outcome`` of a failure — memoized as the step's record."""
    if key in step.records:
        return step.records[key]  # type: ignore[no-any-return]
    claim = step.claim
    started = f"{key}.started"  # a marker: every batch of a large step is committed (skip the INSERTs)
    if started not in step.records:
        step.ensure_held(key)
        for i in range(0, len(members), MEMBER_BATCH):
            batch = members[i:i + MEMBER_BATCH]
            rows = [_member_row(claim, m, step.max_bytes) for m in batch]
            with step.transaction() as tx:
                held, created = worker_sql.start_members(
                    tx, claim, rows, traceparent=current_traceparent() or claim.traceparent,
                    republish_after=step.republish_after)
                reason = "" if held else worker_sql.why_fenced(tx, claim)
            if not held:
                step.stop(key, reason)
            _publish_members(step.engine, batch, created)
        if len(members) > MEMBER_BATCH:
            step.record(started, "true", 0.0)
    run_at, reason, kids = None, "", {}
    with step.transaction() as tx:
        # The trigger's lock: every member settle committed so far is visible below, and a
        # later one sees this suspension and wakes it.
        worker_sql.lock_parent(tx, claim.run_id)
        if worker_sql.members_waiting(tx, claim.run_id):
            run_at = worker_sql.suspend(tx, claim, outcome="suspended", delay=_FOREVER,
                                        wait=(worker_sql.CHILD_WAIT, [], None),
                                        republish_after=step.republish_after)
            reason = "" if run_at is not None else worker_sql.why_fenced(tx, claim)
        else:
            kids = worker_sql.step_members(tx, claim.run_id, key)
    if reason:
        step.stop(key, reason)
    if run_at is not None:
        raise Suspended(run_at)  # committed: the canvas run waits in the queue, not in this process
    outcomes = [_member_outcome(m.key, kids.get(m.key)) for m in members]
    return step.record(key, json.dumps(outcomes, separators=(",", ":"), ensure_ascii=False),  # type: ignore[no-any-return]
                       0.0)


def _member_row(claim: records.Claim, m: Member, limit: int) -> tuple[str, str, str, str, RunSpec, uuid.UUID,
                                                                     float | None, datetime | None]:
    try:
        encoded = json.dumps(m.data, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"arguments of member {m.key!r} ({m.job.id}) are not JSON: {exc}") from None
    if "\\u0000" in encoded:
        raise PayloadError(f"arguments of member {m.key!r} ({m.job.id}) contain a NUL character")
    if len(encoded) > limit:  # a chord's body gets every header result: retrying would not make it smaller
        raise NonRetriableError(f"arguments of member {m.key!r} ({m.job.id}) are {len(encoded)} bytes of JSON, over "
                                f"the {limit}-byte limit (MOTIR_MAX_PAYLOAD_BYTES)")
    return (m.key, f"{CHILD_EVENT_PREFIX}{m.job.id}", encoded, f"motir.invoke:{claim.run_id}:{m.key}",
            m.job.spec(m.data, claim.workspace_id, m.priority), m.run_id, m.delay, m.eta)


def _publish_members(engine: Engine, batch: Sequence[Member], created: Sequence[tuple[uuid.UUID, str, float]]) -> None:
    """After the commit that created them: each new member's message (its own queue= /
    priority= routed by the engine's host; a countdown as the database computed it). A member
    due later than republish_after gets none now: the sweeper publishes it once due."""
    by_id = {m.run_id: m for m in batch}
    for run_id, job_id, due_in in created:
        if due_in > engine.settings.republish_after:
            continue
        m = by_id.get(run_id)
        target = engine.routed(m.queue, m.priority) if m is not None and not engine.host.eager else engine.publish
        if not publish_or_log(target, run_id, job_id, due_in):
            return  # the broker is away: the sweeper publishes the rest


def _member_outcome(key: str, kid: dict[str, Any] | None) -> dict[str, Any]:
    if kid is not None and kid["state"] == "succeeded":
        return {"ok": kid["result"]}
    if kid is None:  # refused at its INSERT: a singleton key held, or its task_id another run's
        return {"step": key, "state": "not_started",
                "error": {"type": "ChildNotStarted",
                          "message": "the member run was not created (its singleton key was held by an active "
                                     "run, or its task_id is another run's id)"}}
    return _outcome(key, kid, False, None)


def _outcome(key: str, kid: dict[str, Any] | None, timed_out: bool, timeout: Any) -> dict[str, Any]:
    if kid is None:  # refused at its INSERT: its job's singleton key was taken by an active run
        return {"step": key, "state": "not_started",
                "error": {"type": "ChildNotStarted",
                          "message": "the child run was not created (its singleton key was held by another run)"}}
    base = {"step": key, "run_id": str(kid["run_id"]), "job_id": kid["job_id"], "state": kid["state"]}
    if kid["state"] == "succeeded":
        return {**base, "ok": kid["result"]}
    if timed_out:
        error = {"type": "ChildTimeout", "message": f"the child did not settle within the timeout ({timeout})"}
    elif kid["state"] == "cancelled":
        error = {"type": "RunCancelled", "message": "the child run was cancelled"}
    else:
        error = kid["error"] or {"type": "Failed", "message": "the child run failed"}
    return {**base, "error": error}


def publish_woken(publish: Publish, conn: Conn, settled: Sequence[uuid.UUID]) -> int:
    """After the commit that settled ``settled`` (a worker's settle, the sweeper's reclaim, a
    cancel): publish the parents those settles woke, each claimed first (``claim_wakes``) so
    that of several callers one publishes. Never raises: the settle is committed, and a parent
    not published here is published by the sweeper. Returns how many were published."""
    if not settled:
        return 0
    if conn.in_transaction():
        # The settle must be committed before its parent is published: a caller inside a
        # transaction has not committed it yet (a programming error; the sweeper covers it).
        log.error("publish_woken called inside a transaction; the sweeper publishes the parents")
        return 0
    try:
        with conn.begin():  # its own transaction (on the runner's autocommit connection: one statement)
            woken = worker_sql.claim_wakes(conn, settled)
    except Exception:  # noqa: BLE001 — the settle is committed; the sweeper publishes the parent
        log.warning("could not publish the parents woken by %d settled run(s); the sweeper will", len(settled),
                    exc_info=True)
        return 0
    for run_id, job_id in woken:
        publish_or_log(publish, run_id, job_id)
    return len(woken)
