"""Celery's canvas of durable jobs: signatures, ``chain`` / ``|``, ``group``, ``chord``, callbacks.

``add.s(2, 2) | mul.s(4)``, ``group(add.s(i, i) for i in range(10))``, ``chord(header, tsum.s())``,
``add.apply_async((1, 2), link=mul.s(3), link_error=log.s())`` are built here as Celery builds
them (the same ``|`` rules: a group followed by a task is a chord, a chord followed by a task
extends its body, a group of one unrolls), for **direct jobs** only. ``.delay()`` /
``.apply_async()`` of a canvas writes **one** direct run of the job ``system.canvas`` whose
argument is the canvas as JSON (its node) — through ``direct.apply_async``, so every option of
a direct call holds for the canvas as a whole: ``countdown=`` / ``eta=`` (its start),
``task_id=`` / ``idempotency_key=`` (a second call writes nothing), ``workspace_id=``,
``session=`` and Django's ``atomic()`` (written in the caller's transaction, published on
commit), ``queue=`` / ``priority=`` (of the canvas run and of every member that names none).
Its links are that run's steps (``core/worker/canvas.py``): nothing lives outside Postgres.

A single signature without callbacks is no canvas: ``add.s(1, 2).delay()`` is ``add.delay(1, 2)``.

**Member options** (``sig.set(...)``, ``job.signature(args, kwargs, **options)``):
``countdown``, ``eta``, ``priority``, ``queue`` (its first message; a message the sweeper
re-publishes follows the job's route) and ``task_id`` (the member's run id; by default the
canvas derives one). ``idempotency_key`` is the canvas's (``apply_async``), not a member's:
a member already runs once per canvas.

**Celery's own objects.** A Celery signature of a task that is a durable job (``celery.signature
("proj.add", args=(1,))``, a signature serialized as a dict) is taken as that job's. A plain Celery
task in a canvas of durable jobs is refused, naming it (``CanvasNotSupported``): its result and
its links would live in Celery's result backend, outside Postgres, the very links a crash loses;
make it a durable job (its task name is kept). ``celery.chain(...)`` of durable signatures builds
this module's chain (``|`` underneath); Celery's ``group(...)`` / ``chord(...)`` cannot hold them
and say so when called: use ``motir_celery.group`` / ``chord``.

``map`` / ``starmap`` / ``chunks`` are supported as groups of one member run per item (Celery
runs a map in one task, item after item): the same results, each item retried on its own.
"""

from __future__ import annotations

import copy
import uuid
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, NoReturn, Sequence

from motir_celery.core.current import current
from motir_celery.core.jobs import CanvasNotSupported, Job, find_job, get_job, job_for_task
from motir_celery.core.producer.direct import Adopted, adopt, refuse
from motir_celery.core.producer.results import READY_STATES, RunHandle
from motir_celery.core.shapes import CANVAS_JOB_ID, MAX_DEPTH, MEMBER_OPTIONS, check_node, is_leaf, member_id

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine

__all__ = ["Signature", "chain", "group", "chord", "signature", "xmap", "xstarmap", "chunks", "CanvasHandle",
           "GroupHandle", "maybe_signature", "outline", "embedded", "adopt_canvas", "CanvasNotSupported"]

#: The options of a canvas's ``apply_async`` (those of a direct call, and its callbacks).
CANVAS_OPTIONS = ("countdown", "eta", "queue", "priority", "task_id", "idempotency_key", "workspace_id", "session",
                  "link", "link_error")
_CELERY_PRIMITIVES = (
    "Celery's own {what} cannot hold durable signatures (it would run them with its result backend "
    "and chord counter, outside Postgres): use motir_celery.chain / group / chord — `from motir_celery "
    "import chain, group, chord` — which take the same arguments")


