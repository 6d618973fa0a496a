"""The fleet's registry of jobs: what a worker writes at start-up, what the checked functions check.

The app role writes only through the checked functions of migrations 0008 and 0020, which
refuse a run of a job id that names no job of the right kind in ``job_registry``: a direct
run of a direct job, an event's runs of event jobs subscribing to it (a cron job's runs are
the beat's, written by the engine role). Every worker writes the jobs it defines there as it
starts (``register``, from its engine thread: again next tick until the database answers), so
the registry is the union of the fleet's jobs. Until some worker has written it the registry
is empty and the functions check no job id (a rolling deploy: migration 0020's docstring).
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import psycopg.errors

from motir_celery.core.jobs import Job, all_jobs
from motir_celery.store.sql import maintenance as maintenance_sql

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine

__all__ = ["kind_of", "register"]

log = logging.getLogger("motir_celery.registry")


def kind_of(job: Job) -> str:
    """How a run of ``job`` is made: ``direct``, ``event`` or ``cron`` (the registry's ``kind``)."""
    if job.direct:
        return "direct"
    return "cron" if job.cron is not None else "event"


def register(engine: Engine, worker: str) -> int:
    """Write every job this process defines into the registry, as ``worker``; how many (0: the
    schema has no registry yet — code before its migration — said once, not tried again)."""
    jobs = [{"job_id": job.id, "kind": kind_of(job), "events": list(job.events)} for job in all_jobs()]
    try:
        with engine.side_pool().begin() as conn:
            return maintenance_sql.register_jobs(conn, json.dumps(jobs), worker)
    except psycopg.errors.UndefinedTable:
        log.warning("no job_registry table: migration 0020 is not applied (run `motir migrate`); "
                    "until it is, the app role's checked functions check no job id")
        return 0
