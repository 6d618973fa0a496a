"""Retention: delete what is finished and old, in bounded batches.

``purge(older_than)`` removes, in this order, each kind in batches of
``batch_size`` rows with one transaction per batch (locks stay short, and an
interrupted purge has deleted whole batches only — run it again to go on):

1. **Finished runs** (succeeded, failed, cancelled) whose ``finished_at`` is
   older than the cutoff. Their steps and attempts go with them (``job_step``
   and ``job_run`` cascade from ``job_queue``), and so does, in the same
   statement, each of their events that no other run needs (found by the runs'
   own ``event_id``: a primary-key probe per event, where a scan of the events
   by age has no index to use). A run whose DLQ entry is still
   open is **kept**, with its attempts and errors: they are what the operator
   deciding about the entry needs to read. Queued and running runs are never
   touched, however old.
2. **Closed DLQ entries** — replayed or dismissed before the cutoff. An open
   entry (neither replayed nor dismissed) is never deleted, whatever its age.
3. **Events no run needs** that step 1 did not take — received before the
   cutoff with no run left that points at them (events no job subscribed to,
   events whose runs an earlier purge took). This pass reads the whole event
   table (``received_at`` has no index) once per batch, so it should find
   little: step 1 took the rest. ``job_queue.event_id`` is ``ON DELETE
   RESTRICT``, so the database refuses to delete an event a run still needs
   even if this module were wrong; a batch that hits that race (a run created
   for an old event between our check and our delete, in step 1 or here) is
   rolled back and tried again.

Consequences to know (docs/operations.md, "Retention"): an event's idempotency
key is only remembered while the event is kept, so the retention period is
also the deduplication window; and a purged cron run's slot is forgotten,
which is harmless because beat only enqueues current slots.

Runs as the engine role (``engine_connection``): retention is a system task
across every workspace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

from sqlalchemy import Connection, text
from sqlalchemy.exc import IntegrityError

from motir_celery.ops.timefmt import MAX_DURATION
from motir_celery.settings import Settings, get_settings
from motir_celery.store.db import get_engine

__all__ = ["PurgeReport", "purge", "FINISHED_STATES"]

FINISHED_STATES = ("succeeded", "failed", "cancelled")

#: progress(kind, deleted_so_far) after each batch; kind is runs | dlq | events.
Progress = Callable[[str, int], None]


@dataclass
class PurgeReport:
    older_than_seconds: float
    dry_run: bool = False
    runs: int = 0
    steps: int = 0
    attempts: int = 0
    dlq_entries: int = 0
    events: int = 0
    batches: int = 0
    #: Finished runs past the cutoff kept because their DLQ entry is still open.
    kept_for_open_dlq: int = 0
    notes: list[str] = field(default_factory=list)


# A run is purgeable when it is finished, finished before the cutoff, and has no
# open DLQ entry. Shared by the delete and by --dry-run's count.
_PURGEABLE_RUN = """
    q.state IN ('succeeded', 'failed', 'cancelled')
    AND q.finished_at < now() - make_interval(secs => :age)
    AND NOT EXISTS (SELECT 1 FROM job_run_dlq d
                    WHERE d.run_id = q.id AND d.replayed_at IS NULL AND d.dismissed_at IS NULL)
"""

_DELETE_RUNS = text(
    f"""
    WITH doomed AS (
      SELECT q.id, q.event_id FROM job_queue q
      WHERE {_PURGEABLE_RUN}
      ORDER BY q.finished_at
      LIMIT :batch
      FOR UPDATE SKIP LOCKED          -- a second purge (or a cancel in flight) takes other rows
    ), steps AS (
      SELECT count(*) AS n FROM job_step WHERE run_id IN (SELECT id FROM doomed)
    ), attempts AS (
      SELECT count(*) AS n FROM job_run WHERE run_id IN (SELECT id FROM doomed)
    ), deleted AS (
      -- job_step and job_run cascade; job_run_dlq.run_id / replay_run_id become NULL
      -- (a closed entry stays readable: it copies the job, event and failure).
      DELETE FROM job_queue WHERE id IN (SELECT id FROM doomed) RETURNING 1
    ), freed AS (
      -- The events of these runs that no other run needs. Every part of this statement
      -- reads the snapshot taken before the delete above, so the doomed runs are still
      -- visible here: "no other run" excludes them by id.
      SELECT e.id FROM job_event e
      WHERE e.id IN (SELECT event_id FROM doomed)            -- pk_job_event, one probe each
        AND e.received_at < now() - make_interval(secs => :age)
        AND NOT EXISTS (SELECT 1 FROM job_queue q             -- uq (event_id, job_id), event_id leading
                        WHERE q.event_id = e.id AND q.id NOT IN (SELECT id FROM doomed))
      -- A fan-out inserting a run for this event holds a KEY SHARE lock on it: skip it (the
      -- sweep of step 3 takes it later). One that commits after our snapshot makes
      -- ON DELETE RESTRICT, checked at the end of this statement, refuse the whole batch.
      FOR UPDATE SKIP LOCKED
    ), events AS (
      DELETE FROM job_event WHERE id IN (SELECT id FROM freed) RETURNING 1
    )
    -- The counts read the snapshot taken before the delete: what went with the runs.
    SELECT (SELECT count(*) FROM deleted) AS runs, (SELECT n FROM steps) AS steps,
           (SELECT n FROM attempts) AS attempts, (SELECT count(*) FROM events) AS events
    """
)

_CLOSED_DLQ = """
    -- coalesce(NULL, NULL) is NULL and never < anything: an open entry cannot match.
    coalesce(d.replayed_at, d.dismissed_at) < now() - make_interval(secs => :age)
