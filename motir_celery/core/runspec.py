"""What a new run carries from its job's definition and its triggering event.

``define_job`` options that shape a run — ``priority=``, ``singleton_key=``,
``concurrency=(limit, key)``, ``cancel_on=[...]``, and flow control's
``throttle=(limit, period[, key])``, ``debounce=(period[, key[, max_wait]])``,
``batch=(max_size, timeout[, key])`` — are validated here at definition time and
turned into column values at fan-out time (flow control's keys: when a run is
gathered at send, or decided at its claim; core/worker/flow.py).

A *key* is either a dotted path into the triggering event (``"data.customer_id"``,
``"workspace_id"``) or a callable ``fn(data) -> str``. It is evaluated once,
when the run is created, and stored on the run: the database then decides
(unique index, locked count) without re-reading the event.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, Mapping

from motir_celery.core.retries import RetryPolicy
from motir_celery.errors import JobDefinitionError
from motir_celery.store.records import RunSpec

__all__ = ["RunSpec", "CancelOn", "Throttle", "Debounce", "Batch", "Gather", "RunOptions", "run_options",
           "run_spec", "path_of", "value_at", "check_trigger", "throttle_key", "gather_of"]

Key = str | Callable[[Any], Any]


@dataclass(frozen=True)
class CancelOn:
    """An event named ``event`` whose value at ``match`` equals the triggering
    event's cancels the run, if it arrives within ``timeout`` of the run's creation."""

    event: str
    match: str
    timeout: timedelta | None = None


@dataclass(frozen=True)
class Throttle:
    """At most ``limit`` runs of the job start per ``period`` seconds, per ``key`` (None: the whole
    job, every workspace together); the rest wait their turn, in order (docs/jobs.md, Throttle)."""

    limit: int
    period: float
    key: Key | None = None


@dataclass(frozen=True)
class Debounce:
    """A burst of events of one ``key`` (per workspace) makes one run, with the last event, once the
    key has been quiet for ``period`` seconds — or ``max_wait`` after the burst's first event."""

    period: float
    key: Key | None = None
    #: Default: ten periods (at most a week).
    max_wait: float | None = None


@dataclass(frozen=True)
class Batch:
    """Events of one ``key`` (per workspace) gather into one run whose handler gets the list: when
    ``max_size`` are in, or ``timeout`` seconds after the first."""

    max_size: int
    timeout: float
    key: Key | None = None


@dataclass(frozen=True)
class Gather:
    """What a new run of a debounce or batch job is gathered under (the arguments of ``motir_gather``)."""

    kind: str  # "debounce" | "batch"
    key: str
    #: debounce: the quiet period; batch: the timeout after the first event (seconds).
    wait: float
    #: debounce: the longest wait after the burst's first event (seconds); batch: the size.
    limit: float


#: Bounds of flow control's numbers (the checked function motir_enqueue_gather holds the same).
MAX_PERIOD = 86400.0 * 7
MAX_THROTTLE_LIMIT = 10_000
MAX_BATCH = 1000


@dataclass(frozen=True)
class RunOptions:
    priority: int = 0
    singleton_key: Key | None = None
    concurrency_limit: int | None = None
    concurrency_key: Key | None = None
    cancel_on: tuple[CancelOn, ...] = ()
    throttle: Throttle | None = None
    debounce: Debounce | None = None
    batch: Batch | None = None

    @property
    def gathers(self) -> bool:
        """Whether a new run of the job is gathered at send (debounce= or batch=)."""
        return self.debounce is not None or self.batch is not None

    @property
    def flow(self) -> bool:
        """Whether the job's claims go through flow control (core/worker/flow.py)."""
        return self.throttle is not None or self.gathers


def path_of(expr: str) -> list[str]:
    """``"data.order_id"`` → ``["order_id"]`` (a path into the event's data)."""
    parts = expr.split(".")
    if parts[0] == "data":
        parts = parts[1:]
    if not parts or not all(parts):
        raise JobDefinitionError(f"{expr!r} is not a dotted path into the event data (e.g. 'data.order_id')")
    return parts


