"""The durable canvas, worker side: the job ``system.canvas``, whose steps are a canvas's links.

A chain, group or chord of durable jobs (``core/producer/canvas.py`` builds them) is written
as **one direct run** of ``system.canvas`` whose argument is the canvas as JSON — its *node*.
This module is that job's handler: it walks the node and awaits each link as a step of that
run, through ``invoke.await_members``, so each link is what ``step.invoke`` already makes
durable:

* a **task** is one *member* run of its job, created once per (canvas run, step) — the
  database decides (UNIQUE (parent_run_id, parent_step_id)) — awaited without holding a
  worker, its outcome the step's record: a retry, a crash, a redelivery or a resume of the
  canvas run finds it and starts nothing twice;
* a **chain** awaits its links in order, each link called with the previous result prepended
  to its arguments (not an immutable one, ``si``);
* a **group** starts its members at once (``MEMBER_BATCH`` a statement) and awaits every one:
  its result is their results, in order;
* a **chord** is its header (a group) and then its body, started once, after the last header
  member settled, with the header's results in order. No polling task, no counter: the last
  member's settle wakes the canvas run (the trigger ``motir_run_settled``, in that settle's
  transaction).

Sequential nesting runs in the same canvas run (a chord inside a chain is two more steps of
it); a group member that is itself a canvas (a chain in a group, a chord in a chord's header,
a task with ``link=``) is a member run of ``system.canvas`` of its own. A member's id is
``member_id(canvas run, its step key)``, so the producer's handle knows every member's id
before it exists.

**Failures**, as Celery documents them: a member that fails for good (its own job's retry
policy spent) fails the step; a chain stops there; a group and a chord's header wait for
every member (collect, not fail-fast) and fail with the first failure in order, the chord's
body never started. The failure is stored as the failed member's error (type, message,
traceback), with ``child`` naming the member and ``origin`` the task run that failed, so a
canvas's ``get()`` raises what the member raised, and ``resume_dlq`` knows which member to
resume. Each ``link_error`` of the failing node is called once per failure (a group's, once
per failed member) with the failed task run's id as its first argument (Celery's form for an
errback that is a task); success callbacks (``link=``) are called with the node's result and
awaited before the canvas goes on. Neither's own failure fails the canvas (it is the callback
run's, in the DLQ).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import TYPE_CHECKING, Any, Sequence

from motir_celery.core.jobs import Job, alias_name, define_job, get_job
from motir_celery.core.retries import RetryPolicy
from motir_celery.core.shapes import CANVAS_JOB_ID, CanvasError, check_node, is_leaf, member_id
from motir_celery.core.worker.invoke import ChildFailed, Member, await_members

if TYPE_CHECKING:
    from motir_celery.core.worker.steps import Step

__all__ = ["CANVAS_POLICY", "CanvasFailed", "run_canvas", "canvas_job", "origin"]

#: A canvas run only starts members and waits: any attempt may be retried, and a worker killed
#: while it held the run charges one (members are runs of their own, with their own policies).
CANVAS_POLICY = RetryPolicy(max_attempts=10, backoff=1.0, factor=2.0, max_backoff=60.0, jitter=0.25, name="canvas")


class CanvasFailed(ChildFailed):
    """A canvas member failed for good (or was cancelled): raised through the canvas run, and
    stored as the member's own error with ``child`` (the member) and ``origin`` (the task run
    that failed), so the canvas's handle raises what the member raised."""

    def __motir_error__(self) -> dict[str, Any]:
        own = super().__motir_error__()
        own.update({"type": str(self.error.get("type") or own["type"]),
                    "message": str(self.error.get("message") or own["message"])})
        if self.error.get("traceback"):
            own["traceback"] = str(self.error["traceback"])
        return own


def _leaf_job(node: dict[str, Any]) -> Job:
    job = get_job(node["job"])  # UnknownJobError: this worker does not import the member's job module
    if not job.direct:
        raise CanvasError(f"canvas member {job.id!r} is an event or cron job; only direct jobs (started by "
                          ".delay()) take part in a canvas")
    return job


