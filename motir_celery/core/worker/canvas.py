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
from typing import Any, Sequence

from motir_celery.core.jobs import Job, alias_name, define_job, get_job
from motir_celery.core.publish import Publish
from motir_celery.core.retries import RetryPolicy
from motir_celery.core.worker.inline import Inline
from motir_celery.core.worker.invoke import ChildFailed, Member, Route, await_members
from motir_celery.errors import NonRetriableError

__all__ = ["CANVAS_JOB_ID", "CANVAS_POLICY", "KINDS", "MAX_DEPTH", "MEMBER_OPTIONS", "CanvasFailed", "CanvasError",
           "member_id", "check_node", "run_canvas", "use_route", "canvas_job", "is_leaf"]

#: The job every canvas is a run of (its task: ``motir.system.canvas``).
CANVAS_JOB_ID = "system.canvas"
#: A canvas run only starts members and waits: any attempt may be retried, and a worker killed
#: while it held the run charges one (members are runs of their own, with their own policies).
CANVAS_POLICY = RetryPolicy(max_attempts=10, backoff=1.0, factor=2.0, max_backoff=60.0, jitter=0.25, name="canvas")
#: The composite kinds a node's ``canvas`` names (a node without it is a task).
KINDS = ("chain", "group", "chord")
#: How deep composites may nest (a chain in a chord in a chain is 3); deeper is refused where built.
MAX_DEPTH = 16
#: Options a member signature may carry (anything else is refused where the signature is built).
MEMBER_OPTIONS = ("countdown", "eta", "priority", "queue", "task_id")

_route: Route | None = None


class CanvasError(NonRetriableError, ValueError):
    """A canvas node that cannot run (malformed, too deep, a member that is not a direct job)."""


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


def use_route(route: Route) -> None:
    """How a member with its own ``queue=`` / ``priority=`` is published (the package's face
    wires the adapter's ``publisher_for`` in, as it wires the producers: no import points up)."""
    global _route
    _route = route


def _routed(publish: Publish, queue: str | None, priority: int | None) -> Publish:
    if isinstance(publish, Inline) or _route is None:
        return publish  # eager mode and the test kit run members here: their queue means nothing
    return _route(publish, queue, priority)


def member_id(canvas_run_id: uuid.UUID | str, key: str) -> uuid.UUID:
    """The id of the member a canvas run starts at step ``key``: derived, so the producer's
    handle names every member before it exists, and a canvas run never starts two for one key."""
    return uuid.uuid5(uuid.UUID(str(canvas_run_id)), key)


def is_leaf(node: dict[str, Any]) -> bool:
    """A task without callbacks: a member run of its own job (else: a canvas of its own)."""
    return "canvas" not in node and not node.get("link") and not node.get("link_error")


def check_node(node: Any, depth: int = 0) -> None:
    """Refuse a node this module cannot run, naming what is wrong (``CanvasError``)."""
    if depth > MAX_DEPTH:
        raise CanvasError(f"canvas nested more than {MAX_DEPTH} deep")
    if not isinstance(node, dict):
        raise CanvasError(f"a canvas node is a JSON object, got {type(node).__name__}")
    for callbacks in ("link", "link_error"):
        value = node.get(callbacks, [])
        if not isinstance(value, list):
            raise CanvasError(f"{callbacks} of a canvas node is a list")
        for callback in value:
            check_node(callback, depth + 1)
    kind = node.get("canvas")
    if kind is None:
        if not isinstance(node.get("job"), str):
            raise CanvasError("a task node names its job: {'job': <job id>, ...}")
        if not isinstance(node.get("args", []), list) or not isinstance(node.get("kwargs", {}), dict):
            raise CanvasError(f"task {node['job']!r}: args is a list and kwargs an object")
        options = node.get("options", {})
        if not isinstance(options, dict) or set(options) - set(MEMBER_OPTIONS):
            raise CanvasError(f"task {node['job']!r}: options are among {', '.join(MEMBER_OPTIONS)}")
        return
    if kind not in KINDS:
        raise CanvasError(f"unknown canvas kind {kind!r} (one of {', '.join(KINDS)})")
    parts = node.get("header") if kind == "chord" else node.get("tasks")
    if not isinstance(parts, list):
        raise CanvasError(f"a {kind} holds a list of {'header members' if kind == 'chord' else 'tasks'}")
    for part in parts:
        check_node(part, depth + 1)
    if kind == "chord":
        check_node(node.get("body"), depth + 1)
    elif kind == "chain" and not parts:
        raise CanvasError("a chain needs at least one task")


def _leaf_job(node: dict[str, Any]) -> Job:
    job = get_job(node["job"])  # UnknownJobError: this worker does not import the member's job module
    if not job.direct:
        raise CanvasError(f"canvas member {job.id!r} is an event or cron job; only direct jobs (started by "
                          ".delay()) take part in a canvas")
    return job


class _Executor:
    """Walks one canvas run's node; every link a step of the run (replayed on each claim)."""

    def __init__(self, step: Any) -> None:
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
            (outcome,) = await_members(self.step, key, [self._member(key, node, pargs, pkwargs, leaf=True)],
                                       route=_routed)
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
        return await_members(self.step, key, members, route=_routed)

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
        n = sum(1 for k in self.step._memo if k.startswith(path) and ":resumed:" in k)
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
def run_canvas(step: Any, node: Any, args: Any = None, kwargs: Any = None) -> Any:
    """A canvas run: ``node`` walked with the partial arguments ``args`` / ``kwargs`` (``.delay(*args)``
    of the canvas, a chain's previous result, a chord's header results)."""
    check_node(node)
    if not isinstance(args, (list, type(None))) or not isinstance(kwargs, (dict, type(None))):
        raise CanvasError("a canvas run's partial arguments are a list and an object")
    return _Executor(step).run(node, "", list(args or []), dict(kwargs or {}))
