"""Cron jobs on ``celery beat``: one run per slot, however many beats tick it.

Two pieces:

* ``enqueue_slot(engine, job_id, scheduled_for)`` — create the run of one
  cron slot: one transaction around ``producer_sql.enqueue_scheduled`` (``INSERT … ON
  CONFLICT (job_id, scheduled_for) DO NOTHING``), then publish **after the
  commit** and only for ``Queued``. Behind ``motir_celery.enqueue_scheduled``.
* ``MotirScheduler`` — a ``celery.beat.PersistentScheduler`` whose ``tick()``
  also fires every cron job of the registry. ``attach()`` makes it the app's
  ``beat_scheduler`` unless the user chose one; the user's own
  ``beat_schedule`` entries run exactly as before, and ``MotirCronMixin`` puts
  the same behaviour on any other scheduler class.

A ``beat_schedule`` entry of the user's whose task is a durable direct job (its
Celery name, or ``motir.<job_id>``) is sent as Celery sends it, with one change: its
Celery task id is derived from (entry, task, tick) — the crontab's slot, or the
interval's multiple of the epoch, ``beat_tick_id`` — so the workers that adopt the
messages of two beats for one tick make one run of them (the id is the run's key).

Why any number of beats is safe: a slot is a pure function of (expression,
zone, the database's ``now()``) — ``schedule.latest_slot`` — so every beat
binds the same ``scheduled_for`` for the same slot, and the unique constraint
admits the first INSERT and answers ``AlreadyQueued`` to the rest. A beat's
own memory (``_fired`` below) only saves it redundant INSERTs; it never decides
what a slot is or whether it runs. One beat is still the recommended deployment
(docs/jobs.md, "Scheduled jobs").

The engine's own cron jobs, ``system.daily-health-check`` and ``system.daily-retention``
(core/system_jobs.py), are fired with the app's; an app whose configuration says
``motir_health_check = False`` (Django: ``CELERY_MOTIR_HEALTH_CHECK = False``) does not fire the
first, ``motir_retention = False`` (``CELERY_MOTIR_RETENTION``) the second.
"""

from __future__ import annotations

import copy
import logging
import math
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

from celery.beat import PersistentScheduler, ScheduleEntry
from celery.schedules import crontab, schedule

from motir_celery.adapter.messages import engine_of
from motir_celery.core.engine import Engine
from motir_celery.core.jobs import Job, all_jobs, get_job, job_for_task
from motir_celery.core.retention import RETENTION_KEY, retention_period
from motir_celery.core.schedule import ScheduleOptions, is_slot, latest_slot, newest_slots, next_slot, schedule_options
from motir_celery.core.system_jobs import HEALTH_CHECK, RETENTION
from motir_celery.errors import JobDefinitionError
from motir_celery.store.records import AlreadyQueued, OverlapSkipped, Queued
from motir_celery.store.sql import producer as producer_sql

__all__ = ["enqueue_slot", "OverlapSkipped", "MotirCronMixin", "MotirScheduler", "SCHEDULER", "beat_tick_id",
           "FIRE_HEALTH_CHECK", "FIRE_RETENTION"]

log = logging.getLogger("motir_celery.adapter.beat")

#: The value ``attach()`` puts in ``beat_scheduler``.
SCHEDULER = "motir_celery.beat:MotirScheduler"
#: The app configuration key (Django: ``CELERY_MOTIR_HEALTH_CHECK``) that, ``False``, keeps the beat
#: from firing the engine's own ``system.daily-health-check``.
FIRE_HEALTH_CHECK = "motir_health_check"
#: The key (Django: ``CELERY_MOTIR_RETENTION``) that, ``False``, keeps the beat from firing the
#: engine's own ``system.daily-retention``; a number of days or a timedelta is its period.
FIRE_RETENTION = RETENTION_KEY

#: Most slots one job may enqueue in one pass (a catch-up window over a dense
#: schedule); the newest are kept.
MAX_SLOTS_PER_PASS = 1000


# --- enqueue ------------------------------------------------------------------------


def enqueue_slot(engine: Engine, job_id: str, scheduled_for: datetime | str) -> Queued | AlreadyQueued:
    """Create the run of cron job ``job_id`` for slot ``scheduled_for``, once.

    ``scheduled_for`` must be one of the job's slots (``schedule.latest_slot``
    gives the current one): an arbitrary instant would be a new identity on
    every call and defeat the per-slot dedup. Returns ``Queued`` (published
    after commit), ``AlreadyQueued``, or ``OverlapSkipped`` (an
    ``AlreadyQueued``) for ``overlap="skip"`` jobs. A publish failure
    propagates; the run is committed and the sweeper publishes it later.
    """
    job = get_job(job_id)
    if job.cron is None:
        raise JobDefinitionError(f"job {job_id!r} has no cron schedule; send it an event instead")
    slot = _instant(scheduled_for)
    if not is_slot(job.cron, job.timezone, slot):
        raise ValueError(
            f"{slot.isoformat()} is not a slot of job {job_id!r} (cron {job.cron!r}, {job.timezone}); "
            f"the latest slot at that instant is {latest_slot(job.cron, job.timezone, slot)}"
        )
    return _enqueue(engine, job, schedule_options(job.id, job.options), slot)


