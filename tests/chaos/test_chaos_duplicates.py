"""Scenario 5, shortened: every message published 3x, Redis visibility timeout 2 s
(messages held longer are redelivered while their run is still running), one SIGKILL."""

from __future__ import annotations

from tests.chaos.scenarios import Base, duplicates


def test_triple_publishes_and_redeliveries_execute_each_run_once(chaos: Base) -> None:
    result = duplicates(chaos, runs=50, long_every=8, workers=2, rate=20)
    print(result.summary())
    result.assert_ok()
    assert result.runs == 50 and result.succeeded == 50
