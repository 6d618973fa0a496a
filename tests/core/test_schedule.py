"""Cron slots are a pure function of (expression, zone, instant) — no database, no clock.

The DST cases pin the rule documented in motir_celery/schedule.py and
docs/jobs.md: an ambiguous wall time fires at its first occurrence, a
nonexistent one at the instant the clock jumps over it.
"""

from __future__ import annotations

import bisect
import time
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from motir_celery.core.schedule import (
    MAX_CATCHUP,
    ScheduleOptions,
    is_slot,
    latest_slot,
    newest_slots,
    next_slot,
    parse_cron,
    schedule_options,
    slots_between,
    wall_to_instant,
)
from motir_celery.errors import JobDefinitionError

UTC = timezone.utc
PARIS = "Europe/Paris"


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


# --- parsing -------------------------------------------------------------------------


def test_parse_cron_inline_zone_default_utc_and_errors_quote_the_input() -> None:
    assert parse_cron("0 9 * * *") == ("0 9 * * *", "UTC")
    assert parse_cron("TZ=Europe/Paris 0 9 * * *") == ("0 9 * * *", PARIS)
    assert parse_cron("0 9 * * *", "America/New_York") == ("0 9 * * *", "America/New_York")
    assert parse_cron("* * * * * */2") == ("* * * * * */2", "UTC")  # sixth field: seconds
    with pytest.raises(JobDefinitionError, match=r"'61 9 \* \* \*'"):
        parse_cron("61 9 * * *", job_id="j")
    with pytest.raises(JobDefinitionError, match="Mars/Olympus"):
        parse_cron("TZ=Mars/Olympus 0 9 * * *")
    with pytest.raises(JobDefinitionError, match="names zone"):
        parse_cron("TZ=Europe/Paris 0 9 * * *", "UTC")


# --- the slot function -----------------------------------------------------------------


def test_latest_slot_is_at_or_before_now_inclusive() -> None:
    assert latest_slot("0 9 * * *", "UTC", utc(2026, 1, 1, 9, 0)) == utc(2026, 1, 1, 9, 0)
    assert latest_slot("0 9 * * *", "UTC", utc(2026, 1, 1, 8, 59, 59)) == utc(2025, 12, 31, 9, 0)
    assert latest_slot("0 9 * * *", "UTC", utc(2026, 1, 1, 9, 0, 0) + timedelta(microseconds=1)) == utc(2026, 1, 1, 9)
    assert latest_slot("* * * * * */2", "UTC", utc(2026, 1, 1, 0, 0, 3)) == utc(2026, 1, 1, 0, 0, 2)
    assert next_slot("* * * * * */2", "UTC", utc(2026, 1, 1, 0, 0, 2)) == utc(2026, 1, 1, 0, 0, 4)
    assert latest_slot("0 9 * * *", PARIS, utc(2026, 1, 15, 12)) == utc(2026, 1, 15, 8)  # CET
    assert latest_slot("0 9 * * *", PARIS, utc(2026, 7, 15, 12)) == utc(2026, 7, 15, 7)  # CEST
    assert is_slot("0 9 * * *", PARIS, utc(2026, 7, 15, 7)) and not is_slot("0 9 * * *", PARIS, utc(2026, 7, 15, 8))