class _Executor:
    """Walks one canvas run's node; every link a step of the run (replayed on each claim)."""

    def __init__(self, step: Step) -> None:
        self.step = step
        self.canvas_id = uuid.UUID(str(step.run_id))

    def run(self, node: dict[str, Any], path: str, pargs: list[Any], pkwargs: dict[str, Any]) -> Any:
        try:
            value = self._body(node, path, pargs, pkwargs)
        except ChildFailed as failed:
            self._errbacks(node, path, failed)
            raise
        links = node.get("link") or []
        if links:  # success callbacks, each with the node's result; awaited, their failures their own
            self._members(f"{path}l", [(link, [value], {}) for link in links])
        return value

    def _body(self, node: dict[str, Any], path: str, pargs: list[Any], pkwargs: dict[str, Any]) -> Any:
        kind = node.get("canvas")
        if kind is None:
            key = f"{path}t"
            (outcome,) = await_members(self.step, key, [self._member(key, node, pargs, pkwargs, leaf=True)])
            if "ok" not in outcome:
                raise _failure(outcome)
            return outcome["ok"]
        if kind == "chain":
            value: Any = None
            for i, link in enumerate(node["tasks"]):
                value = self.run(link, f"{path}{i}.", pargs if i == 0 else [value], pkwargs if i == 0 else {})
            return value
        if kind == "group":
            return self._group(f"{path}g", node["tasks"], pargs, pkwargs)
        results = self._group(f"{path}h", node["header"], pargs, pkwargs)  # a chord
        return self.run(node["body"], f"{path}b.", [results], {})

    def _group(self, key: str, tasks: Sequence[dict[str, Any]], pargs: list[Any], pkwargs: dict[str, Any]) -> list[Any]:
        outcomes = self._members(key, [(task, pargs, pkwargs) for task in tasks])
        values = [o["ok"] if "ok" in o else _failure(o) for o in outcomes]
        failed = next((v for v in values if isinstance(v, ChildFailed)), None)
        if failed is not None:
            failed.results = values
            raise failed
        return values

    def _members(self, key: str, calls: Sequence[tuple[dict[str, Any], list[Any], dict[str, Any]]]) -> list[dict[str, Any]]:
        if not calls:
            return []
        members = [self._member(f"{key}[{i}]", node, pargs, pkwargs) for i, (node, pargs, pkwargs) in enumerate(calls)]
        return await_members(self.step, key, members)

    def _member(self, key: str, node: dict[str, Any], pargs: list[Any], pkwargs: dict[str, Any],
                leaf: bool = False) -> Member:
        if not leaf and not is_leaf(node):  # a canvas of its own: a member run of system.canvas
            return Member(key, canvas_job(), {"args": [node, pargs, pkwargs], "kwargs": {}},
                          member_id(self.canvas_id, key))
        job = _leaf_job(node)
        args, kwargs = list(node.get("args", [])), dict(node.get("kwargs", {}))
        if not node.get("immutable"):
            args, kwargs = list(pargs) + args, {**kwargs, **pkwargs}
        options = node.get("options", {})
        wanted = options.get("task_id")
        eta = options.get("eta")
        return Member(key, job, {"args": args, "kwargs": kwargs},
                      uuid.UUID(str(wanted)) if wanted else member_id(self.canvas_id, key),
                      delay=options.get("countdown"), eta=datetime.fromisoformat(eta) if eta else None,
                      priority=options.get("priority"), queue=options.get("queue"))

    def _errbacks(self, node: dict[str, Any], path: str, failed: ChildFailed) -> None:
        errbacks = node.get("link_error") or []
        if not errbacks:
            return
        failures = ([v for v in failed.results if isinstance(v, ChildFailed)]
                    if node.get("canvas") == "group" and failed.results else [failed])
        # Once per failure: a canvas resumed after a failure (its failed step superseded,
        # ``:resumed:``) that fails again calls its errbacks again, under a key of its own.
        n = sum(1 for k in self.step.records if k.startswith(path) and ":resumed:" in k)
        calls: list[tuple[dict[str, Any], list[Any], dict[str, Any]]] = [
            (errback, [origin(f)], {}) for f in failures for errback in errbacks]
        self._members(f"{path}e{n}", calls)


def origin(failed: ChildFailed) -> str:
    """The id of the task run whose failure this is (a failed canvas member says which of its own)."""
    return str(failed.error.get("origin") or failed.run_id or "")


def _failure(outcome: dict[str, Any]) -> CanvasFailed:
    return CanvasFailed(outcome["step"], outcome.get("run_id"), outcome.get("job_id", ""), outcome["state"],
                        outcome.get("error"))


def canvas_job() -> Job:
    return get_job(CANVAS_JOB_ID)


@define_job(CANVAS_JOB_ID, retry_policy=CANVAS_POLICY, name=alias_name(CANVAS_JOB_ID))
def run_canvas(step: Step, node: Any, args: Any = None, kwargs: Any = None) -> Any:
    """A canvas run: ``node`` walked with the partial arguments ``args`` / ``kwargs`` (``.delay(*args)``
    of the canvas, a chain's previous result, a chord's header results)."""
    check_node(node)
    if not isinstance(args, (list, type(None))) or not isinstance(kwargs, (dict, type(None))):
        raise CanvasError("a canvas run's partial arguments are a list and an object")
    return _Executor(step).run(node, "", list(args or []), dict(kwargs or {}))
