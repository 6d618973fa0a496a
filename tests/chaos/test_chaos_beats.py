"""Scenario 6, shortened: three beats on a per-second schedule (one SIGKILLed and
restarted half-way): one run per (job, slot), no slot of the catch-up job missed."""

from __future__ import annotations

from tests.chaos.scenarios import Base, three_beats


def test_three_beats_make_exactly_one_run_per_slot(chaos: Base) -> None:
    result = three_beats(chaos, seconds=10, beats=3, workers=2)
    print(result.summary())
    result.assert_ok()
    assert result.runs >= 10
