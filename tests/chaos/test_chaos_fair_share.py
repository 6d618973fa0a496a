"""Scenario 12, shortened: admission on across three workspaces (weights 3 : 1, one capped at 2),
every message published twice and a random worker SIGKILLed every ~2 s during a 160-run workload:
nothing lost, nothing run twice, no run left held, the cap never exceeded."""

from __future__ import annotations

from tests.chaos.scenarios import Base, fair_share


def test_admission_across_three_workspaces_under_sigkill_and_duplicates_loses_nothing(chaos: Base) -> None:
    result = fair_share(chaos, runs=160, workers=3, rate=40, kill_every=(1.5, 2.5), fault_window=12, limit=6)
    print(result.summary())
    result.assert_ok()
    assert result.runs == 160 and result.succeeded == 160
    assert "SIGKILL" in result.faults and not result.faults.startswith("0 ")
