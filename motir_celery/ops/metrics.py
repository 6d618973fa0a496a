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
  quantiles. They are gauges over a sliding window read from the runs table;
  graph them as they are, without ``rate()``.
* **counters** from the stats rollup (``job_stats_rollup``, folded by the sweep:
  core/worker/rollup.py) — ``motir_runs_total{job,outcome}``,
  ``motir_runs_retried_total{job}``, ``motir_run_attempts_total{job}`` and the
  histogram ``motir_run_duration_seconds{job}`` (succeeded runs, first attempt's
  start to finish). They only grow, survive purge and worker restarts (the rows
  they come from are never deleted), and lag the runs by at most a sweep period:
  use ``rate()`` / ``histogram_quantile()`` on them.

* **consumer** gauges — whether anyone is there to run them: the workers that
  answered Celery's broadcast (``inspect().active_queues()``, which Redis carries
  on its pidbox fanout) and, per queue of this engine, how many consume it. Asked
  with a one-second timeout in a thread of their own, at most every five
  seconds: a scrape reads the last answer and never waits on the broker longer
  than that timeout. The answer comes from the workers themselves, never from
  anything in the request.

No workspace label unless asked (``MOTIR_METRICS_BY_WORKSPACE=1`` adds one to the
counters only): tenant ids stay out of the monitoring system, and the series count
stays bounded by jobs × states (× histogram buckets). Reads go through the app role
with the admin context (``workspace_session(None, admin=True)``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterator

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from motir_celery.core.jobs import all_jobs
from motir_celery.ops import insights
from motir_celery.settings import Settings
from motir_celery.store.db import workspace_session
from motir_celery.store.models import RUN_STATES
from motir_celery.store.records import DURATION_BOUNDS_MS
from motir_celery.store.sql import reads as sql

__all__ = ["MotirCollector", "ConsumerProbe", "build_registry", "QUANTILES"]

log = logging.getLogger("motir_celery.ops.metrics")

QUANTILES = (0.5, 0.95, 0.99)

Consumers = dict[str, set[str]]  # worker name -> the queues it consumes


class ConsumerProbe:
    """Who consumes which queue, asked of the live workers at most every ``ttl`` seconds.

    ``ask`` does the asking (by default Celery's ``active_queues`` broadcast through
    an app built from ``settings``); it runs in a daemon thread, so a broker that
    does not answer costs a scrape at most ``wait`` seconds, and the last answer
    (or ``None``, never answered) stands in the meantime."""

    def __init__(self, settings: Settings, *, ttl: float = 5.0, timeout: float = 1.0,
                 wait: float = 1.5, ask: Callable[[], Consumers] | None = None) -> None:
        self.settings = settings
        self.ttl, self.timeout, self.wait = ttl, timeout, wait
        self._ask = ask or self._active_queues
        self._app: Any = None
        self._lock = threading.Lock()
        self._answer: Consumers | None = None
        self._at = float("-inf")
        self._inflight: threading.Thread | None = None

    def _active_queues(self) -> Consumers:
        if self._app is None:
            from motir_celery.adapter.celery_app import control_app  # only where a broker is

            self._app = control_app(self.settings)
        replies = self._app.control.inspect(timeout=self.timeout).active_queues() or {}
        return {worker: {q["name"] for q in queues} for worker, queues in replies.items()}

    def _refresh(self) -> None:
        try:
            answer: Consumers | None = self._ask()
        except Exception:  # noqa: BLE001 — a broker blip: the series say so (motir_consumers_known 0)
            log.warning("asking the workers for their queues failed", exc_info=True)
            answer = None
        with self._lock:
            self._answer, self._at = answer, time.monotonic()

    def consumers(self) -> Consumers | None:
        """The latest answer, refreshed first when older than ``ttl`` (waiting at most ``wait``)."""
        with self._lock:
            stale = time.monotonic() - self._at > self.ttl
            if stale and (self._inflight is None or not self._inflight.is_alive()):
                self._inflight = threading.Thread(target=self._refresh, name="motir-consumer-probe", daemon=True)
                self._inflight.start()
            inflight = self._inflight
        if stale and inflight is not None:
            inflight.join(self.wait)
        with self._lock:
            return self._answer

    def queues(self) -> list[str]:
        """This engine's queues: its default one and every job's own (``define_job(queue=...)``)."""
        settings = self.settings
        return sorted({settings.queue, *(str(j.options["queue"]) for j in all_jobs() if j.options.get("queue"))})


class MotirCollector(Collector):
    def __init__(self, *, settings: Settings, window: float = 300.0,
                 probe: ConsumerProbe | None = None, by_workspace: bool = False) -> None:
        self.window = window
        self.settings = settings
        #: Label the rollup's counters with the workspace too (MOTIR_METRICS_BY_WORKSPACE=1).
        self.by_workspace = by_workspace
        has_broker = bool(settings.broker_url)
        self.probe = probe if probe is not None else (ConsumerProbe(settings) if has_broker else None)

    def describe(self) -> list[Metric]:
        # No describe-time queries: registering must not need the database.
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self._consumers()
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

    def _consumers(self) -> Iterator[Metric]:
        if self.probe is None:
            return  # no broker configured: nothing to ask
        answer = self.probe.consumers()
        known = GaugeMetricFamily("motir_consumers_known",
                                  "1 when the workers' queues could be asked of the broker (within 1s), else 0")
        known.add_metric([], 0 if answer is None else 1)
        yield known
        if answer is None:
            return
        queues = self.probe.queues()
        live = GaugeMetricFamily("motir_workers_live",
                                 "Workers that answered Celery's broadcast and consume a queue of this engine")
        live.add_metric([], sum(1 for qs in answer.values() if qs.intersection(queues)))
        yield live
        per_queue = GaugeMetricFamily("motir_queue_consumers", "Live workers consuming each queue of this engine",
                                      labels=["queue"])
        for queue in queues:  # zeros included: a queue nobody consumes is the point
            per_queue.add_metric([queue], sum(1 for qs in answer.values() if queue in qs))
        yield per_queue

    def _collect(self) -> Iterator[Metric]:
        with workspace_session(None, admin=True, settings=self.settings) as session:
            conn = session.connection()
            depth = sql.queue_depth(conn)
            oldest = sql.oldest_due(conn)
            expired = sql.expired_leases(conn)
            dlq = sql.dlq_by_job(conn, window=self.window)
            runs_recent = sql.runs_recent(conn, window=self.window, quantiles=QUANTILES)
            attempts_recent = sql.attempts_recent(conn, window=self.window)
            steps_recent = sql.steps_recent(conn, window=self.window, quantiles=QUANTILES)
            totals = insights.totals(session, by_workspace=self.by_workspace)

        jobs = sorted({r["job_id"] for r in depth})
        runs = GaugeMetricFamily("motir_runs", "Runs by job and state (rows in job_queue)", labels=["job", "state"])
        present = {(r["job_id"], r["state"]): r["n"] for r in depth}
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
            dlq_open.add_metric([r["job_id"]], r["open"])
            replays.add_metric([r["job_id"]], r["replays"])
        yield dlq_open
        yield replays

        finished = GaugeMetricFamily(
            "motir_runs_finished_recent", f"Runs that finished in the last {self.window:g}s, by final state",
            labels=["job", "state"],
        )
        run_duration = GaugeMetricFamily(
            "motir_run_duration_recent_seconds",
            f"Created-to-finished time of runs finished in the last {self.window:g}s, by quantile",
            labels=["job", "state", "quantile"],
        )
        for r in runs_recent:
            finished.add_metric([r["job_id"], r["state"]], r["n"])
            for q, value in zip(QUANTILES, r["quantiles"] or ()):
                run_duration.add_metric([r["job_id"], r["state"], str(q)], float(value))
        yield finished
        yield run_duration

        attempts = GaugeMetricFamily(
            "motir_attempts_recent", f"Attempts that ended in the last {self.window:g}s, by outcome",
            labels=["job", "outcome"],
        )
        for r in attempts_recent:
            attempts.add_metric([r["job_id"], r["outcome"]], r["n"])
        yield attempts

        step_duration = GaugeMetricFamily(
            "motir_step_duration_seconds",
            f"Duration of step bodies stored in the last {self.window:g}s, by quantile",
            labels=["job", "quantile"],
        )
        for r in steps_recent:
            for q, value in zip(QUANTILES, r["quantiles"] or ()):
                step_duration.add_metric([r["job_id"], str(q)], float(value))
        yield step_duration

        window = GaugeMetricFamily("motir_metrics_window_seconds", "The window of the *_recent series")
        window.add_metric([], self.window)
        yield window
        yield from self._counters(totals)

    def _counters(self, totals: list[tuple[str | None, insights.JobStats]]) -> Iterator[Metric]:
        """The rollup's all-time totals: counters and a histogram that survive purge and restarts."""
        labels = ["job", "workspace"] if self.by_workspace else ["job"]

        def key(workspace: str | None, stats: insights.JobStats) -> list[str]:
            return [stats.job_id, workspace or ""] if self.by_workspace else [stats.job_id]

        outcomes = CounterMetricFamily("motir_runs", "Runs that finished, by outcome (the stats rollup; survives purge)",
                                       labels=[*labels, "outcome"])
        retried = CounterMetricFamily("motir_runs_retried", "Finished runs that needed more than one attempt",
                                      labels=labels)
        attempts = CounterMetricFamily("motir_run_attempts", "Attempts charged to finished runs", labels=labels)
        duration = HistogramMetricFamily(
            "motir_run_duration_seconds",
            "Duration of succeeded runs, their first attempt's start to their finish (the stats rollup)",
            labels=labels)
        bounds = [f"{b / 1000:g}" for b in DURATION_BOUNDS_MS] + ["+Inf"]
        for workspace, stats in totals:
            k = key(workspace, stats)
            for outcome, n in (("succeeded", stats.succeeded), ("failed", stats.failed),
                               ("cancelled", stats.cancelled)):
                outcomes.add_metric([*k, outcome], n)
            retried.add_metric(k, stats.retried)
            attempts.add_metric(k, stats.attempts)
            cumulative, running = [], 0
            counts = list(stats.histogram) + [0] * (len(bounds) - len(stats.histogram))
            for bound, n in zip(bounds, counts):
                running += n
                cumulative.append((bound, running))
            duration.add_metric(k, cumulative, sum_value=stats.sum_ms / 1000)
        yield outcomes
        yield retried
        yield attempts
        yield duration


def build_registry(*, settings: Settings, window: float = 300.0,
                   by_workspace: bool = False) -> CollectorRegistry:
    """A registry of its own (not the global one): two dashboards in one process never collide."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MotirCollector(window=window, settings=settings, by_workspace=by_workspace))
    return registry
