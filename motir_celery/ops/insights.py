"""Insights: per-job runs, failure rate, p50/p95 duration, retries and DLQ entries over a window, from the rollup.

What the dashboard's Insights page, ``motir stats`` and /metrics' counters read. The numbers
come from ``job_stats_rollup`` (core/worker/rollup.py folds finished runs into it), never
from the runs table: they outlive ``motir purge``, and a page costs the same however many
runs a job has had. Sessions are ``workspace_session``'s, so row-level security decides
which workspaces' rows are summed, as for every other read.

Percentiles come from the rollup's duration histogram (``records.DURATION_BOUNDS_MS``),
interpolated within a bucket: a p95 is exact to the width of its bucket, which is what an
on-call engineer reading "p95 went from 200 ms to 2 s" needs. Windows are whole 5-minute
buckets: "the last hour" is the buckets that began within it. Buckets are kept
``DETAIL_DAYS`` (8): a longer window reads what is there.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Sequence

from sqlalchemy.orm import Session

from motir_celery.store.records import DURATION_BOUNDS_MS
from motir_celery.store.sql import maintenance
from motir_celery.store.sql import producer as producer_sql
from motir_celery.store.sql import reads as sql

__all__ = ["WINDOWS", "JobStats", "Point", "FlakyRun", "SlowRun", "FlowWait", "RunFlow", "Insights", "percentile",
           "window_seconds", "job_stats", "insights", "totals", "run_flow", "DETAIL_DAYS", "BUCKET_SECONDS"]

#: The dashboard's windows: label → (seconds, chart step in seconds).
WINDOWS: dict[str, tuple[float, float]] = {"1h": (3600.0, 300.0), "1d": (86400.0, 3600.0),
                                           "7d": (7 * 86400.0, 6 * 3600.0)}
DETAIL_DAYS = maintenance.DETAIL_DAYS
BUCKET_SECONDS = 300.0


def percentile(histogram: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a duration histogram, in milliseconds; None when it is empty.

    Bucket i holds [bound i-1, bound i) (the first from 0, the last from the last bound on);
    the rank falls in one of them and is interpolated linearly inside it. The open-ended last
    bucket answers with its lower bound (at least that long)."""
    total = sum(histogram)
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    for i, n in enumerate(histogram):
        if n and seen + n >= rank:
            low = DURATION_BOUNDS_MS[i - 1] if i > 0 else 0.0
            if i >= len(DURATION_BOUNDS_MS):
                return float(low)
            high = DURATION_BOUNDS_MS[i]
            return float(low + (high - low) * max(rank - seen, 0.0) / n)
        seen += n
    return float(DURATION_BOUNDS_MS[-1])


@dataclass(frozen=True)
class JobStats:
    job_id: str
    succeeded: int
    failed: int
    cancelled: int
    #: Runs that needed more than one attempt.
    retried: int
    #: Attempts charged to these runs (the first ones included).
    attempts: int
    sum_ms: float
    samples: int
    histogram: tuple[int, ...]
    #: DLQ entries open now (neither replayed, dismissed nor resumed).
    dlq_open: int = 0

    @property
    def runs(self) -> int:
        return self.succeeded + self.failed + self.cancelled

    @property
    def failure_rate(self) -> float | None:
        """Failed for good, of the runs that ended succeeded or failed (cancelled ones are neither)."""
        ended = self.succeeded + self.failed
        return self.failed / ended if ended else None

    @property
    def retry_rate(self) -> float | None:
        return self.retried / self.runs if self.runs else None

    @property
    def dlq_entries(self) -> int:
        """Runs of the window that failed for good: each wrote one DLQ entry."""
        return self.failed

    @property
    def mean_ms(self) -> float | None:
        return self.sum_ms / self.samples if self.samples else None

    @property
    def p50_ms(self) -> float | None:
        return percentile(self.histogram, 0.5)

    @property
    def p95_ms(self) -> float | None:
        return percentile(self.histogram, 0.95)

    def as_json(self) -> dict[str, Any]:
        return {"job": self.job_id, "runs": self.runs, "succeeded": self.succeeded, "failed": self.failed,
                "cancelled": self.cancelled, "failure_rate": self.failure_rate, "retried": self.retried,
                "attempts": self.attempts, "dlq_entries": self.dlq_entries, "dlq_open": self.dlq_open,
                "duration_samples": self.samples, "mean_ms": self.mean_ms, "p50_ms": self.p50_ms,
                "p95_ms": self.p95_ms}


@dataclass(frozen=True)
class Point:
    at: datetime
    succeeded: int
    failed: int
    cancelled: int
    retried: int


@dataclass(frozen=True)
class FlakyRun:
    id: uuid.UUID
    job_id: str
    workspace_id: str | None
    state: str
    attempts: int
    max_attempts: int
    created_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True)
class SlowRun:
    id: uuid.UUID
    workspace_id: str | None
    attempts: int
    finished_at: datetime
    seconds: float | None


@dataclass(frozen=True)
class FlowWait:
    job_id: str
    reason: str
    runs: int
    next_at: datetime | None
    gathered: int


@dataclass(frozen=True)
class RunFlow:
    """Why a run waits on flow control (the run page), or what flow control did to it."""

    reason: str | None
    flow_key: str | None
    flow_since: datetime | None
    gathered: int | None
    throttle_key: str | None
    throttle_at: datetime | None
    run_at: datetime
    ahead: int


