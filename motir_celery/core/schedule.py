"""Cron expressions and their slots — pure functions of (expression, zone, instant).

A slot never depends on which beat asks or when it last ran: two beats that
tick in the same second compute the same ``scheduled_for``, and the unique
``(job_id, scheduled_for)`` constraint turns the second enqueue into
``AlreadyQueued``. The instant passed in as ``now`` is the *database's*
``now()`` (DESIGN.md invariant 6); nothing here reads a clock.

Expressions are croniter's: five fields (minute hour day month weekday,
Vixie semantics: day-of-month and day-of-week are OR-ed when both are
restricted), the ``@daily``-style aliases, and an optional sixth field for
**seconds** (``"* * * * * */2"`` = every two seconds) — meant for tests, a
beat tick per second is cheap but not free.

DST rule (deliberate; docs/jobs.md, "Scheduled jobs"). A slot is a *wall-clock*
time in the job's zone, and every matching wall-clock time fires exactly once:

* **ambiguous** (fall back: 02:30 happens twice in Europe/Paris on
  2026-10-25) → its **first** occurrence, the earlier instant (CEST).
  Nothing fires during the repeated hour's second pass.
* **nonexistent** (spring forward: 02:30 never happens in Europe/Paris on
  2026-03-29) → the **instant the clock jumps over it** (03:00 CEST, 01:00 UTC).
  Several skipped wall times collapse onto that one instant, which the
  unique constraint turns into one run.

So a daily job runs exactly once every local day, and the mapping from wall
time to instant is non-decreasing, which is what lets the functions below walk
croniter's naive wall-clock iterator and stop at the first slot past a bound.
A schedule that must keep a fixed *real-time* interval belongs in UTC (the
default), where none of this applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Literal, Mapping
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter

from motir_celery.errors import JobDefinitionError

__all__ = [
    "parse_cron",
    "latest_slot",
    "next_slot",
    "slots_between",
    "newest_slots",
    "wall_to_instant",
    "is_slot",
    "ScheduleOptions",
    "schedule_options",
    "MAX_CATCHUP",
]

UTC = timezone.utc

#: Longest catch-up window a job may ask for. The window is re-scanned when a
#: beat starts, so it must stay well inside how long finished runs are kept
#: (a purged slot inside the window would be enqueued again).
MAX_CATCHUP = timedelta(days=7)

# How far back a DST fold is looked for (see _fold_margin). Covers every
# offset change in tzdata short of a zone moving across the date line.
_FOLD_LOOKBACK = timedelta(hours=26)
# A hard stop for the wall-clock walks, so a pathological expression cannot
# spin a beat: 10,800 = a seconds-granular schedule across a 3-hour fold.
_MAX_STEPS = 20_000


def parse_cron(expression: str, timezone: str | None = None, *, job_id: str = "?") -> tuple[str, str]:
    """Validate ``expression`` (optionally ``"TZ=Zone/Name <cron>"``); return (cron, zone)."""
    if not isinstance(expression, str) or not expression.strip():
        raise JobDefinitionError(f"job {job_id!r}: cron must be a non-empty string, got {expression!r}")
    cron = expression.strip()
    zone = timezone
    if cron.startswith(("TZ=", "CRON_TZ=")):
        prefix, _, cron = cron.partition(" ")
        inline = prefix.split("=", 1)[1]
        if zone is not None and zone != inline:
            raise JobDefinitionError(
                f"job {job_id!r}: cron {expression!r} names zone {inline!r} but timezone={zone!r}"
            )
        zone = inline
    zone = zone or "UTC"
    try:
        ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError):
        raise JobDefinitionError(f"job {job_id!r}: unknown time zone {zone!r} in cron {expression!r}") from None
    if not croniter.is_valid(cron):
        raise JobDefinitionError(f"job {job_id!r}: invalid cron expression {cron!r}")
    return cron, zone


def _aware(now: datetime) -> datetime:
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError("cron slots are computed from an aware instant (the database's now())")
    return now.astimezone(UTC)


def _wall(instant: datetime, tz: ZoneInfo) -> datetime:
    """The naive wall-clock reading of ``instant`` in ``tz`` (fold dropped)."""
    return instant.astimezone(tz).replace(tzinfo=None, fold=0)


def wall_to_instant(wall: datetime, tz: ZoneInfo) -> datetime:
    """The instant (UTC) at which wall-clock time ``wall`` fires in ``tz`` — the DST rule.

    PEP 495 gives two readings of a wall time: ``fold=0`` and ``fold=1``. They
    agree for an ordinary time; for an ambiguous one fold=0 is the earlier
    instant (taken); for a nonexistent one they cross (fold=0 is the *later*
    instant) and the transition between them is taken.
    """
    first = wall.replace(tzinfo=tz, fold=0).astimezone(UTC)
    second = wall.replace(tzinfo=tz, fold=1).astimezone(UTC)
    if first <= second:
        return first  # ordinary (equal) or ambiguous (first occurrence)
    return _transition(tz, second, first)


def _transition(tz: ZoneInfo, before: datetime, after: datetime) -> datetime:
    """The first instant in (before, after] that reads the post-gap offset.

    ``before`` is on the old offset and ``after`` on the new one; zone
    transitions fall on whole seconds, so a bisection over seconds is exact.
    """
    target = after.astimezone(tz).utcoffset()
    lo, hi = math.floor(before.timestamp()), math.ceil(after.timestamp())
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if datetime.fromtimestamp(mid, tz).utcoffset() == target:
            hi = mid
        else:
            lo = mid
    return datetime.fromtimestamp(hi, UTC)


def _fold_margin(tz: ZoneInfo, now: datetime) -> timedelta:
    """How far past ``now``'s wall reading a slot at or before ``now`` can sit.

    Only after a fall back: at 02:10 CET (second pass) the wall time 02:45 has
    already fired, at 00:45 UTC. Elsewhere wall readings increase with time.
    """
    then = (now - _FOLD_LOOKBACK).astimezone(tz).utcoffset() or timedelta(0)
    current = now.astimezone(tz).utcoffset() or timedelta(0)
    return max(then - current, timedelta(0))


def latest_slot(cron: str, zone: str, now: datetime) -> datetime | None:
    """The latest slot at or before ``now`` (UTC), or ``None`` if the expression never fired."""
    now = _aware(now)
    tz = ZoneInfo(zone)
    # Naive start: croniter then does pure wall-clock arithmetic, and the DST
    # rule is applied by wall_to_instant alone. get_prev is strictly-before,
    # hence the extra second (croniter's resolution).
    start = _wall(now, tz) + _fold_margin(tz, now) + timedelta(seconds=1)
    it = croniter(cron, start)
    try:
        for _ in range(_MAX_STEPS):
            slot = wall_to_instant(it.get_prev(datetime), tz)
            if slot <= now:
                return slot  # the mapping is non-decreasing: the first one found is the latest
    except CroniterBadDateError:
        return None
    raise RuntimeError(f"cron {cron!r} in {zone}: no slot found within {_MAX_STEPS} steps before {now}")


def slots_between(cron: str, zone: str, start: datetime, end: datetime, *,
                  limit: int = 10_000) -> list[datetime]:
    """Every slot ``s`` with ``start < s <= end``, ascending, UTC, each instant once.

    Raises ``ValueError`` past ``limit`` slots: callers bound their windows.
    """
    start, end = _aware(start), _aware(end)
    tz = ZoneInfo(zone)
    out: list[datetime] = []
    if end <= start:
        return out
    # A wall time before start's reading fires at or before start (the mapping
    # is non-decreasing), so the walk starts there.
    it = croniter(cron, _wall(start, tz))
    steps = 0
    try:
        while True:
            slot = wall_to_instant(it.get_next(datetime), tz)
            if slot > end:
                return out
            if slot > start and (not out or slot != out[-1]):
                if len(out) >= limit:
                    raise ValueError(f"cron {cron!r}: more than {limit} slots between {start} and {end}")
                out.append(slot)
            steps += 1
            if steps > _MAX_STEPS + limit:
                raise RuntimeError(f"cron {cron!r} in {zone}: walk did not reach {end}")
    except CroniterBadDateError:
        return out


def newest_slots(cron: str, zone: str, start: datetime, end: datetime, limit: int) -> list[datetime]:
    """The newest ``limit`` slots ``s`` with ``start < s <= end``, ascending, UTC.

    Walks back from ``end``, so a long window over a dense schedule costs
    ``limit`` steps, not the whole window.
    """
    start, end = _aware(start), _aware(end)
    tz = ZoneInfo(zone)
    out: list[datetime] = []
    it = croniter(cron, _wall(end, tz) + _fold_margin(tz, end) + timedelta(seconds=1))
    try:
        for _ in range(_MAX_STEPS + limit):
            if len(out) >= limit:
                break
            slot = wall_to_instant(it.get_prev(datetime), tz)
            if slot <= start:
                break
            if slot <= end and (not out or slot != out[-1]):
                out.append(slot)
    except CroniterBadDateError:
        pass
    out.reverse()
    return out


def next_slot(cron: str, zone: str, after: datetime) -> datetime | None:
    """The first slot strictly after ``after`` (UTC), or ``None`` if there is none."""
    after = _aware(after)
    tz = ZoneInfo(zone)
    it = croniter(cron, _wall(after, tz))
    try:
        for _ in range(_MAX_STEPS):
            slot = wall_to_instant(it.get_next(datetime), tz)
            if slot > after:
                return slot
    except CroniterBadDateError:
        return None
    raise RuntimeError(f"cron {cron!r} in {zone}: no slot found within {_MAX_STEPS} steps after {after}")


def is_slot(cron: str, zone: str, instant: datetime) -> bool:
    """Whether ``instant`` is exactly one of the expression's slots."""
    return latest_slot(cron, zone, instant) == _aware(instant)


