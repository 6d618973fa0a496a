"""Prometheus metrics, read from Postgres at scrape time.

Postgres holds the truth, so the numbers come from it rather than from counters
kept in worker memory: every dashboard replica reports the same values, a worker
restart loses nothing, and no multiprocess-mode plumbing is needed in Celery's
prefork pool. The cost is a handful of aggregate queries per scrape (served by
the partial indexes on queued and running rows; the "recent" ones scan rows
finished within the window).

Two kinds of series:

* **state** gauges — what is true now: runs by job and state, the oldest due
  run's wait, expired leases, open DLQ entries. Alert on these.
* **recent** gauges — what happened in the last ``window`` seconds (default
  300): runs finished, attempts by outcome, DLQ replays, run and step duration
  quantiles. They are gauges over a sliding window, not counters, because a
  purge deletes the rows a counter would be derived from; graph them as they
  are, without ``rate()``.

No workspace label anywhere: tenant ids stay out of the monitoring system, and
the series count stays bounded by jobs × states. Reads go through the app role
with the admin context (``workspace_session(None, admin=True)``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterator

from prometheus_client.core import CollectorRegistry, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import text

from motir_celery.settings import Settings
from motir_celery.store.db import workspace_session
from motir_celery.store.models import RUN_STATES

__all__ = ["MotirCollector", "build_registry", "QUANTILES"]

log = logging.getLogger("motir_celery.ops.metrics")

QUANTILES = (0.5, 0.95, 0.99)

_DEPTH = text("SELECT job_id, state, count(*) AS n FROM job_queue GROUP BY job_id, state")
_OLDEST_DUE = text(
    "SELECT job_id, extract(epoch FROM now() - min(run_at)) AS age FROM job_queue "
    "WHERE state = 'queued' AND run_at <= now() GROUP BY job_id"
)
_EXPIRED = text(
    "SELECT job_id, count(*) AS n FROM job_queue WHERE state = 'running' AND lease_expires_at < now() GROUP BY job_id"
)
_DLQ = text(
    """
    SELECT function_id AS job_id,
           count(*) FILTER (WHERE replayed_at IS NULL AND dismissed_at IS NULL AND resumed_at IS NULL) AS open,
           count(*) FILTER (WHERE replayed_at >= now() - make_interval(secs => :window)) AS replays
    FROM job_run_dlq GROUP BY function_id
    """
)
_RUNS_RECENT = text(
    """
    SELECT job_id, state, count(*) AS n,
           percentile_cont(CAST(:q AS float8[])) WITHIN GROUP
             (ORDER BY extract(epoch FROM finished_at - created_at)) AS quantiles
    FROM job_queue
    WHERE finished_at >= now() - make_interval(secs => :window)
    GROUP BY job_id, state
    """
)
_ATTEMPTS_RECENT = text(
    "SELECT job_id, outcome, count(*) AS n FROM job_run "
    "WHERE finished_at >= now() - make_interval(secs => :window) GROUP BY job_id, outcome"
)
_STEPS_RECENT = text(
    """
    SELECT q.job_id, count(*) AS n,
           percentile_cont(CAST(:q AS float8[])) WITHIN GROUP
             (ORDER BY extract(epoch FROM s.completed_at - s.started_at)) AS quantiles
    FROM job_step s JOIN job_queue q ON q.id = s.run_id
    WHERE s.completed_at >= now() - make_interval(secs => :window)
    GROUP BY q.job_id
    """
)


class MotirCollector(Collector):
    def __init__(self, *, window: float = 300.0, settings: Settings | None = None) -> None:
        self.window = window
        self.settings = settings

    def describe(self) -> list[Metric]:
        # No describe-time queries: registering must not need the database.
        return []

    def collect(self) -> Iterator[Metric]:
        started = time.monotonic()
        up = GaugeMetricFamily("motir_up", "1 when the last scrape could read the motir tables, else 0")
        try:
            metrics = list(self._collect())
        except Exception:  # noqa: BLE001 — a scrape must answer even when Postgres does not
            log.warning("metrics scrape failed", exc_info=True)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from metrics
        took = GaugeMetricFamily("motir_scrape_duration_seconds", "Time spent reading the motir tables")
        took.add_metric([], time.monotonic() - started)
        yield took

    def _collect(self) -> Iterator[Metric]:
        params: dict[str, Any] = {"window": self.window, "q": list(QUANTILES)}
        with workspace_session(None, admin=True, settings=self.settings) as session:
            depth = session.execute(_DEPTH).all()
            oldest = {r.job_id: float(r.age) for r in session.execute(_OLDEST_DUE)}
            expired = {r.job_id: r.n for r in session.execute(_EXPIRED)}
            dlq = session.execute(_DLQ, params).all()
            runs_recent = session.execute(_RUNS_RECENT, params).all()
            attempts_recent = session.execute(_ATTEMPTS_RECENT, params).all()
            steps_recent = session.execute(_STEPS_RECENT, params).all()

        jobs = sorted({r.job_id for r in depth})
        runs = GaugeMetricFamily("motir_runs", "Runs by job and state (rows in job_queue)", labels=["job", "state"])
        present = {(r.job_id, r.state): r.n for r in depth}
        for job in jobs:
            for state in RUN_STATES:  # every state, zeros included: absent series break alerts
                runs.add_metric([job, state], present.get((job, state), 0))
        yield runs

        due = GaugeMetricFamily(
            "motir_oldest_due_run_age_seconds",
            "How long the oldest due queued run of a job has waited past its run_at (0: none waiting)",
            labels=["job"],
        )
        for job in jobs:
            due.add_metric([job], oldest.get(job, 0.0))
        yield due

        leases = GaugeMetricFamily(
            "motir_expired_leases", "Running runs whose lease expired and the sweeper has not reclaimed yet",
            labels=["job"],
        )
        for job in jobs:
            leases.add_metric([job], expired.get(job, 0))
        yield leases

        dlq_open = GaugeMetricFamily("motir_dlq_open", "DLQ entries neither replayed nor dismissed", labels=["job"])
        replays = GaugeMetricFamily(
            "motir_dlq_replays_recent", f"DLQ entries replayed in the last {self.window:g}s", labels=["job"]
        )
        for r in dlq:
            dlq_open.add_metric([r.job_id], r.open)
            replays.add_metric([r.job_id], r.replays)
        yield dlq_open
        yield replays

        finished = GaugeMetricFamily(
            "motir_runs_finished_recent", f"Runs that finished in the last {self.window:g}s, by final state",
            labels=["job", "state"],
        )
        run_duration = GaugeMetricFamily(
            "motir_run_duration_seconds",
            f"Created-to-finished time of runs finished in the last {self.window:g}s, by quantile",
            labels=["job", "state", "quantile"],
        )
        for r in runs_recent:
            finished.add_metric([r.job_id, r.state], r.n)
            for q, value in zip(QUANTILES, r.quantiles or ()):
                run_duration.add_metric([r.job_id, r.state, str(q)], float(value))
        yield finished
        yield run_duration

        attempts = GaugeMetricFamily(
            "motir_attempts_recent", f"Attempts that ended in the last {self.window:g}s, by outcome",
            labels=["job", "outcome"],
        )
        for r in attempts_recent:
            attempts.add_metric([r.job_id, r.outcome], r.n)
        yield attempts

        step_duration = GaugeMetricFamily(
            "motir_step_duration_seconds",
            f"Duration of step bodies stored in the last {self.window:g}s, by quantile",
            labels=["job", "quantile"],
        )
        for r in steps_recent:
            for q, value in zip(QUANTILES, r.quantiles or ()):
                step_duration.add_metric([r.job_id, str(q)], float(value))
        yield step_duration

        window = GaugeMetricFamily("motir_metrics_window_seconds", "The window of the *_recent series")
        window.add_metric([], self.window)
        yield window


def build_registry(*, window: float = 300.0, settings: Settings | None = None) -> CollectorRegistry:
    """A registry of its own (not the global one): two dashboards in one process never collide."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MotirCollector(window=window, settings=settings))
    return registry