@dataclass
class Insights:
    """One window of the Insights page."""

    window: str
    since: datetime
    now: datetime
    step: float
    jobs: list[JobStats]
    series: dict[str, list[Point]] = field(default_factory=dict)
    flaky: list[FlakyRun] = field(default_factory=list)
    slowest: dict[str, list[SlowRun]] = field(default_factory=dict)
    waiting: list[FlowWait] = field(default_factory=list)
    #: The last fold's newest row (how fresh the numbers are), None when nothing is folded.
    updated_at: datetime | None = None

    @property
    def flakiest(self) -> list[JobStats]:
        """The jobs whose runs needed a retry most often (at least one did), worst first."""
        ranked = [j for j in self.jobs if j.retried]
        return sorted(ranked, key=lambda j: (-(j.retry_rate or 0.0), -j.retried, j.job_id))[:5]

    @property
    def totals(self) -> JobStats:
        return _sum("all jobs", self.jobs)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(m|min|h|d|w)\s*$", re.IGNORECASE)


def window_seconds(text: str) -> float:
    """``30m``, ``1h``, ``1d``, ``7d``, ``2w`` as seconds; ValueError otherwise."""
    found = _DURATION.match(text or "")
    if not found:
        raise ValueError(f"{text!r} is not a window: a number and m, h, d or w (30m, 1h, 1d, 7d)")
    value, unit = float(found.group(1)), found.group(2).lower()
    seconds = value * {"m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}[unit]
    if not 0 < seconds <= 366 * 86400:
        raise ValueError(f"{text!r}: a window from a minute to a year")
    return seconds


def _stats(row: dict[str, Any], dlq_open: int = 0) -> JobStats:
    hist = tuple(int(n) for n in (row.get("histogram") or ()))
    return JobStats(row["job_id"], int(row["succeeded"] or 0), int(row["failed"] or 0), int(row["cancelled"] or 0),
                    int(row["retried"] or 0), int(row["attempts"] or 0), float(row["sum_ms"] or 0.0),
                    int(row["samples"] or 0), hist, dlq_open)


def _sum(name: str, jobs: Sequence[JobStats]) -> JobStats:
    width = max((len(j.histogram) for j in jobs), default=0)
    hist = tuple(sum(j.histogram[i] if i < len(j.histogram) else 0 for j in jobs) for i in range(width))
    return JobStats(name, sum(j.succeeded for j in jobs), sum(j.failed for j in jobs),
                    sum(j.cancelled for j in jobs), sum(j.retried for j in jobs), sum(j.attempts for j in jobs),
                    sum(j.sum_ms for j in jobs), sum(j.samples for j in jobs), hist,
                    sum(j.dlq_open for j in jobs))


def job_stats(session: Session, *, since: datetime, job: str | None = None,
              workspace: str | None = None) -> list[JobStats]:
    """Per job, the runs that finished since ``since`` (whole buckets), as RLS lets the session see."""
    return _window(session, since, job, workspace)[0]


def _window(session: Session, since: datetime, job: str | None,
            workspace: str | None) -> tuple[list[JobStats], datetime | None]:
    conn = session.connection()
    # The workspace's own entries (a filtered view never names another workspace's jobs).
    open_dlq = {r["job_id"]: int(r["open"]) for r in sql.dlq_by_job(conn, window=0.0, workspace=workspace)}
    found = sql.insights_window(conn, since=since, job=job, workspace=workspace)
    stats = [_stats(r, open_dlq.get(r["job_id"], 0)) for r in found]
    # A job with open DLQ entries and no run in the window is still on call's list.
    seen = {j.job_id for j in stats}
    for job_id, n in sorted(open_dlq.items()):
        if n and job_id not in seen and (job is None or job_id == job):
            stats.append(JobStats(job_id, 0, 0, 0, 0, 0, 0.0, 0, (), n))
    updated = max((r["updated_at"] for r in found if r["updated_at"] is not None), default=None)
    return sorted(stats, key=lambda j: j.job_id), updated


def insights(session: Session, window: str, *, job: str | None = None, workspace: str | None = None) -> Insights:
    """The Insights page for one of ``WINDOWS``: per-job stats, a series per job, flaky and slow runs,
    and the runs waiting on flow control now."""
    seconds, step = WINDOWS[window]
    conn = session.connection()
    now = producer_sql.db_now(conn)
    since = now - timedelta(seconds=seconds)
    jobs, updated = _window(session, since, job, workspace)
    series: dict[str, list[Point]] = {}
    for r in sql.insights_series(conn, since=since, step=step, job=job, workspace=workspace):
        series.setdefault(r["job_id"], []).append(
            Point(r["at"], int(r["succeeded"]), int(r["failed"]), int(r["cancelled"]), int(r["retried"])))
    flaky = [FlakyRun(**r) for r in sql.flaky_runs(conn, since=since, job=job, limit=20)]
    slowest = {j.job_id: [SlowRun(**r) for r in sql.slowest_runs(conn, job=j.job_id, since=since, limit=5)]
               for j in jobs if j.samples and (job is not None or len(jobs) <= 20)}
    waiting = [FlowWait(r["job_id"], r["flow_wait"], int(r["n"]), r["next_at"], int(r["gathered"]))
               for r in sql.flow_waiting(conn) if job is None or r["job_id"] == job]
    return Insights(window, since, now, step, jobs, series, flaky, slowest, waiting, updated)


def totals(session: Session, *, by_workspace: bool = False) -> list[tuple[str | None, JobStats]]:
    """Every run ever folded, per job (and workspace): /metrics' counters and histogram."""
    return [(r["workspace_id"], _stats(r)) for r in sql.stats_totals(session.connection(), by_workspace=by_workspace)]


def run_flow(session: Session, run_id: uuid.UUID) -> RunFlow | None:
    """What flow control says about one run (None: its job has none)."""
    row = sql.run_flow(session.connection(), run_id)
    if row is None:
        return None
    return RunFlow(row["flow_wait"], row["flow_key"], row["flow_since"], row["gathered"], row["throttle_key"],
                   row["throttle_at"], row["run_at"], int(row["ahead"] or 0))