def _enqueue(engine: Engine, job: Job, opts: ScheduleOptions, slot: datetime) -> Queued | AlreadyQueued:
    spec = job.spec({"scheduled_for": slot.isoformat()}, None)
    with engine.pool().begin() as conn:  # commits on exit, before the publish below
        result = producer_sql.enqueue_scheduled(
            conn, job.id, slot, max_attempts=spec.max_attempts, policy=spec.policy, priority=spec.priority,
            concurrency_key=spec.concurrency_key, skip_overlap=opts.overlap == "skip",
        )
    if isinstance(result, OverlapSkipped):
        log.info("motir: %s slot %s skipped: run %s of the job is still queued or running",
                 job.id, slot.isoformat(), result.blocking_run_id)
    if isinstance(result, Queued):
        engine.publish(result.run_id, result.job_id, 0.0)
    return result


def _retention_off(value: object) -> bool:
    """``motir_retention`` says off. A value it cannot read is not off: the run fails with the
    reason, where an operator sees it (the DLQ), rather than retention stopping in silence."""
    try:
        return retention_period(value) is None
    except ValueError:
        return False


def _instant(value: datetime | str) -> datetime:
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"scheduled_for must be a timezone-aware datetime, got {value!r}")
    return value


# --- beat_schedule entries of durable jobs --------------------------------------------

#: The namespace of the task ids of beat_schedule ticks (uuid5).
TICK_NAMESPACE = uuid.UUID("5d0f8e2a-3c1b-4e7a-9f26-6b8d2a1c0e4f")
#: Each crontab field's whole range (a field that has all of it is written ``*``).
_CRON_RANGES = (range(60), range(24), range(1, 32), range(1, 13), range(7))


def beat_tick_id(entry: ScheduleEntry, now: datetime) -> str | None:
    """The Celery task id of ``entry``'s tick due at ``now``: the same in every beat for one tick
    (a crontab's latest slot, an interval's latest multiple of the epoch); None for a schedule
    with no such slot (solar, a custom class): then each beat's message is a run of its own."""
    sched = entry.schedule
    if isinstance(sched, crontab):
        fields = (sched.minute, sched.hour, sched.day_of_month, sched.month_of_year, sched.day_of_week)
        cron = " ".join("*" if set(f) == set(full) else ",".join(str(v) for v in sorted(f))
                        for f, full in zip(fields, _CRON_RANGES))
        zone = getattr(sched.tz, "key", None) or "UTC"
        slot = latest_slot(cron, zone, now)
    elif isinstance(sched, schedule) and sched.run_every.total_seconds() >= 1:
        every = sched.run_every.total_seconds()
        slot = datetime.fromtimestamp(math.floor(now.timestamp() / every) * every, tz=timezone.utc)
    else:
        return None
    if slot is None:
        return None
    return str(uuid.uuid5(TICK_NAMESPACE, f"{entry.name}\x00{entry.task}\x00{slot.isoformat()}"))


# --- the beat scheduler -------------------------------------------------------------


