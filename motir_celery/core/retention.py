"""Retention: delete what is finished and old, in bounded batches.

``purge_batches(begin, older_than)`` removes, in this order, each kind in batches of
``batch_size`` rows with one transaction per batch (locks stay short, and an
interrupted purge has deleted whole batches only — run it again to go on):

1. **Finished runs** (succeeded, failed, cancelled) whose ``finished_at`` is
   older than the cutoff. Their steps and attempts go with them (``job_step``
   and ``job_run`` cascade from ``job_queue``), their progress and their streams'
   items too (``job_progress``, ``job_stream_item``: migration 0019), and so does, in the same
   statement, each of their events that no other run needs (found by the runs'
   own ``event_id``: a primary-key probe per event, where a scan of the events
   by age has no index to use). A run whose DLQ entry is still
   open is **kept**, with its attempts and errors: they are what the operator
   deciding about the entry needs to read. Queued and running runs are never
   touched, however old. The same statement first adds the runs it deletes to the stats
   rollup (``job_stats_rollup``) unless the sweep's fold counted them already: the counts
   outlive the rows, each run counted once (core/worker/rollup.py).
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

Runs as the engine role: retention is a system task across every workspace. ``begin``
opens one transaction on an engine-role connection: ``motir purge`` hands it a SQLAlchemy
engine's (ops/purge.py), the engine's own daily ``system.daily-retention`` its pool's
(core/system_jobs.py). The statements are ``store/sql/maintenance.py``'s (``PURGE_*``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, ContextManager

from motir_celery.store.driver import integrity_errors
from motir_celery.store.sql import maintenance

if TYPE_CHECKING:
    from motir_celery.store.driver import Conn

__all__ = ["PurgeReport", "purge_batches", "check_purge", "retention_period", "FINISHED_STATES",
           "DEFAULT_RETENTION", "MAX_RETENTION", "RETENTION_KEY"]

FINISHED_STATES = ("succeeded", "failed", "cancelled")

#: What ``system.daily-retention`` keeps when the app says nothing: 30 days of finished runs
#: (docs/operations.md, "Retention").
DEFAULT_RETENTION = timedelta(days=30)
#: The longest period (ops/timefmt.py's bound): more would overflow ``now() - interval`` in Postgres.
MAX_RETENTION = timedelta(days=36_525)
#: The app configuration key (Django: ``CELERY_MOTIR_RETENTION``) of the daily retention:
#: ``False`` turns it off; a number of days or a ``timedelta`` is the period kept.
RETENTION_KEY = "motir_retention"

#: progress(kind, deleted_so_far) after each batch; kind is runs | dlq | events.
Progress = Callable[[str, int], None]
#: One transaction on an engine-role connection, committed on a clean exit.
Begin = Callable[[], ContextManager["Conn"]]


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
    #: Runs deleted that the sweep had not folded into the stats rollup yet: folded by the delete.
    folded: int = 0
    notes: list[str] = field(default_factory=list)


#: A batch that lost a race with a concurrent writer is retried this many times.
_RACE_RETRIES = 5


def check_purge(older_than: timedelta, batch_size: int, dry_run: bool) -> float:
    """The period in seconds, or ValueError/TypeError for one a purge refuses."""
    if not isinstance(older_than, timedelta):
        raise TypeError(f"older_than must be a timedelta, got {type(older_than).__name__}")
    age = older_than.total_seconds()
    if age < 0 or (age == 0 and not dry_run):
        # Zero counts everything finished (a dry run); deleting it would also take runs
        # that finished a moment ago, whose results a caller may still be reading.
        raise ValueError("older_than must be positive (zero only for a dry run)")
    if older_than > MAX_RETENTION:
        raise ValueError("older_than must be at most 100 years")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= 100_000:
        raise ValueError(f"batch_size must be a whole number from 1 to 100000, got {batch_size!r}")
    return age


def retention_period(value: object) -> timedelta | None:
    """The period ``motir_retention = value`` keeps: None (off) for ``False`` (or 0), the default
    for ``True`` or ``None``, ``value`` days for a positive number, ``value`` for a ``timedelta``.
    Anything else, or a period a purge refuses, is a ValueError naming the key."""
    if value is None or value is True:
        return DEFAULT_RETENTION
    if value is False or (isinstance(value, (int, float)) and value == 0):
        return None
    if isinstance(value, timedelta):
        period = value
    elif isinstance(value, (int, float)):
        try:
            period = timedelta(days=value)
        except (OverflowError, ValueError):
            raise ValueError(f"{RETENTION_KEY} must be at most 36525 days, got {value!r}") from None
    else:
        raise ValueError(f"{RETENTION_KEY} must be False, a number of days or a timedelta, got {value!r}")
    if not timedelta(0) < period <= MAX_RETENTION:
        raise ValueError(f"{RETENTION_KEY} must be a period from 1 second to 36525 days, got {value!r}")
    return period


def purge_batches(
    begin: Begin,
    older_than: timedelta,
    *,
    batch_size: int = 1000,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> PurgeReport:
    """Delete finished runs, closed DLQ entries and unneeded events older than ``older_than``,
    one transaction of ``begin()`` per batch of ``batch_size`` rows (the module docstring)."""
    age = check_purge(older_than, batch_size, dry_run)
    report = PurgeReport(older_than_seconds=age, dry_run=dry_run)

    if dry_run:
        with begin() as conn:
            counts = maintenance.purge_counts(conn, age=age)
            report.kept_for_open_dlq = maintenance.purge_kept(conn, age=age)
        report.runs, report.steps, report.attempts = counts["runs"], counts["steps"], counts["attempts"]
        report.dlq_entries, report.events = counts["dlq_entries"], counts["events"]
        return report

    refused = integrity_errors()

    def batches(kind: str, step: Callable[[Conn], int], done: int = 0) -> None:
        races = 0
        while True:
            try:
                with begin() as conn:
                    n = step(conn)
            except refused:
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

    def runs(conn: Conn) -> int:
        row = maintenance.purge_runs(conn, age=age, batch=batch_size)
        report.runs += row["runs"]
        report.steps += row["steps"]
        report.attempts += row["attempts"]
        report.events += row["events"]
        report.folded += row["folded"]
        return row["runs"]

    def dlq(conn: Conn) -> int:
        n = maintenance.purge_dlq(conn, age=age, batch=batch_size)
        report.dlq_entries += n
        return n

    def events(conn: Conn) -> int:
        n = maintenance.purge_events(conn, age=age, batch=batch_size)
        report.events += n
        return n

    batches("runs", runs)
    batches("dlq", dlq)
    # Its progress counts every event deleted, with the runs and by this pass.
    batches("events", events, done=report.events)
    with begin() as conn:
        report.kept_for_open_dlq = maintenance.purge_kept(conn, age=age)
    return report
