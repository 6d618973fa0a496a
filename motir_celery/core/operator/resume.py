"""``resume_dlq``: the same run again, from its failed step — and its family with it.

Replay re-emits the event as a **new** run: every step runs again (two invoices for
one order, if ``invoice`` came before the step that failed). Resume queues **the
same run** again: its stored steps stay, so the handler returns their stored values
and carries on at the step that failed. The run gets a fresh attempt budget
(``attempts`` back to 0, ``max_attempts`` as recorded at enqueue).

**A parent and its children** (``step.invoke`` / ``step.gather``, a canvas and its members).
A parent that failed because a child failed (its stored failure names the child:
``ChildFailed``'s ``child``) is resumed with that child: resume looks at the *current*
outcome of every failed child of the step it failed at —

* failed, with an open DLQ entry: resumed too, from its own failed step (and so on down:
  a chain in a chord in a chain resumes to the task that failed);
* succeeded, queued or running (resumed by itself meanwhile): nothing to do;
* cancelled, or its entry replayed or dismissed: **not resumable** — nothing is changed and
  the result says which child and why (``child_not_resumable``, ``detail``); the parent
  would only fail again. Replay the parent instead (a canvas's replay reuses the links
  that completed).

— and the parent's record of that step is superseded (renamed ``<step>:resumed:<tag>``,
kept for the record), so the parent awaits the same child run again rather than re-raising
the stored failure. Resuming a child climbs up too: a parent that failed because of this
child (its entry open) is resumed with it, so resuming the member that failed completes its
canvas. Every entry is stamped, each an audit record of its own (``resumed_by``).

Decided by conditional ``UPDATE``s (``store/sql/operator.py``'s ``RESUME``), all in one
transaction: each stamps ``resumed_at`` / ``resumed_by`` on an entry that is neither resumed,
replayed nor dismissed, moves its ``run_id`` to ``resumed_run_id`` (closed; should the run
fail again it gets an entry of its own) and queues the run — so of two concurrent resumes
one queues the runs and the other is told ``already_resumed``. Published after commit.

``resume_as`` is the operator surface's form (docs/security.md): the entry is first
read under the app role in the caller's context, then resumed through the engine.
"""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from motir_celery.core.operator.dlq import Caller, check_actor, parse_id, visible
from motir_celery.core.publish import publish_or_log
from motir_celery.store.sql import operator as operator_sql

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine
    from motir_celery.store.driver import Conn

__all__ = ["ResumeResult", "resume_dlq", "resume_as", "failing_child", "MAX_FAMILY"]

log = logging.getLogger("motir_celery.core.operator.dlq")

#: The most runs one resume queues (a chord of 10,000 whose members all failed resumes in one go).
MAX_FAMILY = 100_000
#: ChildFailed's message before its failure said ``child`` (an entry written by an earlier release).
_CHILD_IN_MESSAGE = re.compile(r"^child run ([0-9a-fA-F-]{36}) ")
_MEMBER = re.compile(r"\[\d+\]$")