class Canvas:
    """What chain, group, chord and signatures share: callbacks, ``|``, and starting them."""

    options: dict[str, Any]

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.options = dict(options or {})
        self._links: list[Canvas] = []
        self._errbacks: list[Canvas] = []

    # --- Celery's canvas API -----------------------------------------------------------

    def set(self, **options: Any) -> Canvas:
        """Options for this signature (a member) or canvas (``apply_async``'s); returns ``self``."""
        self.options.update(options)
        return self

    def link(self, callback: Any) -> Any:
        """Call ``callback`` with this one's result once it succeeds; returns ``callback``."""
        self._links.append(_canvas_of(callback))
        return callback

    def link_error(self, errback: Any) -> Any:
        """Call ``errback`` with the failed task run's id once this one fails; returns ``errback``."""
        self._errbacks.append(_canvas_of(errback))
        return errback

    def on_error(self, errback: Any) -> Canvas:
        """``link_error``, returning ``self`` (``chain(...).on_error(err.s())``)."""
        self.link_error(errback)
        return self

    def clone(self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
              **options: Any) -> Canvas:
        """A copy (members and callbacks copied too), with partial arguments prepended and options added."""
        twin = self._copy()
        twin.options = {**copy.deepcopy(self.options), **options}
        twin._links = [c.clone() for c in self._links]
        twin._errbacks = [c.clone() for c in self._errbacks]
        twin._partial(tuple(args or ()), dict(kwargs or {}))
        return twin

    def _copy(self) -> Canvas:
        raise NotImplementedError

    def _partial(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if args or kwargs:
            raise TypeError(f"a {type(self).__name__} takes partial arguments when started: .delay(*args)")

    def __or__(self, other: Any) -> Canvas:
        return _pipe(self, _canvas_of(other, right=True))

    def __ror__(self, other: Any) -> Canvas:
        if _empty_celery_chain(other):  # celery.chain(a, b) folds from an empty chain: chain() | a
            return self.clone()
        return _pipe(_canvas_of(other), self)

    def __ior__(self, other: Any) -> Canvas:
        return self.__or__(other)

    def delay(self, *args: Any, **kwargs: Any) -> RunHandle:
        """Start it: ``apply_async(args, kwargs)``."""
        return self.apply_async(args, kwargs)

    def apply_async(self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
                    **options: Any) -> RunHandle:
        """Write the canvas as one durable run (its links the run's steps) and publish it after
        commit; its handle, whose ``get()`` is what Celery's would return (a chain: the last
        result; a group: the list; a chord: the body's result). ``args`` / ``kwargs`` are partial
        arguments: the first link's, each group member's, each chord header member's."""
        return self._start(args, kwargs, options, eager=False)

    def apply(self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
              **options: Any) -> RunHandle:
        """Run the whole canvas now, in this process, through the engine (Celery's ``apply``):
        every member a stored run, executed here; the handle answers at once."""
        return self._start(args, kwargs, options, eager=True)

    async def delay_async(self, *args: Any, **kwargs: Any) -> RunHandle:
        """``delay`` for asyncio code (the canvas run written over psycopg's async connection)."""
        return await self.apply_async_async(args, kwargs)

    async def apply_async_async(self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
                                **options: Any) -> RunHandle:
        """``apply_async`` for asyncio code; ``session=`` takes an ``AsyncSession``."""
        job, node, call_args, opts = self._prepared(args, kwargs, options)
        return CanvasHandle.of(await job.apply_async_async(call_args, {}, **opts), node)

    def _start(self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None, options: Mapping[str, Any],
               *, eager: bool) -> RunHandle:
        job, node, call_args, opts = self._prepared(args, kwargs, options)
        call = (job.apply if eager else job.apply_async)(call_args, {}, **opts)
        return CanvasHandle.of(call, node)

    def _prepared(self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None,
                  options: Mapping[str, Any]) -> tuple[Job, dict[str, Any], list[Any], dict[str, Any]]:
        """The canvas job, this canvas's node, the run's arguments and the direct call's options."""
        # Any option this engine does not take (expires=, headers=, serializer=...) is refused by name.
        opts = {**self.options, **options}
        unknown = sorted(set(opts) - set(CANVAS_OPTIONS))
        if unknown:
            raise TypeError(f"apply_async() of a canvas: unsupported option(s) {', '.join(unknown)}; "
                            f"supported: {', '.join(CANVAS_OPTIONS)}")
        extra_links, extra_errbacks = opts.pop("link", None), opts.pop("link_error", None)
        target = self.clone() if (extra_links or extra_errbacks) else self
        for callback in _listed(extra_links):
            target.link(callback)
        for errback in _listed(extra_errbacks):
            target.link_error(errback)
        inherited = {k: opts[k] for k in ("queue", "priority") if opts.get(k) is not None}
        node = target.node(inherited)
        check_node(node)
        workspace = _workspace_of(node, opts.get("workspace_id"))
        if workspace is not None:
            opts["workspace_id"] = workspace
        return get_job(CANVAS_JOB_ID), node, [node, list(args or ()), dict(kwargs or {})], opts

    # --- what core/worker/canvas.py runs ---------------------------------------------------------

    def node(self, inherited: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The canvas as the JSON its run holds (``inherited``: queue / priority for members naming none)."""
        node = self._node(dict(inherited or {}))
        if self._links:
            node["link"] = [c.node(inherited) for c in self._links]
        if self._errbacks:
            node["link_error"] = [c.node(inherited) for c in self._errbacks]
        return node

    def _node(self, inherited: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    # --- Celery's own primitives cannot hold these: say so where they look -----------------

    @property
    def app(self) -> NoReturn:
        raise CanvasNotSupported(_CELERY_PRIMITIVES.format(what="group() / chord()"))

    @property
    def _app(self) -> NoReturn:  # maybe_signature() sets it on whatever it is given
        raise CanvasNotSupported(_CELERY_PRIMITIVES.format(what="group() / chord()"))

    @_app.setter
    def _app(self, value: Any) -> NoReturn:
        raise CanvasNotSupported(_CELERY_PRIMITIVES.format(what="group() / chord()"))

    @property
    def name(self) -> NoReturn:  # Signature(<this>) reads it: a Celery signature of it would not be durable
        raise CanvasNotSupported(_CELERY_PRIMITIVES.format(what="chord() / Signature()") +
                                 "; a durable signature's task name is its .task")


class Signature(Canvas):
    """One durable job with (partial) arguments: ``job.s(...)``, ``job.si(...)``, ``job.signature(...)``."""

    def __init__(self, job: Job, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                 options: Mapping[str, Any] | None = None, immutable: bool = False) -> None:
        if not isinstance(job, Job) or not job.direct:
            raise CanvasNotSupported(_not_direct(job))
        super().__init__(options)
        if isinstance(args, (str, bytes, Mapping)) or not isinstance(args, Sequence):
            raise TypeError(f"args of {job.id}.s() is a list or tuple, got {type(args).__name__}")
        self.type = job
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})
        self.immutable = bool(immutable)

    @property
    def task(self) -> str:
        """The job's Celery task name (what Celery's ``sig.task`` says)."""
        return self.type.task_name

    @property
    def id(self) -> str | None:
        """The ``task_id=`` option, if one was set (Celery's ``sig.id``)."""
        value = self.options.get("task_id")
        return None if value is None else str(value)

    def __repr__(self) -> str:
        shown = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.type.id}.{'si' if self.immutable else 's'}({', '.join(shown)})"

    def set_immutable(self, immutable: bool) -> None:
        self.immutable = bool(immutable)

    def _partial(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.immutable:  # Celery's clone(args): partial arguments go first, partial kwargs win
            self.args = tuple(args) + self.args
            self.kwargs = {**self.kwargs, **kwargs}

    def _copy(self) -> Signature:
        return Signature(self.type, self.args, copy.deepcopy(self.kwargs), None, self.immutable)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the job's body here and now (Celery calls the task inline): nothing is stored."""
        call_args = self.args if self.immutable else tuple(args) + self.args
        call_kwargs = self.kwargs if self.immutable else {**self.kwargs, **kwargs}
        return self.type(*call_args, **call_kwargs)

    def apply_async(self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
                    **options: Any) -> RunHandle:
        """Without callbacks, the job's own direct run (``job.apply_async``, Celery's
        ``sig.apply_async``); with ``link`` / ``link_error``, a canvas."""
        if self._links or self._errbacks or options.get("link") or options.get("link_error"):
            return super().apply_async(args, kwargs, **options)
        call_args, call_kwargs = self._arguments(args, kwargs)
        opts = {k: v for k, v in {**self.options, **options}.items() if k not in ("link", "link_error")}
        return self.type.apply_async(call_args, call_kwargs, **opts)

    def apply(self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
              **options: Any) -> RunHandle:
        if self._links or self._errbacks or options.get("link") or options.get("link_error"):
            return super().apply(args, kwargs, **options)
        call_args, call_kwargs = self._arguments(args, kwargs)
        opts = {k: v for k, v in {**self.options, **options}.items() if k not in ("link", "link_error")}
        return self.type.apply(call_args, call_kwargs, **opts)

    def _arguments(self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> tuple[list[Any], dict[str, Any]]:
        if self.immutable:
            return list(self.args), dict(self.kwargs)
        return list(args or ()) + list(self.args), {**self.kwargs, **dict(kwargs or {})}

    def _node(self, inherited: dict[str, Any]) -> dict[str, Any]:
        node: dict[str, Any] = {"job": self.type.id, "args": list(self.args)}
        if self.kwargs:
            node["kwargs"] = dict(self.kwargs)
        if self.immutable:
            node["immutable"] = True
        options = _member_options(self, {**inherited, **{k: v for k, v in self.options.items() if v is not None}})
        if options:
            node["options"] = options
        return node


class _Composite(Canvas):
    tasks: list[Canvas]

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Canvas]:
        return iter(self.tasks)

    def __repr__(self) -> str:
        return f"{type(self).__name__.strip('_')}({', '.join(repr(t) for t in self.tasks)})"


class chain(_Composite):
    """Links run one after another, each with the previous result first: ``chain(a.s(), b.s())``, ``a.s() | b.s()``."""

    def __init__(self, *tasks: Any, **options: Any) -> None:
        super().__init__(options)
        if len(tasks) == 1 and not isinstance(tasks[0], Canvas) and isinstance(tasks[0], Iterable) \
                and not isinstance(tasks[0], Mapping):
            tasks = tuple(tasks[0])
        folded: list[Canvas] = []
        for task in (_canvas_of(t) for t in tasks):
            if isinstance(task, chain) and not task._links and not task._errbacks and not task.options:
                folded += task.tasks  # a chain in a chain is its links (Celery flattens too)
            else:
                folded.append(task)
        self.tasks = folded

    def _partial(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.tasks:
            self.tasks[0]._partial(args, kwargs)

    def _copy(self) -> chain:
        return chain(*[t.clone() for t in self.tasks])

    def __call__(self, *args: Any, **kwargs: Any) -> RunHandle:
        return self.apply_async(args, kwargs)

    def _node(self, inherited: dict[str, Any]) -> dict[str, Any]:
        if not self.tasks:
            raise ValueError("an empty chain has nothing to run")
        return {"canvas": "chain", "tasks": [t.node(inherited) for t in self.tasks]}


class group(_Composite):
    """Members started at once; the result is their results in order: ``group(add.s(i, i) for i in range(10))``."""

    def __init__(self, *tasks: Any, **options: Any) -> None:
        super().__init__(options)
        if len(tasks) == 1 and not isinstance(tasks[0], Canvas) and isinstance(tasks[0], Iterable) \
                and not isinstance(tasks[0], Mapping):
            tasks = tuple(tasks[0])
        self.tasks = [_canvas_of(t) for t in tasks]

    def _partial(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for task in self.tasks:
            task._partial(args, kwargs)

    def _copy(self) -> group:
        return group(*[t.clone() for t in self.tasks])

    def __call__(self, *args: Any, **kwargs: Any) -> RunHandle:
        return self.apply_async(args, kwargs)

    def _node(self, inherited: dict[str, Any]) -> dict[str, Any]:
        return {"canvas": "group", "tasks": [t.node(inherited) for t in self.tasks]}


class chord(Canvas):
    """A header group, then its body called once with the header's results in order:
    ``chord(header, body)``, ``chord(header)(body)``, ``group(...) | body``."""

    def __init__(self, header: Any, body: Any = None, **options: Any) -> None:
        super().__init__(options)
        self.header = header if isinstance(header, group) else group(header)
        self.body: Canvas | None = None if body is None else _canvas_of(body)

    @property
    def tasks(self) -> list[Canvas]:
        """The header's members (Celery's ``chord.tasks``)."""
        return self.header.tasks

    def _partial(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.header._partial(args, kwargs)

    def _copy(self) -> chord:
        twin = chord(self.header.clone(), None if self.body is None else self.body.clone())
        return twin

    def __call__(self, body: Any = None, **options: Any) -> RunHandle:
        """``chord(header)(body)``: start it with this body."""
        target = self
        if body is not None:
            target = self.clone()  # type: ignore[assignment]
            target.body = _canvas_of(body)
        return target.apply_async((), {}, **options)

    def __repr__(self) -> str:
        return f"chord({self.header!r}, {self.body!r})"

    def _node(self, inherited: dict[str, Any]) -> dict[str, Any]:
        if self.body is None:
            raise ValueError("a chord needs a body: chord(header, body) or chord(header)(body)")
        return {"canvas": "chord", "header": [t.node(inherited) for t in self.header.tasks],
                "body": self.body.node(inherited)}


# --- the | rules (Celery's, celery/canvas.py) ------------------------------------------------


def _pipe(left: Canvas, right: Canvas) -> Canvas:
    if isinstance(right, group) and not right.tasks and not right._links and not right._errbacks:
        return left  # x | group() is x: an empty group is a no-op
    if isinstance(left, group):
        return chord(left.clone(), right)  # group | x is a chord with x as its body
    if isinstance(left, chord) and not isinstance(right, (group, chain)) or (
            isinstance(left, chord) and isinstance(right, group) and len(right.tasks) == 1):
        twin = left.clone()
        assert isinstance(twin, chord) and twin.body is not None
        twin.body = _pipe(twin.body, _unrolled(right))  # chord | task extends the body
        return twin
    if isinstance(left, chain) and not left._links and not left._errbacks:
        twin = left.clone()
        assert isinstance(twin, chain)
        if isinstance(right, chain) and not right._links and not right._errbacks and not right.options:
            joined: Canvas = twin
            for task in right.tasks:
                joined = _pipe(joined, task)
            return joined
        right = _unrolled(right)
        last = twin.tasks[-1] if twin.tasks else None
        if isinstance(last, group) and not isinstance(right, group):
            twin.tasks[-1] = chord(last, right)  # chain ending in a group | task: the group becomes a chord
        elif isinstance(last, chord) and not isinstance(right, chord):
            assert last.body is not None
            last.body = _pipe(last.body, right)  # chain ending in a chord | x: the chord's body grows
        else:
            twin.tasks.append(right)
        return twin
    return chain(left.clone(), _unrolled(right))


def _unrolled(task: Canvas) -> Canvas:
    """A group of one member is that member in a chain (Celery's ``maybe_unroll_group``)."""
    if isinstance(task, group) and len(task.tasks) == 1 and not task._links and not task._errbacks:
        return task.tasks[0]
    return task


# --- taking Celery's objects, refusing plain tasks ---------------------------------------------


def _canvas_of(value: Any, right: bool = False) -> Canvas:
    """A canvas element: ours as it is; a Celery signature (object or dict) of a durable job's task
    as that job's; anything else refused, naming it."""
    if isinstance(value, Canvas):
        return value
    if isinstance(value, Job):
        return Signature(value)  # a bare job in a canvas: its signature without arguments
    return maybe_signature(value)


def maybe_signature(value: Any) -> Canvas:
    """Celery's signature (a ``celery.Signature``, or its dict form) as a durable one, when each of
    its tasks is a durable job's; ``CanvasNotSupported`` naming the first plain Celery task."""
    if isinstance(value, Canvas):
        return value
    if not isinstance(value, Mapping) or not isinstance(value.get("task"), str):
        raise TypeError(f"a canvas holds signatures of durable jobs (job.s(...)), got {type(value).__name__}: "
                        f"{value!r:.100}")
    name, kwargs = value["task"], value.get("kwargs") or {}
    options = {k: v for k, v in dict(value.get("options") or {}).items() if k in MEMBER_OPTIONS}
    if name == "celery.chain":
        made: Canvas = chain(*[maybe_signature(t) for t in kwargs.get("tasks", [])])
    elif name == "celery.group":
        made = group(*[maybe_signature(t) for t in kwargs.get("tasks", [])])
    elif name == "celery.chord":
        made = chord(group(*[maybe_signature(t) for t in kwargs.get("header", [])]),
                     maybe_signature(kwargs["body"]) if kwargs.get("body") else None)
    else:
        job = job_for_task(name) or find_job(name)
        if job is None or not job.direct:
            raise CanvasNotSupported(_plain(name, job))
        made = Signature(job, tuple(value.get("args") or ()), dict(kwargs), options, bool(value.get("immutable")))
        options = {}
    made.options.update(options)
    raw = dict(value.get("options") or {})
    for callback in _listed(raw.get("link")):
        made.link(maybe_signature(callback))
    for errback in _listed(raw.get("link_error")):
        made.link_error(maybe_signature(errback))
    return made


def _plain(name: str, job: Job | None) -> str:
    if job is not None:
        return _not_direct(job)
    return (f"{name!r} is a plain Celery task, not a durable job: a canvas of durable jobs cannot hold it. Its "
            "result and its links would live in Celery's result backend, outside Postgres — the links a "
            "crash or a lost message loses, which this canvas exists to keep. Make it a durable job "
            "(@define_job() keeps its task name), or start it from a step of one (step.run)")


def _not_direct(job: Any) -> str:
    if isinstance(job, Job):
        trigger = "an event job" if job.events else "a cron job"
        return (f"job {job.id!r} is {trigger}: only direct jobs (started by .delay(), defined with neither "
                "event= nor cron=) take part in a canvas")
    return f"a canvas holds signatures of durable jobs, got {job!r:.100}"


def _empty_celery_chain(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("task") == "celery.chain" and \
        not (value.get("kwargs") or {}).get("tasks")


def _listed(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _member_options(sig: Signature, options: dict[str, Any]) -> dict[str, Any]:
    refused = sorted(k for k in options if k not in MEMBER_OPTIONS)
    if refused:
        why = ("; idempotency_key is the canvas's own (apply_async of the canvas): a member already runs once "
               "per canvas" if "idempotency_key" in refused else "")
        raise TypeError(f"{sig!r}: option(s) {', '.join(refused)} cannot be set on a canvas member; a member takes "
                        f"{', '.join(MEMBER_OPTIONS)}{why}")
    out: dict[str, Any] = {}
    for key in MEMBER_OPTIONS:
        value = options.get(key)
        if value is None:
            continue
        if key == "eta":
            if not isinstance(value, datetime):
                raise ValueError(f"{sig!r}: eta must be a datetime, got {value!r:.80}")
            value = (value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)).isoformat()
        elif key == "countdown":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 10 * 365 * 86400:
                raise ValueError(f"{sig!r}: countdown must be a number of seconds, got {value!r:.80}")
            value = float(value)
        elif key == "priority":
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 9:
                raise ValueError(f"{sig!r}: priority must be an integer from 0 to 9, got {value!r}")
        elif key == "queue":
            if not isinstance(value, str) or not value:
                raise ValueError(f"{sig!r}: queue must be a non-empty string, got {value!r}")
        elif key == "task_id":
            try:
                value = str(uuid.UUID(str(value)))
            except ValueError:
                raise ValueError(f"{sig!r}: a member's task_id is its run id, a UUID; got {value!r:.80}") from None
        out[key] = value
    return out


def _workspace_of(node: dict[str, Any], given: Any) -> str | None:
    """A canvas lives in one workspace: ``workspace_id=``, else the one its members' ``workspace_id``
    keyword arguments name (as a direct call takes it from its kwargs); two different refused."""
    named = {w for w in _leaf_workspaces(node, 0) if isinstance(w, str)}
    if given is not None:
        named.add(given)
    if len(named) > 1:
        raise ValueError(f"a canvas runs in one workspace; its members name {', '.join(sorted(named))}")
    return next(iter(named), None)


def _leaf_workspaces(node: dict[str, Any], depth: int) -> Iterator[Any]:
    if depth > MAX_DEPTH:
        return
    if "job" in node:
        yield (node.get("kwargs") or {}).get("workspace_id")
    for part in (node.get("tasks") or []) + (node.get("header") or []) + (node.get("link") or []) + \
            (node.get("link_error") or []) + ([node["body"]] if isinstance(node.get("body"), dict) else []):
        yield from _leaf_workspaces(part, depth + 1)


# --- map, starmap, chunks -----------------------------------------------------------------------


def xmap(job: Job, items: Iterable[Any]) -> group:
    """``job.map(items)``: ``[job(item) for item in items]``, each item a member run of its own."""
    return group(Signature(job, (item,), immutable=True) for item in items)


def xstarmap(job: Job, items: Iterable[Sequence[Any]]) -> group:
    """``job.starmap(items)``: ``[job(*item) for item in items]``, each item a member run of its own."""
    return group(Signature(job, tuple(item), immutable=True) for item in items)


def chunks(job: Job, items: Iterable[Sequence[Any]], n: int) -> group:
    """``job.chunks(items, n)``: the starmap cut in chunks of ``n``; the result a list of each chunk's list."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"chunks of {job.id}: the chunk size is an integer >= 1, got {n!r}")
    listed = [tuple(item) for item in items]
    return group(xstarmap(job, listed[i:i + n]) for i in range(0, len(listed), n))


def signature(varies: Any, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
              *, immutable: bool = False, **options: Any) -> Canvas:
    """Celery's ``signature()``: of a job (or its id, or its task name), or of a signature's dict form."""
    if isinstance(varies, Job):
        return Signature(varies, tuple(args or ()), kwargs, options, immutable)
    if isinstance(varies, str):
        job = job_for_task(varies) or find_job(varies)
        if job is None or not job.direct:
            raise CanvasNotSupported(_plain(varies, job))
        return Signature(job, tuple(args or ()), kwargs, options, immutable)
    made = maybe_signature(varies)
    made.options.update(options)
    return made


def outline(node: Any, depth: int = 0) -> str:
    """A canvas node in one line, for people: ``chain(canvas.add, chord([50 x canvas.add], canvas.tsum))``."""
    if not isinstance(node, dict) or depth > MAX_DEPTH:
        return "?"
    kind = node.get("canvas")
    if kind is None:
        text = str(node.get("job"))
    elif kind == "chord":
        text = f"chord([{_outlines(node.get('header') or [], depth)}], {outline(node.get('body'), depth + 1)})"
    elif kind == "group":
        text = f"group([{_outlines(node.get('tasks') or [], depth)}])"
    else:
        parts = [outline(t, depth + 1) for t in node.get("tasks") or []]
        shown = parts if len(parts) <= 12 else parts[:10] + [f"... {len(parts) - 10} more"]
        text = f"chain({', '.join(shown)})"
    for name, key in (("link", "link"), ("on_error", "link_error")):
        if node.get(key):
            text += f" +{name}({', '.join(outline(c, depth + 1) for c in node[key])})"
    return text


def _outlines(members: list[Any], depth: int) -> str:
    """Members in order, a run of identical ones counted: ``50 x canvas.add, canvas.tsum``."""
    runs: list[tuple[str, int]] = []
    for member in members:
        text = outline(member, depth + 1)
        if runs and runs[-1][0] == text:
            runs[-1] = (text, runs[-1][1] + 1)
        else:
            runs.append((text, 1))
    return ", ".join(text if n == 1 else f"{n} x {text}" for text, n in runs)


# --- a Celery-protocol message carrying a canvas (an old producer's chain, link=) --------------


def embedded(request: Any) -> dict[str, Any]:
    """What of a canvas a Celery message carries (its request's ``chain``, ``callbacks``,
    ``errbacks``, ``chord``), by name; empty for a plain call."""
    found = {name: getattr(request, name, None) for name in ("chain", "callbacks", "errbacks", "chord")}
    return {k: v for k, v in found.items() if v}


def adopt_canvas(engine: Engine, job: Job, args: Sequence[Any], kwargs: Mapping[str, Any], task_id: str,
                 parts: Mapping[str, Any], *, task_name: str, shown: Mapping[str, str]) -> Adopted:
    """A message in Celery's protocol for direct job ``job`` that carries the rest of a canvas
    (Celery's own ``chain``, ``link=``, ``link_error=``, sent by a producer of the release before
    the cut-over or by ``send_task(..., link=...)``): stored as **one canvas run** — this call, then
    its chain, its callbacks and errbacks — keyed on the message's task id (a redelivered copy is
    the same canvas; ``AsyncResult(task_id)`` is the canvas's result, the chain's last), and
    published. Nothing of it is dropped: a message that is a member of Celery's own *chord* (its
    siblings and body live in Celery's result backend), or whose canvas names a plain Celery task,
    is refused into the DLQ with the reason (``direct.refuse``)."""
    try:
        if parts.get("chord"):
            raise CanvasNotSupported(
                f"message {task_id} is a member of a chord built by Celery's chord(): its siblings and its body "
                "are counted in Celery's result backend, which no durable run settles; rebuild the chord with "
                "motir_celery.chord (docs/tasks-to-jobs.md, Canvas)")
        head: Canvas = Signature(job, tuple(args), dict(kwargs))
        rest = [maybe_signature(s) for s in reversed(list(parts.get("chain") or []))]  # Celery keeps it reversed
        made = chain(head, *rest) if rest else head
        for callback in _listed(parts.get("callbacks")):
            made.link(maybe_signature(callback))
        for errback in _listed(parts.get("errbacks")):
            made.link_error(maybe_signature(errback))
        if not isinstance(made, chain) and not made._links and not made._errbacks:
            return adopt(engine, job, args, kwargs, task_id, task_name=task_name, shown=shown)
        canvas_job, _node, call_args, opts = made._prepared(None, None, {"task_id": task_id})
        written = engine.apply_async(canvas_job, call_args, {}, opts)
    except Exception as exc:  # noqa: BLE001 — a canvas this engine cannot make durable: kept, with the reason
        return refuse(engine, job, task_id, task_name, shown, exc)
    return Adopted(written.id, written.deduplicated)


# --- handles -------------------------------------------------------------------------------------


class CanvasHandle(RunHandle):
    """The handle of a canvas: its run's (``id``; ``AsyncResult(id)`` reads the same row), whose
    ``get()`` is the canvas's result. ``children`` are its top-level links' handles (a chain's
    links, a group's members, a chord's header then its body), ``results`` a group's members,
    ``parent`` the link before a chain's last. ``revoke()`` cancels the canvas: every member not
    finished is cancelled with it (a running one at its next step boundary), none starts later."""

    def __init__(self, run_id: uuid.UUID | None, job_id: str, *, node: dict[str, Any], deduplicated: bool = False,
                 workspace_id: str | None = None, engine: Engine | None = None,
                 written: RunHandle | None = None) -> None:
        super().__init__(run_id, job_id, deduplicated=deduplicated, workspace_id=workspace_id, engine=engine)
        self.node = node
        self._written = written

    @classmethod
    def of(cls, written: RunHandle, node: dict[str, Any]) -> CanvasHandle:
        return cls(written.id, written.job_id, node=node, deduplicated=written.deduplicated,
                   workspace_id=written.workspace_id, engine=written.engine, written=written)

    def get(self, timeout: float | None = None, propagate: bool = True, **options: Any) -> Any:
        """The canvas's result (a chain's last, a group's list, a chord's body's); Celery's other
        ``get`` options are accepted and change nothing here."""
        if self._written is not None:  # knows whether the transaction that wrote it committed
            return self._written.get(timeout=timeout, propagate=propagate)
        return super().get(timeout=timeout, propagate=propagate)

    async def get_async(self, timeout: float | None = None, *, propagate: bool = True) -> Any:
        if self._written is not None:
            return await self._written.get_async(timeout=timeout, propagate=propagate)
        return await super().get_async(timeout=timeout, propagate=propagate)

    def revoke(self, terminate: bool = False, signal: Any = None, wait: bool = False,
               timeout: float | None = None) -> bool:
        """Cancel the canvas run; its unfinished members are cancelled with it (the trigger)."""
        if self.id is None:
            return False
        return (self.engine or current()).cancel_run(self.id)  # as ``motir cancel`` does

    @property
    def children(self) -> list[Any]:
        if self.id is None:
            return []
        return _links_of(self.id, self.node, "", self.workspace_id)

    @property
    def results(self) -> list[Any]:
        """A group's members' handles (Celery's ``GroupResult.results``); else ``children``."""
        return self.children

    @property
    def parent(self) -> Any:
        """A chain's link before the last (Celery's ``result.parent``); None for anything else."""
        kids = self.children if self.node.get("canvas") == "chain" else []
        return kids[-2] if len(kids) > 1 else None

    def __repr__(self) -> str:
        return f"<CanvasHandle {self.node.get('canvas', 'task')} {self.id}>"


class GroupHandle:
    """The members of a group inside a canvas (no run of its own): ``get()`` is their results in order."""

    def __init__(self, results: list[Any]) -> None:
        self.results = results

    def __iter__(self) -> Iterator[Any]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def __getitem__(self, i: int) -> Any:
        return self.results[i]

    def get(self, timeout: float | None = None, propagate: bool = True, **_: Any) -> list[Any]:
        return [r.get(timeout=timeout, propagate=propagate) for r in self.results]

    def ready(self) -> bool:
        return all(r.ready() for r in self.results)

    def successful(self) -> bool:
        return all(r.successful() for r in self.results)

    def failed(self) -> bool:
        return any(r.failed() for r in self.results)

    def completed_count(self) -> int:
        return sum(1 for r in self.results if r.successful())

    @property
    def state(self) -> str:
        states = [r.state for r in self.results]
        if all(s in READY_STATES for s in states):
            return "FAILURE" if "FAILURE" in states else ("REVOKED" if "REVOKED" in states else "SUCCESS")
        return "STARTED" if any(s != "PENDING" for s in states) else "PENDING"


def _member_handle(canvas_id: uuid.UUID, key: str, node: dict[str, Any], workspace: str | None) -> Any:
    """The handle of the member a canvas run starts at ``key`` (a run of its job, or a canvas of its own)."""
    run_id = member_id(canvas_id, key)
    if is_leaf(node):
        wanted = (node.get("options") or {}).get("task_id")
        return RunHandle(uuid.UUID(wanted) if wanted else run_id, node["job"], workspace_id=workspace)
    return CanvasHandle(run_id, CANVAS_JOB_ID, node=node, workspace_id=workspace)


def _handle_at(canvas_id: uuid.UUID, node: dict[str, Any], path: str, workspace: str | None) -> Any:
    """The handle of ``node`` run inline by the canvas run at ``path`` (core/worker/canvas.py's keys)."""
    kind = node.get("canvas")
    if kind is None:
        return _member_handle(canvas_id, f"{path}t", {k: v for k, v in node.items() if k not in ("link", "link_error")},
                              workspace)
    if kind == "chain":
        return _links_of(canvas_id, node, path, workspace)[-1]
    if kind == "group":
        return GroupHandle([_member_handle(canvas_id, f"{path}g[{i}]", t, workspace)
                            for i, t in enumerate(node["tasks"])])
    return _handle_at(canvas_id, node["body"], f"{path}b.", workspace)


def _links_of(canvas_id: uuid.UUID, node: dict[str, Any], path: str, workspace: str | None) -> list[Any]:
    kind = node.get("canvas")
    if kind == "chain":
        return [_handle_at(canvas_id, t, f"{path}{i}.", workspace) for i, t in enumerate(node["tasks"])]
    if kind == "group":
        return [_member_handle(canvas_id, f"{path}g[{i}]", t, workspace) for i, t in enumerate(node["tasks"])]
    if kind == "chord":
        header = GroupHandle([_member_handle(canvas_id, f"{path}h[{i}]", t, workspace)
                              for i, t in enumerate(node["header"])])
        return [header, _handle_at(canvas_id, node["body"], f"{path}b.", workspace)]
    return [_handle_at(canvas_id, node, path, workspace)]

