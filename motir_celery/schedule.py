"""Cron expressions and their slots — pure functions of (expression, zone, instant).

A slot never depends on which beat asks or when it last ran: two beats that
tick in the same minute compute the same ``scheduled_for``, and the unique
``(job_id, scheduled_for)`` constraint turns the second enqueue into
``AlreadyQueued``.
"""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter

from .errors import JobDefinitionError

__all__ = ["parse_cron"]


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
    if now.tzinfo is None:
        raise ValueError("cron slots are computed from an aware instant (the database's now())")
    return now