@dataclass(frozen=True)
class ResumeResult:
    status: Literal["resumed", "already_resumed", "replayed", "dismissed", "purged", "not_found",
                    "child_not_resumable"]
    #: The entry's run (``child_not_resumable``: the child that is not).
    run_id: uuid.UUID | None = None
    #: Why not, in words (``child_not_resumable``).
    detail: str = ""
    #: Every run queued again: the entry's, its failed children's, the parents that failed with it.
    resumed: tuple[uuid.UUID, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class _Planned:
    dlq_id: uuid.UUID
    run_id: uuid.UUID
    #: The composition step whose record is superseded (it failed because of a child), or None.
    step: str | None


class _NotResumable(Exception):
    def __init__(self, run_id: uuid.UUID, detail: str) -> None:
        super().__init__(detail)
        self.run_id, self.detail = run_id, detail


def failing_child(failure: Any) -> uuid.UUID | None:
    """The child whose failure a stored failure is (``child.run_id``; an earlier release's
    ``ChildFailed`` says it in its message), or None: the run failed for a reason of its own."""
    if not isinstance(failure, dict):
        return None
    child = failure.get("child")
    raw = child.get("run_id") if isinstance(child, dict) else None
    if raw is None and str(failure.get("type", "")).endswith("ChildFailed"):
        found = _CHILD_IN_MESSAGE.match(str(failure.get("message", "")))
        raw = found.group(1) if found else None
    try:
        return uuid.UUID(str(raw)) if raw else None
    except ValueError:
        return None


def resume_dlq(engine: Engine, dlq_id: uuid.UUID | str, *, actor: str) -> ResumeResult:
    """Queue the entry's failed run again from its failed step, with the failed children it
    failed because of and the parents that failed because of it; audited as ``actor``."""
    check_actor(actor)
    did = uuid.UUID(str(dlq_id))
    queued: list[tuple[uuid.UUID, str]] = []
    with engine.pool().connect() as conn:
        with conn.begin() as tx:
            entry = operator_sql.entry_run(conn, did)
            if entry is None or not entry["open"] or entry["run_id"] is None:
                return _closed(conn, did)
            try:
                plan = _plan(conn, did, entry["run_id"])
            except _NotResumable as refused:
                tx.rollback()
                log.info("DLQ %s not resumed by %s: %s", did, actor, refused.detail)
                return ResumeResult("child_not_resumable", refused.run_id, refused.detail)
            tag = did.hex[:12]
            for planned in plan:
                row = operator_sql.resume(conn, planned.dlq_id, actor)
                if planned.dlq_id == did and (not row["stamped"] or row["run_id"] is None):
                    tx.rollback()  # another resume took it meanwhile (or the run is not failed): change nothing
                    return _closed(conn, did)
                if row["run_id"] is not None:
                    queued.append((row["run_id"], row["job_id"]))
                if planned.step is not None:
                    operator_sql.supersede_step(conn, planned.run_id, planned.step, tag)
    for run_id, job_id in queued:
        publish_or_log(engine.publish, run_id, job_id)
    if len(queued) > 1:
        log.info("DLQ %s resumed by %s with its family: %d runs queued again", did, actor, len(queued))
    return ResumeResult("resumed", entry["run_id"], resumed=tuple(r for r, _ in queued))


def _closed(conn: Conn, did: uuid.UUID) -> ResumeResult:
    status = operator_sql.entry_status(conn, did)
    if status is None:
        return ResumeResult("not_found")
    if status["resumed"]:
        return ResumeResult("already_resumed", status["resumed_run_id"])
    if status["replayed"]:
        return ResumeResult("replayed")
    if status["dismissed"]:
        return ResumeResult("dismissed")
    return ResumeResult("purged")


def _plan(conn: Conn, did: uuid.UUID, run_id: uuid.UUID) -> list[_Planned]:
    """Every (entry, run, superseded step) this resume acts on: up to the highest parent that
    failed because of this run, then down from it through each failed child."""
    top, top_entry = run_id, did
    seen = {run_id}
    while True:
        here = operator_sql.run_failure(conn, top)
        parent_id = here["parent_run_id"] if here else None
        if parent_id is None or parent_id in seen:
            break
        parent = operator_sql.run_failure(conn, parent_id)
        if (parent is None or parent["state"] != "failed" or not parent["open"]
                or failing_child(parent["failure"]) != top):
            break  # the parent did not fail because of this run (or its failure was answered already)
        top, top_entry = parent_id, parent["dlq_id"]
        seen.add(top)
    plan: list[_Planned] = []
    _down(conn, top_entry, top, plan, set())
    return plan


def _down(conn: Conn, dlq_id: uuid.UUID, run_id: uuid.UUID, plan: list[_Planned], seen: set[uuid.UUID]) -> None:
    if run_id in seen or len(plan) >= MAX_FAMILY:
        if len(plan) >= MAX_FAMILY:
            raise _NotResumable(run_id, f"more than {MAX_FAMILY} runs would be resumed at once")
        return
    seen.add(run_id)
    here = operator_sql.run_failure(conn, run_id)
    failure = here["failure"] if here else None
    step = _failed_step(conn, run_id, failure)
    plan.append(_Planned(dlq_id, run_id, step))
    if step is None:
        return  # failed for a reason of its own: resumed alone, from its failed step
    for kid in operator_sql.step_children(conn, run_id, step):
        if kid["state"] in ("succeeded", "queued", "running"):
            continue  # done, or under way again: the parent just awaits it
        if kid["state"] == "failed" and kid["open"]:
            _down(conn, kid["dlq_id"], kid["run_id"], plan, seen)
            continue
        raise _NotResumable(kid["run_id"], _why_not(kid))


def _failed_step(conn: Conn, run_id: uuid.UUID, failure: Any) -> str | None:
    """The composition step a run failed at because of a child (its record is superseded), or None."""
    child = failure.get("child") if isinstance(failure, dict) else None
    named = child.get("step") if isinstance(child, dict) else None
    if isinstance(named, str) and named:
        return _MEMBER.sub("", named)  # step[3] -> step: a group's members share its record
    child_id = failing_child(failure)
    found = operator_sql.run_failure(conn, child_id) if child_id is not None else None
    if found is None or found["parent_run_id"] != run_id or not found["parent_step_id"]:
        return None
    return _MEMBER.sub("", found["parent_step_id"])


def _why_not(kid: dict[str, Any]) -> str:
    what = f"child run {kid['run_id']} ({kid['job_id']}, step {kid['parent_step_id']!r})"
    if kid["state"] == "cancelled":
        reason = "was cancelled, so there is nothing to resume it from"
    elif kid["replayed"]:
        reason = "failed and its DLQ entry was replayed: the replay is a new run, not this parent's child"
    elif kid["dismissed"]:
        reason = "failed and its DLQ entry was dismissed"
    else:
        reason = f"is {kid['state']} with no open DLQ entry (purged?)"
    return (f"{what} {reason}; resuming the parent would only fail again. Replay the parent instead "
            "(a new run; a canvas's replay keeps the links that completed)")


def resume_as(engine: Engine, caller: Caller, dlq_id: uuid.UUID | str) -> ResumeResult:
    """``resume_dlq`` of an entry ``caller`` can see; ``not_found`` for one they cannot."""
    check_actor(caller.actor)
    did = parse_id(dlq_id)
    if did is None or not visible(engine, caller, operator_sql.DLQ_VISIBLE, did):
        return ResumeResult("not_found")
    result = resume_dlq(engine, did, actor=caller.actor)
    log.info("DLQ %s resume by %s (workspace %s%s): %s", did, caller.actor, caller.workspace,
             ", admin" if caller.admin else "", result.status)
    return result