def value_at(data: Any, path: Iterable[str]) -> str | None:
    for part in path:
        if not isinstance(data, Mapping) or part not in data:
            return None
        data = data[part]
    if data is None:
        return None
    # Same text as Postgres's `data #>> path` for scalars, so SQL and Python agree.
    if isinstance(data, bool):
        return "true" if data else "false"
    return data if isinstance(data, str) else str(data)


def _key(job_id: str, name: str, key: Any) -> Key | None:
    if key is None:
        return None
    if callable(key):
        fn: Callable[[Any], Any] = key
        return fn
    if isinstance(key, str):
        if key != "workspace_id":
            path_of(key)
        return key
    raise JobDefinitionError(f"job {job_id!r}: {name} must be a dotted path or a callable, got {key!r}")


def _eval(key: Key | None, data: Any, workspace_id: str | None) -> str | None:
    if key is None:
        return None
    if callable(key):
        value = key(data)
        return None if value is None else str(value)
    if key == "workspace_id":
        return workspace_id
    return value_at(data, path_of(key))


def _seconds(job_id: str, name: str, value: Any, *, low: float = 0.0) -> float:
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low < value <= MAX_PERIOD:
        raise JobDefinitionError(f"job {job_id!r}: {name} must be a number of seconds (or a timedelta) above "
                                 f"{low:g} and at most {MAX_PERIOD:g} (a week), got {value!r}")
    return float(value)


