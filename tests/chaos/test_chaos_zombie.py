"""Regression of what scenario 1 with frozen workers found: a worker SIGSTOPped between
two steps past its lease was reclaimed, another worker stored the next step, and the
thawed worker started that step's body again (its store was refused — too late).

The full scenario finds it by chance (a freeze must land between two steps); this
test puts the worker there on purpose, in-process: after step ``a`` the run is taken
over (the claim token changes) and the handler pauses longer than a heartbeat period.
Step ``b``'s body must not start.
"""

from __future__ import annotations

import os

from sqlalchemy import text

import tests.chaos.jobs  # noqa: F401
from motir_celery.settings import Settings
from tests.fixtures.engines import holding


def test_a_worker_that_lost_its_run_while_frozen_starts_no_further_step_body(engine) -> None:  # type: ignore[no-untyped-def]
    settings = Settings.from_env({**os.environ, "MOTIR_LEASE_SECONDS": "1.5"})
    zombie = holding(settings=settings)  # this process's engine, its messages held
    (run_id,) = zombie.send_event("chaos.zombie", {"frozen": 1.0}).run_ids
    outcome = zombie.execute(run_id, job_id="chaos.zombie", worker="zombie/1")
    assert outcome.state == "lost", outcome
    with engine.connect() as conn:
        executed = dict(conn.execute(text(
            "SELECT step, count(*) FROM test.side_effect WHERE run_id = :r GROUP BY step"), {"r": str(run_id)}).all())
    assert executed == {"a": 1}  # b never started: the check before its body found the run lost