def test_slot_depends_on_the_instant_only_not_its_offset_nor_the_process_zone(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Two beats reading the same database now() in different session/process zones,
    # or at different moments within one period, compute the same slot.
    instant = utc(2026, 3, 29, 0, 59, 30)
    views = [instant, instant.astimezone(ZoneInfo("Asia/Kolkata")), instant.astimezone(ZoneInfo("Pacific/Chatham"))]
    expected = latest_slot("*/15 * * * *", PARIS, instant)
    monkeypatch.setenv("TZ", "America/Los_Angeles")
    time.tzset()
    try:
        assert {latest_slot("*/15 * * * *", PARIS, v) for v in views} == {expected}
        assert latest_slot("*/15 * * * *", PARIS, instant - timedelta(minutes=14)) == expected
    finally:
        monkeypatch.undo()
        time.tzset()
    with pytest.raises(ValueError, match="aware"):
        latest_slot("* * * * *", "UTC", datetime(2026, 1, 1))


def test_spring_forward_nonexistent_wall_time_fires_once_when_the_clock_jumps_over_it() -> None:
    # Europe/Paris, 2026-03-29: 02:00 CET jumps to 03:00 CEST at 01:00 UTC; 02:30 never happens.
    daily = "30 2 * * *"
    assert wall_to_instant(datetime(2026, 3, 29, 2, 30), ZoneInfo(PARIS)) == utc(2026, 3, 29, 1, 0)
    assert slots_between(daily, PARIS, utc(2026, 3, 28), utc(2026, 3, 30, 12)) == [
        utc(2026, 3, 28, 1, 30),  # 02:30 CET
        utc(2026, 3, 29, 1, 0),   # 02:30 does not exist: 03:00 CEST, the jump
        utc(2026, 3, 30, 0, 30),  # 02:30 CEST
    ]
    assert latest_slot(daily, PARIS, utc(2026, 3, 29, 0, 59, 59)) == utc(2026, 3, 28, 1, 30)
    assert latest_slot(daily, PARIS, utc(2026, 3, 29, 1, 0)) == utc(2026, 3, 29, 1, 0)
    assert next_slot(daily, PARIS, utc(2026, 3, 28, 12)) == utc(2026, 3, 29, 1, 0)
    # A frequent schedule keeps a regular real-time rhythm: 02:00 and 02:30 collapse
    # onto 03:00 CEST, which is a slot anyway — one instant, so one run.
    assert slots_between("*/30 * * * *", PARIS, utc(2026, 3, 29, 0), utc(2026, 3, 29, 2)) == [
        utc(2026, 3, 29, 0, 30), utc(2026, 3, 29, 1, 0), utc(2026, 3, 29, 1, 30), utc(2026, 3, 29, 2, 0),
    ]


def test_fall_back_ambiguous_wall_time_fires_once_at_its_first_occurrence() -> None:
    # Europe/Paris, 2026-10-25: 03:00 CEST goes back to 02:00 CET at 01:00 UTC; 02:30 happens twice.
    daily = "30 2 * * *"
    assert wall_to_instant(datetime(2026, 10, 25, 2, 30), ZoneInfo(PARIS)) == utc(2026, 10, 25, 0, 30)
    assert slots_between(daily, PARIS, utc(2026, 10, 24), utc(2026, 10, 26, 12)) == [
        utc(2026, 10, 24, 0, 30),  # 02:30 CEST
        utc(2026, 10, 25, 0, 30),  # first 02:30 (CEST) only — not 01:30 UTC (the second, CET)
        utc(2026, 10, 26, 1, 30),  # 02:30 CET
    ]
    # During the second pass (02:30 CET = 01:30 UTC) the latest slot is still the first 02:30.
    assert latest_slot(daily, PARIS, utc(2026, 10, 25, 1, 30)) == utc(2026, 10, 25, 0, 30)
    # A frequent schedule has no slots in the repeated hour's second pass.
    quarter = "*/15 * * * *"
    assert latest_slot(quarter, PARIS, utc(2026, 10, 25, 1, 59)) == utc(2026, 10, 25, 0, 45)
    assert next_slot(quarter, PARIS, utc(2026, 10, 25, 0, 50)) == utc(2026, 10, 25, 2, 0)
    assert slots_between(quarter, PARIS, utc(2026, 10, 25, 0, 30), utc(2026, 10, 25, 2, 15)) == [
        utc(2026, 10, 25, 0, 45), utc(2026, 10, 25, 2, 0), utc(2026, 10, 25, 2, 15),
    ]


def _agree(cron: str, zone: str, start: datetime, end: datetime, step: timedelta,
           margin: timedelta = timedelta(days=2)) -> None:
    """latest_slot / next_slot / newest_slots / is_slot against slots_between over [start, end]."""
    # Reference slots over a wider window than the probes, so every probe has a slot on each side.
    slots = slots_between(cron, zone, start - margin, end + margin, limit=100_000)
    assert slots == sorted(set(slots))
    assert all(is_slot(cron, zone, s) for s in slots[:: max(1, len(slots) // 20)])
    assert newest_slots(cron, zone, start, end, 5) == [s for s in slots if start < s <= end][-5:]
    t = start
    while t < end:
        i = bisect.bisect_right(slots, t)
        assert latest_slot(cron, zone, t) == slots[i - 1], (t, cron, zone)
        assert next_slot(cron, zone, t) == slots[i], (t, cron, zone)
        t += step


@pytest.mark.parametrize("zone", ["UTC", PARIS, "America/New_York", "Australia/Lord_Howe"])
@pytest.mark.parametrize("cron", ["*/15 * * * *", "30 2 * * *", "0,30 1-3 * * *"])
def test_slot_functions_agree_with_each_other_across_transitions(zone: str, cron: str) -> None:
    # The transition days of 2026 for Paris, New York and Lord Howe (which moves by 30 minutes).
    for day in (utc(2026, 3, 8), utc(2026, 3, 29), utc(2026, 4, 5), utc(2026, 10, 4), utc(2026, 10, 25),
                utc(2026, 11, 1)):
        _agree(cron, zone, day - timedelta(hours=14), day + timedelta(hours=20), timedelta(minutes=17, seconds=13))


def test_seconds_schedule_across_both_paris_transitions() -> None:
    for jump in (utc(2026, 3, 29, 1), utc(2026, 10, 25, 1)):
        _agree("* * * * * */45", PARIS, jump - timedelta(hours=2), jump + timedelta(hours=2),
               timedelta(minutes=1, seconds=7), margin=timedelta(minutes=5))


# --- options ---------------------------------------------------------------------------


def test_schedule_options_validate_catchup_and_overlap() -> None:
    assert schedule_options("j", {}) == ScheduleOptions(timedelta(0), "allow")
    assert schedule_options("j", {"catchup": 90, "overlap": "skip"}) == ScheduleOptions(timedelta(seconds=90), "skip")
    assert schedule_options("j", {"catchup": timedelta(hours=1)}).catchup == timedelta(hours=1)
    for bad in ({"catchup": -1}, {"catchup": MAX_CATCHUP + timedelta(seconds=1)}, {"catchup": "1h"},
                {"overlap": "queue"}):
        with pytest.raises(JobDefinitionError, match="'j'"):
            schedule_options("j", bad)
    with pytest.raises(JobDefinitionError, match="cron jobs only"):
        schedule_options("j", {"overlap": "skip"}, cron=False)
