"""Scenario 6, shortened: three beats on a per-second schedule (one SIGKILLed and
restarted half-way): one run per (job, slot), no slot of the catch-up job missed.

In ``make test-scale``, not ``make test``: tests/adapter/test_beat.py's three real beats (one
SIGKILLed mid-run; every slot once, the catch-up and skip jobs) hold the same invariant there,
and the soak runs this scenario for two minutes (``python -m tests.chaos.soak``)."""

from __future__ import annotations

import pytest

from tests.chaos.scenarios import Base, three_beats


@pytest.mark.scale
def test_three_beats_make_exactly_one_run_per_slot(chaos: Base) -> None:
    result = three_beats(chaos, seconds=10, beats=3, workers=2)
    print(result.summary())
    result.assert_ok()
    assert result.runs >= 10
