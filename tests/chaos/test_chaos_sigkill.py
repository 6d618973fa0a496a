"""Scenario 1, shortened: SIGKILL a random worker every ~2 s during a 100-run workload,
and freeze one (SIGSTOP past its lease, then SIGCONT) now and then."""

from __future__ import annotations

from tests.chaos.scenarios import Base, sigkill


def test_sigkill_random_workers_loses_no_run_and_repeats_no_stored_step(chaos: Base) -> None:
    result = sigkill(chaos, runs=100, workers=3, rate=20, kill_every=(1.5, 2.5), fault_window=10,
                     freeze_every=(2.0, 3.0))
    print(result.summary())
    result.assert_ok()
    assert result.runs == 100 and result.succeeded == 100
    assert "SIGKILL" in result.faults and not result.faults.startswith("0 ")
