"""What a new run carries from its job's definition and its triggering event.

``define_job`` options that shape a run — ``priority=``, ``singleton_key=``,
``concurrency=(limit, key)``, ``cancel_on=[...]`` — are validated here at
definition time and turned into column values at fan-out time.

A *key* is either a dotted path into the triggering event (``"data.customer_id"``,
``"workspace_id"``) or a callable ``fn(data) -> str``. It is evaluated once,
when the run is created, and stored on the run: the database then decides
(unique index, locked count) without re-reading the event.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, Mapping

from motir_celery.core.retries import RetryPolicy
from motir_celery.errors import JobDefinitionError
from motir_celery.store.records import RunSpec

__all__ = ["RunSpec", "CancelOn", "RunOptions", "run_options", "run_spec", "path_of", "value_at"]

Key = str | Callable[[Any], Any]


@dataclass(frozen=True)
class CancelOn:
    """An event named ``event`` whose value at ``match`` equals the triggering
    event's cancels the run, if it arrives within ``timeout`` of the run's creation."""

    event: str
    match: str
    timeout: timedelta | None = None


@dataclass(frozen=True)
class RunOptions:
    priority: int = 0
    singleton_key: Key | None = None
    concurrency_limit: int | None = None
    concurrency_key: Key | None = None
    cancel_on: tuple[CancelOn, ...] = ()


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
    return RunOptions(
        priority=priority,
        singleton_key=_key(job_id, "singleton_key", options.get("singleton_key")),
        concurrency_limit=limit,
        concurrency_key=ckey,
        cancel_on=tuple(cancel_on),
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