# --- per-job schedule options ------------------------------------------------------


@dataclass(frozen=True)
class ScheduleOptions:
    #: Zero: each beat pass enqueues the latest slot only (missed slots are
    #: dropped). Otherwise every slot within this window before now.
    catchup: timedelta = timedelta(0)
    #: ``allow``: every slot gets its run, even while the previous one runs.
    #: ``skip``: a slot is skipped (and recorded as such) while another run of
    #: the job is queued or running.
    overlap: Literal["allow", "skip"] = "allow"


def schedule_options(job_id: str, options: Mapping[str, Any], *, cron: bool = True) -> ScheduleOptions:
    """Validate the ``catchup=`` and ``overlap=`` options of ``define_job``."""
    catchup_raw = options.get("catchup")
    overlap = options.get("overlap", "allow")
    if not cron and ("catchup" in options or "overlap" in options):
        raise JobDefinitionError(f"job {job_id!r}: catchup= and overlap= apply to cron jobs only")
    if catchup_raw is None or catchup_raw is False:
        catchup = timedelta(0)
    elif isinstance(catchup_raw, timedelta):
        catchup = catchup_raw
    elif isinstance(catchup_raw, (int, float)) and not isinstance(catchup_raw, bool):
        catchup = timedelta(seconds=catchup_raw)
    else:
        raise JobDefinitionError(
            f"job {job_id!r}: catchup must be a timedelta or a number of seconds, got {catchup_raw!r}"
        )
    if catchup < timedelta(0) or catchup > MAX_CATCHUP:
        raise JobDefinitionError(f"job {job_id!r}: catchup must be between 0 and {MAX_CATCHUP}, got {catchup}")
    if overlap not in ("allow", "skip"):
        raise JobDefinitionError(f"job {job_id!r}: overlap must be 'allow' or 'skip', got {overlap!r}")
    return ScheduleOptions(catchup=catchup, overlap=overlap)
