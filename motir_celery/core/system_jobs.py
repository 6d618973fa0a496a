"""Jobs the engine defines for itself, registered whenever an app hosts the engine.

``system.daily-health-check`` proves the scheduled path end to end every day:
beat computes the slot, the run row is inserted once, a worker claims it and
the ledger (``job_run``) records ``scheduled.system.daily-health-check``. It
does nothing else, so a missing or failed run of it points at the pipeline
(beat down, workers down, database unreachable), never at its own logic.

Every app that hosts the engine has it (README, "The engine's own job"); an app whose
configuration says ``motir_health_check = False`` keeps it registered but its beat never
fires it (adapter/beat.py).
"""

from __future__ import annotations

from typing import Any

from motir_celery.core.jobs import define_job

__all__ = ["HEALTH_CHECK", "daily_health_check"]

HEALTH_CHECK = "system.daily-health-check"


@define_job(HEALTH_CHECK, cron="0 9 * * *", retry_policy="transient")
def daily_health_check(event: Any, step: Any) -> dict[str, Any]:
    # Echo the slot: the run's result then shows the synthetic event arrived whole.
    return {"ok": True, "scheduled_for": event.data.get("scheduled_for")}
