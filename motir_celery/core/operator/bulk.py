"""Bulk DLQ actions: replay, resume or dismiss every open entry matching a filter.

``motir dlq resume --job orders.fulfil --since 2h --dry-run`` prints how many open
entries match and a sample; without ``--dry-run`` each one is acted on **by the
single-entry operation** (``replay_dlq`` / ``resume_dlq`` / ``dismiss_dlq``): its own
conditional UPDATE, its own audit record (``replayed_by`` / ``resumed_by`` /
``dismissed_by``), its own commit — so an entry another operator answered meanwhile
is simply reported (``already_replayed``…) and a bulk action interrupted halfway
leaves every entry either done and audited or untouched.

Publishing is paced: at most ``rate`` entries per second (default 10/s; a token
bucket on this process's monotonic clock — a duration, not an instant, so the
one-clock rule is not in play), so a thousand replays reach the workers over
minutes, not in one burst. ``limit`` caps one call (default 1,000): run it again for
the rest.

Matching reads run in the caller's context (``workspace_session``: row-level
security decides which entries the caller may see), then act through the engine.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Literal

from motir_celery.core.operator.dlq import Caller, check_actor, dismiss_dlq, replay_dlq
from motir_celery.core.operator.resume import resume_dlq
from motir_celery.store.sql import operator as operator_sql

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine

__all__ = ["DlqFilter", "BulkResult", "bulk_dlq", "ACTIONS", "DEFAULT_RATE", "DEFAULT_LIMIT"]

Action = Literal["replay", "resume", "dismiss"]
ACTIONS: tuple[Action, ...] = ("replay", "resume", "dismiss")
DEFAULT_RATE = 10.0
DEFAULT_LIMIT = 1000
MAX_LIMIT = 100_000


@dataclass(frozen=True)
class DlqFilter:
    """Which open entries: every field given must match (all None: refused, see ``empty``)."""

    job: str | None = None
    #: A substring of the failure's "type: message", case-insensitive.
    error: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    workspace: str | None = None

    @property
    def empty(self) -> bool:
        return all(v is None for v in (self.job, self.error, self.since, self.until, self.workspace))


@dataclass(frozen=True)
class BulkResult:
    action: Action
    dry_run: bool
    #: Open entries matching the filter (at most ``limit``).
    matched: int
    #: The first few of them: id, job, workspace, failed at, error.
    sample: list[dict[str, Any]] = field(default_factory=list)
    #: Per entry acted on: (dlq id, status of the single-entry operation).
    outcomes: list[tuple[uuid.UUID, str]] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(status for _, status in self.outcomes))


def _like(value: str) -> str:
    return "%" + value.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def matching(engine: Engine, flt: DlqFilter, caller: Caller, *, limit: int = DEFAULT_LIMIT) -> list[dict[str, Any]]:
    """The open entries ``caller`` can see that match ``flt``, oldest failure first."""
    with engine.session(caller.workspace, admin=caller.admin) as s:
        return operator_sql.open_entries(s.connection(), job=flt.job, workspace=flt.workspace,
                                         error_like=None if flt.error is None else _like(flt.error),
                                         since=flt.since, until=flt.until, limit=limit)


def bulk_dlq(engine: Engine, action: Action, flt: DlqFilter, *, caller: Caller, dry_run: bool = False,
             rate: float = DEFAULT_RATE, limit: int = DEFAULT_LIMIT, sample: int = 5,
             on_entry: Callable[[uuid.UUID, str], None] | None = None,
             sleep: Callable[[float], None] = time.sleep) -> BulkResult:
    """Replay, resume or dismiss every open entry matching ``flt`` that ``caller`` can see
    (at most ``limit``), at most ``rate`` per second; ``dry_run``: count and sample only."""
    if action not in ACTIONS:
        raise ValueError(f"action must be one of {', '.join(ACTIONS)}, got {action!r}")
    if flt.empty:
        raise ValueError("a bulk DLQ action needs at least one filter (job, error, since, until, workspace)")
    if not (0 < rate <= 10_000):
        raise ValueError(f"rate must be more than 0 and at most 10000 per second, got {rate!r}")
    if not (1 <= limit <= MAX_LIMIT):
        raise ValueError(f"limit must be from 1 to {MAX_LIMIT}, got {limit!r}")
    check_actor(caller.actor)
    found = matching(engine, flt, caller, limit=limit)
    head = found[:sample]
    if dry_run:
        return BulkResult(action, True, len(found), head)
    outcomes: list[tuple[uuid.UUID, str]] = []
    interval, next_at = 1.0 / rate, time.monotonic()
    for entry in found:
        wait = next_at - time.monotonic()
        if wait > 0:
            sleep(wait)
        next_at = max(next_at, time.monotonic() - interval) + interval
        did = entry["id"]
        status: str
        if action == "replay":
            status = replay_dlq(engine, did, actor=caller.actor).status
        elif action == "resume":
            status = resume_dlq(engine, did, actor=caller.actor).status
        else:
            status = "dismissed" if dismiss_dlq(engine, did, actor=caller.actor) else "closed"
        outcomes.append((did, status))
        if on_entry is not None:
            on_entry(did, status)
    return BulkResult(action, False, len(found), head, outcomes)
