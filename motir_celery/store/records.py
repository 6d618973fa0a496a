"""The values the catalogued statements take and give back: a run to create, a created run, a claim.

Plain frozen dataclasses, so the engine's rooms and the adapter pass them around
without knowing any SQL (store/sql/ has the statements that make and read them).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

__all__ = ["RunSpec", "Queued", "AlreadyQueued", "OverlapSkipped", "Gathered", "Claim", "Admitted", "Chosen", "Quota",
           "DURATION_BOUNDS_MS"]

#: The upper bounds (milliseconds) of the stats rollup's duration histogram (job_stats_rollup.
#: duration_buckets holds one count per bound, then one for everything longer). Fixed: the counts
#: stored are read against these, so changing them needs a migration that re-buckets the rows.
DURATION_BOUNDS_MS: tuple[float, ...] = (1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000,
                                         60_000, 120_000, 300_000, 600_000, 1_800_000, 3_600_000)


@dataclass(frozen=True)
class RunSpec:
    """One row of a fan-out: the job and the values computed for its run."""

    job_id: str
    max_attempts: int
    policy: str
    priority: int = 0
    singleton_key: str | None = None
    concurrency_key: str | None = None
    cancel_key: str | None = None


@dataclass(frozen=True)
class Queued:
    """A new run was created; publish ``run_id`` after the transaction commits."""

    run_id: uuid.UUID
    job_id: str


@dataclass(frozen=True)
class AlreadyQueued:
    """The run already exists (same event and job, or same cron slot); nothing written."""

    job_id: str


@dataclass(frozen=True)
class OverlapSkipped(AlreadyQueued):
    """An ``overlap="skip"`` job's slot was not run: another run of the job was queued
    or running. The skip is recorded as a ``cancelled`` row for the slot (``run_id``),
    so every beat, now or later, gets the same answer for it."""

    run_id: uuid.UUID
    blocking_run_id: uuid.UUID | None


@dataclass(frozen=True)
class Gathered(AlreadyQueued):
    """debounce= / batch=: the event joined the open run of its key (``run_id``) instead of
    making one; that run carries it (debounce: as its latest event; batch: in its list)."""

    run_id: uuid.UUID


@dataclass(frozen=True)
class Claim:
    """A run this worker holds: what the claim statement returned, its fence token included."""

    run_id: uuid.UUID
    job_id: str
    token: uuid.UUID
    attempt: int
    max_attempts: int
    workspace_id: str | None
    event_id: uuid.UUID | None
    event_name: str
    event_data: Any
    scheduled_for: datetime | None
    steps: dict[str, Any]
    #: The database's now() at claim time: step.sleep and waits compare with it.
    db_now: datetime | None = None
    concurrency_key: str | None = None
    traceparent: str | None = None


# --- admission (core/admission.py) ------------------------------------------------------------


@dataclass(frozen=True)
class Admitted:
    """The gate's decision on one run about to be published: ``admitted`` (publish it now) or held;
    ``room``: free slots the fleet's limit had left when it decided."""

    run_id: uuid.UUID
    job_id: str
    admitted: bool
    room: int


@dataclass(frozen=True)
class Chosen:
    """The run the dispatcher chose and marked sent: publish it after commit."""

    run_id: uuid.UUID
    job_id: str
    workspace_id: str | None
    priority: int


@dataclass(frozen=True)
class Quota:
    """One workspace's weight and cap (job_quota), as an operator wrote them."""

    workspace_id: str | None
    weight: int
    max_running: int | None
    updated_at: datetime
    updated_by: str | None
