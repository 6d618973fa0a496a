"""``motir purge``: retention by hand, as the engine role over a SQLAlchemy engine.

What it deletes, in which order and batches, and what it keeps: core/retention.py, whose
``purge_batches`` the engine's own daily ``system.daily-retention`` runs too
(core/system_jobs.py; docs/operations.md, "Retention").
"""

from __future__ import annotations

from datetime import timedelta

from motir_celery.core.retention import FINISHED_STATES, Progress, PurgeReport, check_purge, purge_batches
from motir_celery.settings import Settings
from motir_celery.store.db import get_engine

__all__ = ["PurgeReport", "purge", "FINISHED_STATES"]


def purge(
    older_than: timedelta,
    *,
    batch_size: int = 1000,
    dry_run: bool = False,
    progress: Progress | None = None,
    settings: Settings | None = None,
) -> PurgeReport:
    """Delete finished runs, closed DLQ entries and unneeded events older than ``older_than``."""
    check_purge(older_than, batch_size, dry_run)  # before any connection is made
    engine = get_engine(settings or Settings.from_env())
    return purge_batches(engine.begin, older_than, batch_size=batch_size, dry_run=dry_run, progress=progress)
