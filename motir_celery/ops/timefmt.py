"""Durations and instants as operators type and read them: ``30d``, ``in 4 min``.

Shared by the CLI and the dashboard. Parsing is strict (a typo is an error that
says what is accepted); formatting is for humans and never fed back to SQL.
Relative phrases ("3 min ago") are computed against an instant the caller
passes in — the database's ``now()`` where one is at hand, so a skewed laptop
clock does not make a run look five minutes old.
"""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

__all__ = ["parse_duration", "parse_since", "format_duration", "format_ago", "format_instant", "next_slots", "describe_cron"]

_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"\s*(\d{1,12}(?:\.\d{1,9})?)\s*(s|m|min|h|d|w)\s*", re.IGNORECASE)
#: Longest duration accepted (a retention period, a look-back): 100 years. Longer
#: ones overflow datetime arithmetic, and mean "everything" anyway.
MAX_DURATION = timedelta(days=36_525)


def parse_duration(text: str) -> timedelta:
    """``"90s"``, ``"15m"``, ``"2h"``, ``"30d"``, ``"1w"`` → timedelta (> 0, at most 100 years)."""
    match = _DURATION.fullmatch(text or "") if len(text or "") <= 40 else None
    if not match:
        raise ValueError(f"{text!r:.40} is not a duration: use a number and a unit, e.g. 90s, 15m, 2h, 30d, 1w")
    seconds = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(seconds) or seconds > MAX_DURATION.total_seconds():
        raise ValueError(f"{text!r:.40}: the duration must be at most 100 years")
    if seconds <= 0:
        raise ValueError(f"{text!r:.40}: the duration must be greater than zero")
    return timedelta(seconds=seconds)


def parse_since(text: str, now: datetime) -> datetime:
    """A lower bound: a duration back from ``now`` (``"1h"``) or an ISO instant (UTC if naive)."""
    try:
        return now - parse_duration(text)
    except ValueError:
        if len(text) <= 40 and _DURATION.fullmatch(text):
            raise  # a duration, out of range: say so, not "neither a duration nor a date"
    try:
        if len(text) > 40:
            raise ValueError(text)
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"{text!r:.40} is neither a duration (30m, 2h, 7d) nor an ISO date/time (2024-05-01T12:00)"
        ) from None
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def format_duration(seconds: float | None) -> str:
    """``0.042`` → ``42ms``, ``75`` → ``1m 15s``, ``90000`` → ``1d 1h``."""
    if seconds is None:
        return "-"
    if seconds < 0:
        seconds = 0.0
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    total = round(seconds)
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {secs}s"


def format_ago(instant: datetime | None, now: datetime) -> str:
    """``"3m 10s ago"`` / ``"in 42s"`` relative to ``now``."""
    if instant is None:
        return "-"
    delta = (now - instant).total_seconds()
    if abs(delta) < 1:
        return "just now"
    return f"{format_duration(delta)} ago" if delta > 0 else f"in {format_duration(-delta)}"


def format_instant(instant: datetime | None) -> str:
    """UTC, second precision: what operators paste into a log search."""
    if instant is None:
        return "-"
    return instant.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def next_slots(cron: str, zone: str, now: datetime, count: int = 3) -> list[datetime]:
    """The next ``count`` slots of ``cron`` in ``zone`` after ``now`` (aware datetimes)."""
    from croniter import croniter

    it = croniter(cron, now.astimezone(ZoneInfo(zone)))
    return [it.get_next(datetime) for _ in range(count)]


_DAYS = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def describe_cron(cron: str) -> str | None:
    """Words for the common shapes of a 5-field cron (``None`` for the rest, shown raw).

    ``*/5 * * * *`` → "every 5 minutes"; ``30 6 * * 1-5`` → "at 06:30 on Monday-Friday".
    """
    fields = cron.split()
    if len(fields) != 5:
        return None
    minute, hour, dom, month, dow = fields
    num = str.isdigit
    if month != "*":
        return None
    if [minute, hour, dom, dow] == ["*", "*", "*", "*"]:
        return "every minute"
    if minute.startswith("*/") and num(minute[2:]) and [hour, dom, dow] == ["*", "*", "*"]:
        return f"every {minute[2:]} minutes"
    if not num(minute):
        return None
    if [hour, dom, dow] == ["*", "*", "*"]:
        return f"every hour at :{int(minute):02d}"
    if hour.startswith("*/") and num(hour[2:]) and [dom, dow] == ["*", "*"]:
        return f"every {hour[2:]} hours at :{int(minute):02d}"
    if not num(hour):
        return None
    at = f"at {int(hour):02d}:{int(minute):02d}"
    if [dom, dow] == ["*", "*"]:
        return f"daily {at}"
    if dom == "*" and re.fullmatch(r"[0-7](?:[-,][0-7])*", dow):
        days = re.sub(r"[0-7]", lambda m: _DAYS[int(m.group())], dow).replace(",", ", ")
        return f"{at} on {days}"
    if dow == "*" and num(dom):
        return f"{at} on day {int(dom)} of each month"
    return None
