"""Scenario 9, shortened: garbage at every entry point (non-JSON and oversized payloads,
bad event names and workspace ids, SQL metacharacters in every string field, raw
broker messages that are not tasks, unknown job ids, forged and malformed run ids)
while healthy runs go on. Each gets a clear error or a logged drop; nothing else moves.

Regression kept here: a malformed run id used to be echoed whole into the worker's
log (a 2 MB argument became a 2 MB log line).
"""

from __future__ import annotations

from tests.chaos.scenarios import Base, bad_input


def test_bad_input_is_refused_or_dropped_and_disturbs_nothing(chaos: Base) -> None:
    result = bad_input(chaos, runs=20, workers=1, rate=20)
    print(result.summary())
    result.assert_ok()