class MotirCronMixin:
    """Adds the registry's cron jobs to a ``celery.beat.Scheduler``'s ``tick()``.

    ``class MyScheduler(MotirCronMixin, SomeScheduler)`` works for a scheduler
    of the user's own (django-celery-beat's, say) as well as for ours.
    """

    #: Re-read the database clock at least this often, however far the next slot.
    motir_max_sleep: float = 30.0
    #: Pause after a failed pass (database or broker unreachable).
    motir_retry_after: float = 5.0

    app: Any  # provided by celery.beat.Scheduler

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._motir_due = 0.0  # monotonic instant of the next pass
        # Per job, the newest slot this process has seen answered by the
        # database (Queued, AlreadyQueued or skipped). Only spares re-sending
        # INSERTs that would conflict; a fresh beat has none and is still right.
        self._motir_fired: dict[str, datetime] = {}
        super().__init__(*args, **kwargs)

    def apply_async(self, entry: ScheduleEntry, producer: Any = None, advance: bool = True, **kwargs: Any) -> Any:
        """Celery's, but an entry for a durable direct job is sent with the task id of its tick
        (``beat_tick_id``): two beats' messages for one tick are one run."""
        job = job_for_task(str(entry.task))
        tick = (beat_tick_id(entry, self.app.now()) if job is not None and job.direct
                and "task_id" not in (entry.options or {}) else None)
        if tick is None:
            return super().apply_async(entry, producer=producer, advance=advance, **kwargs)  # type: ignore[misc]
        if advance:
            entry = self.reserve(entry)  # type: ignore[attr-defined]  # celery.beat.Scheduler's
        sent = copy.copy(entry)  # the id is this tick's only: the entry kept in the schedule has none
        sent.options = {**(entry.options or {}), "task_id": tick}
        return super().apply_async(sent, producer=producer, advance=False, **kwargs)  # type: ignore[misc]

    def tick(self, *args: Any, **kwargs: Any) -> float:
        delay = super().tick(*args, **kwargs)  # type: ignore[misc]  # the user's entries, unchanged
        ours = self._motir_tick()
        return ours if delay is None else min(delay, ours)

    def _motir_tick(self) -> float:
        now = time.monotonic()
        if now < self._motir_due:
            return self._motir_due - now
        try:
            delay = self._motir_pass()
        except Exception:  # noqa: BLE001 — the database or broker is away: the user's entries go on
            log.warning("motir: cron pass failed; retrying in %.0fs", self.motir_retry_after, exc_info=True)
            delay = self.motir_retry_after
        self._motir_due = time.monotonic() + delay
        return delay

    def _motir_jobs(self) -> list[tuple[Job, ScheduleOptions]]:
        jobs = []
        off = set()
        if not self.app.conf.get(FIRE_HEALTH_CHECK, True):
            off.add(HEALTH_CHECK)
        if _retention_off(self.app.conf.get(FIRE_RETENTION)):
            off.add(RETENTION)
        for job in all_jobs():
            if job.cron is None or job.id in off:
                continue
            try:
                jobs.append((job, schedule_options(job.id, job.options)))
            except JobDefinitionError as exc:
                log.error("motir: not scheduling %s: %s", job.id, exc)
        return jobs

    def _motir_pass(self) -> float:
        """Enqueue every due slot; return seconds until the next slot (by the database's clock)."""
        jobs = self._motir_jobs()
        if not jobs:
            return self.motir_max_sleep
        engine = engine_of(self.app)
        with engine.pool().begin() as conn:
            db_now = producer_sql.db_now(conn)
        read_at = time.monotonic()
        for job, opts in jobs:
            for slot in self._motir_due_slots(job, opts, db_now):
                try:
                    result = _enqueue(engine, job, opts, slot)
                except Exception:  # noqa: BLE001 — one job's failure must not starve the others
                    log.warning("motir: could not enqueue %s slot %s", job.id, slot.isoformat(), exc_info=True)
                    break  # this slot and later ones are retried next pass
                self._motir_fired[job.id] = slot
                if isinstance(result, Queued):
                    log.info("motir: queued %s slot %s as run %s", job.id, slot.isoformat(), result.run_id)
                else:
                    log.debug("motir: %s slot %s already queued", job.id, slot.isoformat())
        upcoming = [s for s in (next_slot(j.cron or "", j.timezone, db_now) for j, _ in jobs) if s is not None]
        if not upcoming:
            return self.motir_max_sleep
        # A duration measured on the database's clock, slept on ours; a beat
        # that wakes early finds the slot not yet due and sleeps the remainder.
        wait = (min(upcoming) - db_now).total_seconds() - (time.monotonic() - read_at)
        return min(max(wait, 0.0) + 0.005, self.motir_max_sleep)

    def _motir_due_slots(self, job: Job, opts: ScheduleOptions, now: datetime) -> list[datetime]:
        cron = job.cron or ""
        fired = self._motir_fired.get(job.id)
        if opts.catchup > timedelta(0):
            start = now - opts.catchup
            if fired is not None and fired > start:
                start = fired
            slots = newest_slots(cron, job.timezone, start, now, MAX_SLOTS_PER_PASS + 1)
            if len(slots) > MAX_SLOTS_PER_PASS:
                log.warning("motir: %s has more than %d missed slots in its catch-up window; "
                            "enqueuing the newest %d", job.id, MAX_SLOTS_PER_PASS, MAX_SLOTS_PER_PASS)
                slots = slots[1:]
            return slots
        slot = latest_slot(cron, job.timezone, now)
        if slot is None or (fired is not None and slot <= fired):
            return []
        return [slot]

    @property
    def info(self) -> str:
        base = super().info  # type: ignore[misc]
        jobs = [f"{j.id} [{j.cron} {j.timezone}]" for j, _ in self._motir_jobs()]
        return (base + "\n" if base else "") + f"    . motir cron jobs -> {', '.join(jobs) or 'none'}"


class MotirScheduler(MotirCronMixin, PersistentScheduler):
    """``celery beat``'s default scheduler (shelve file, ``beat_schedule``) plus motir's cron jobs."""
