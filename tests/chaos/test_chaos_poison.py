"""Scenario 7, shortened: runs that SIGKILL their pool process on every attempt land
in the DLQ after their attempts; the healthy runs beside them all succeed."""

from __future__ import annotations

from tests.chaos.scenarios import Base, poison


def test_poison_runs_reach_the_dlq_and_spare_the_others(chaos: Base) -> None:
    result = poison(chaos, poisons=2, runs=30, workers=2, rate=20)
    print(result.summary())
    result.assert_ok()
    assert result.dead_lettered == 2 and result.succeeded == 30