def _count(job_id: str, name: str, value: Any, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise JobDefinitionError(f"job {job_id!r}: {name} must be a whole number from 1 to {high}, got {value!r}")
    return value


def _parts(job_id: str, name: str, value: Any, kind: type, shape: str, low: int, high: int) -> tuple[Any, ...]:
    if isinstance(value, kind):
        return tuple(getattr(value, f) for f in kind.__dataclass_fields__)  # type: ignore[attr-defined]
    if not isinstance(value, tuple) or not low <= len(value) <= high:
        raise JobDefinitionError(f"job {job_id!r}: {name}= must be {shape} or a {kind.__name__}(...), got {value!r}")
    return value


def _flow_options(job_id: str, options: Mapping[str, Any]) -> tuple[Throttle | None, Debounce | None, Batch | None]:
    throttle = debounce = batch = None
    if options.get("throttle") is not None:
        limit, period, *key = _parts(job_id, "throttle", options["throttle"], Throttle, "(limit, period[, key])", 2, 3)
        throttle = Throttle(_count(job_id, "the throttle limit", limit, MAX_THROTTLE_LIMIT),
                            _seconds(job_id, "the throttle period", period),
                            _key(job_id, "the throttle key", key[0] if key else None))
    if options.get("debounce") is not None:
        period, *rest = _parts(job_id, "debounce", options["debounce"], Debounce, "(period[, key[, max_wait]])", 1, 3)
        quiet = _seconds(job_id, "the debounce period", period)
        most = rest[1] if len(rest) > 1 and rest[1] is not None else min(10 * quiet, MAX_PERIOD)
        debounce = Debounce(quiet, _key(job_id, "the debounce key", rest[0] if rest else None),
                            _seconds(job_id, "the debounce max_wait", most, low=quiet - 1e-9))
    if options.get("batch") is not None:
        size, timeout, *key = _parts(job_id, "batch", options["batch"], Batch, "(max_size, timeout[, key])", 2, 3)
        batch = Batch(_count(job_id, "the batch max_size", size, MAX_BATCH), _seconds(job_id, "the batch timeout", timeout),
                      _key(job_id, "the batch key", key[0] if key else None))
    if debounce is not None and batch is not None:
        raise JobDefinitionError(f"job {job_id!r}: debounce= and batch= both gather events into one run; pick one")
    if (debounce is not None or batch is not None) and options.get("singleton_key") is not None:
        raise JobDefinitionError(f"job {job_id!r}: debounce= / batch= already make one run per key; "
                                 "singleton_key= would refuse the events they gather")
    if batch is not None and options.get("cancel_on"):
        raise JobDefinitionError(f"job {job_id!r}: cancel_on matches one triggering event, and a batch run has many")
    return throttle, debounce, batch


def check_trigger(job_id: str, opts: RunOptions, *, event_job: bool) -> None:
    """debounce= and batch= gather *events*: refused on a cron or direct job (define_job calls this)."""
    if opts.gathers and not event_job:
        raise JobDefinitionError(f"job {job_id!r}: debounce= / batch= gather events, so the job needs event=...")


def run_options(job_id: str, options: Mapping[str, Any]) -> RunOptions:
    priority = options.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority <= 9:
        raise JobDefinitionError(f"job {job_id!r}: priority must be an integer from 0 to 9, got {priority!r}")
    limit, ckey = None, None
    if options.get("concurrency") is not None:
        concurrency = options["concurrency"]
        if isinstance(concurrency, int) and not isinstance(concurrency, bool):
            concurrency = (concurrency, None)
        if not (isinstance(concurrency, tuple) and len(concurrency) == 2 and isinstance(concurrency[0], int)
                and concurrency[0] >= 1):
            raise JobDefinitionError(f"job {job_id!r}: concurrency must be (limit >= 1, key), got {concurrency!r}")
        limit, ckey = concurrency[0], _key(job_id, "the concurrency key", concurrency[1])
    cancel_on = []
    for rule in options.get("cancel_on") or ():
        if isinstance(rule, Mapping):
            rule = CancelOn(**rule)
        if not isinstance(rule, CancelOn) or not rule.event:
            raise JobDefinitionError(f"job {job_id!r}: cancel_on entries are CancelOn(event, match) or dicts")
        if isinstance(rule.timeout, (int, float)):
            rule = CancelOn(rule.event, rule.match, timedelta(seconds=rule.timeout))
        path_of(rule.match)
        cancel_on.append(rule)
    if len({r.match for r in cancel_on}) > 1:
        raise JobDefinitionError(f"job {job_id!r}: every cancel_on rule must match on the same field")
    throttle, debounce, batch = _flow_options(job_id, options)
    return RunOptions(
        priority=priority,
        singleton_key=_key(job_id, "singleton_key", options.get("singleton_key")),
        concurrency_limit=limit,
        concurrency_key=ckey,
        cancel_on=tuple(cancel_on),
        throttle=throttle,
        debounce=debounce,
        batch=batch,
    )


def run_spec(job_id: str, policy: RetryPolicy, opts: RunOptions, data: Any, workspace_id: str | None,
             priority: int | None = None) -> RunSpec:
    """The column values of a new run of job ``job_id`` triggered by ``data`` (``Job.spec``)."""
    concurrency = None
    if opts.concurrency_limit is not None:
        # The key "" stands for "the whole job" when no key expression is given.
        concurrency = _eval(opts.concurrency_key, data, workspace_id) or ""
    return RunSpec(
        job_id=job_id,
        max_attempts=policy.max_attempts,
        policy=policy.name,
        priority=opts.priority if priority is None else priority,
        singleton_key=_eval(opts.singleton_key, data, workspace_id),
        concurrency_key=concurrency,
        cancel_key=value_at(data, path_of(opts.cancel_on[0].match)) if opts.cancel_on else None,
    )


def throttle_key(opts: RunOptions, data: Any, workspace_id: str | None) -> str:
    """The throttle key of a run triggered by ``data``: "" is the whole job (every workspace), as a
    key that evaluates to nothing is (concurrency= does the same)."""
    assert opts.throttle is not None
    return _eval(opts.throttle.key, data, workspace_id) or ""


def gather_of(opts: RunOptions, data: Any, workspace_id: str | None) -> Gather | None:
    """What a new run triggered by ``data`` is gathered under (None: the job does not gather). A
    gathering key is always within the run's workspace; "" (no key, or none in the data) is the
    workspace's one gathering of the job."""
    if opts.debounce is not None:
        d = opts.debounce
        return Gather("debounce", _eval(d.key, data, workspace_id) or "", d.period, d.max_wait or d.period)
    if opts.batch is not None:
        b = opts.batch
        return Gather("batch", _eval(b.key, data, workspace_id) or "", b.timeout, float(b.max_size))
    return None
