"""Jobs the engine defines for itself, registered whenever an app hosts the engine.

``system.daily-health-check`` proves the scheduled path end to end every day:
beat computes the slot, the run row is inserted once, a worker claims it and
the ledger (``job_run``) records ``scheduled.system.daily-health-check``. It
does nothing else, so a missing or failed run of it points at the pipeline
(beat down, workers down, database unreachable), never at its own logic.

``system.daily-retention`` is ``motir purge`` on a schedule: every day at 03:30 UTC it deletes
what finished more than the app's retention period ago (``motir_retention``: 30 days unless the
app says otherwise), through the same code and statements (core/retention.py: bounded batches,
one transaction each). Beat makes one run per slot however many beats fire it, and
``overlap="skip"`` skips a slot while the day before's run is still going.

Every app that hosts the engine has both (README, "The engine's own job"); an app whose
configuration says ``motir_health_check = False`` (or ``motir_retention = False``) keeps the job
registered but its beat never fires it (adapter/beat.py).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from motir_celery.core.jobs import define_job
from motir_celery.core.retention import RETENTION_KEY, purge_batches, retention_period

__all__ = ["HEALTH_CHECK", "RETENTION", "AppSettings", "daily_health_check", "daily_retention"]

HEALTH_CHECK = "system.daily-health-check"
RETENTION = "system.daily-retention"


@runtime_checkable
class AppSettings(Protocol):
    """A host that reads its app's configuration keys (adapter/messages.py's ``CeleryHost``)."""

    def app_setting(self, key: str, default: object = None) -> object: ...


@define_job(HEALTH_CHECK, cron="0 9 * * *", retry_policy="transient")
def daily_health_check(event: Any, step: Any) -> dict[str, Any]:
    # Echo the slot: the run's result then shows the synthetic event arrived whole.
    return {"ok": True, "scheduled_for": event.data.get("scheduled_for")}


@define_job(RETENTION, cron="30 3 * * *", retry_policy="transient", overlap="skip")
def daily_retention(event: Any, step: Any) -> dict[str, Any]:
    host = step.engine.host
    # A host without an app (the test kit's) keeps the default period.
    period = retention_period(host.app_setting(RETENTION_KEY) if isinstance(host, AppSettings) else None)
    slot = event.data.get("scheduled_for")
    if period is None:  # run by hand (enqueue_scheduled) in an app that turned it off
        return {"ok": True, "scheduled_for": slot, "skipped": f"{RETENTION_KEY} is off"}
    report = purge_batches(step.engine.pool().begin, period)
    return {"ok": not report.notes, "scheduled_for": slot, "older_than_seconds": report.older_than_seconds,
            "runs": report.runs, "dlq_entries": report.dlq_entries, "events": report.events,
            "kept_for_open_dlq": report.kept_for_open_dlq, "batches": report.batches, "notes": report.notes}