"""

_DELETE_DLQ = text(
    f"""
    DELETE FROM job_run_dlq WHERE id IN (
      SELECT d.id FROM job_run_dlq d WHERE {_CLOSED_DLQ}
      LIMIT :batch FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
    """
)

_UNNEEDED_EVENT = """
    e.received_at < now() - make_interval(secs => :age)
    -- served by the unique (event_id, job_id) index, event_id leading
    AND NOT EXISTS (SELECT 1 FROM job_queue q WHERE q.event_id = e.id)
"""

_DELETE_EVENTS = text(
    f"""
    DELETE FROM job_event WHERE id IN (
      SELECT e.id FROM job_event e WHERE {_UNNEEDED_EVENT}
      ORDER BY e.received_at
      LIMIT :batch
      -- An event a fan-out is inserting a run for holds a KEY SHARE lock: skip it.
      FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
    """
)

_COUNT = text(
    f"""
    SELECT
      (SELECT count(*) FROM job_queue q WHERE {_PURGEABLE_RUN}) AS runs,
      (SELECT count(*) FROM job_step s JOIN job_queue q ON q.id = s.run_id WHERE {_PURGEABLE_RUN}) AS steps,
      (SELECT count(*) FROM job_run r JOIN job_queue q ON q.id = r.run_id WHERE {_PURGEABLE_RUN}) AS attempts,
      (SELECT count(*) FROM job_run_dlq d WHERE {_CLOSED_DLQ}) AS dlq_entries,
      -- events whose every run would be purged too
      (SELECT count(*) FROM job_event e
        WHERE e.received_at < now() - make_interval(secs => :age)
          AND NOT EXISTS (SELECT 1 FROM job_queue q WHERE q.event_id = e.id AND NOT ({_PURGEABLE_RUN})))
        AS events
    """
)

_KEPT = text(
    """
    SELECT count(*) FROM job_queue q
    WHERE q.state = 'failed' AND q.finished_at < now() - make_interval(secs => :age)
      AND EXISTS (SELECT 1 FROM job_run_dlq d
                  WHERE d.run_id = q.id AND d.replayed_at IS NULL AND d.dismissed_at IS NULL)
    """
)

#: A batch that lost a race with a concurrent writer is retried this many times.
_RACE_RETRIES = 5


def purge(
    older_than: timedelta,
    *,
    batch_size: int = 1000,
    dry_run: bool = False,
    progress: Progress | None = None,
    settings: Settings | None = None,
) -> PurgeReport:
    """Delete finished runs, closed DLQ entries and unneeded events older than ``older_than``."""
    if not isinstance(older_than, timedelta):
        raise TypeError(f"older_than must be a timedelta, got {type(older_than).__name__}")
    age = older_than.total_seconds()
    if age < 0 or (age == 0 and not dry_run):
        # Zero counts everything finished (a dry run); deleting it would also take runs
        # that finished a moment ago, whose results a caller may still be reading.
        raise ValueError("older_than must be positive (zero only for a dry run)")
    if older_than > MAX_DURATION:  # timefmt's bound: more would overflow now() - interval in Postgres
        raise ValueError("older_than must be at most 100 years")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= 100_000:
        raise ValueError(f"batch_size must be a whole number from 1 to 100000, got {batch_size!r}")
    engine = get_engine(settings=settings or get_settings())
    report = PurgeReport(older_than_seconds=age, dry_run=dry_run)
    params = {"age": age, "batch": batch_size}

    if dry_run:
        with engine.begin() as conn:
            counts = conn.execute(_COUNT, params).one()
            report.kept_for_open_dlq = conn.execute(_KEPT, params).scalar_one()
        report.runs, report.steps, report.attempts = counts.runs, counts.steps, counts.attempts
        report.dlq_entries, report.events = counts.dlq_entries, counts.events
        return report

    def batches(kind: str, step: Callable[[Connection], int], done: int = 0) -> None:
        races = 0
        while True:
            try:
                with engine.begin() as conn:
                    n = step(conn)
            except IntegrityError:
                # Only the events' RESTRICT can fire here (in the runs' batches too,
                # which delete their freed events): a run was created for an old event
                # after our NOT EXISTS. Nothing was deleted; look again.
                races += 1
                if races > _RACE_RETRIES:
                    report.notes.append(f"{kind}: stopped after {races} conflicting batches; run purge again")
                    return
                continue
            report.batches += 1
            done += n
            if progress is not None:
                progress(kind, done)
            if n < batch_size:
                return

    def runs(conn: Connection) -> int:
        row = conn.execute(_DELETE_RUNS, params).one()
        report.runs += row.runs
        report.steps += row.steps
        report.attempts += row.attempts
        report.events += row.events
        return int(row.runs)

    def dlq(conn: Connection) -> int:
        n = len(conn.execute(_DELETE_DLQ, params).all())
        report.dlq_entries += n
        return n

    def events(conn: Connection) -> int:
        n = len(conn.execute(_DELETE_EVENTS, params).all())
        report.events += n
        return n

    batches("runs", runs)
    batches("dlq", dlq)
    # Its progress counts every event deleted, with the runs and by this pass.
    batches("events", events, done=report.events)
    with engine.begin() as conn:
        report.kept_for_open_dlq = conn.execute(_KEPT, params).scalar_one()
    return report
