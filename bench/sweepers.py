"""What N sweepers cost Postgres per sweep period (issue 19); rewrites its block of docs/scaling.md.

    python -m bench.sweepers                  # 1, 10 and 100 sweeps per period, two table states
    python -m bench.sweepers --no-write

Every worker's main process sweeps every ``MOTIR_SWEEP_INTERVAL`` (10 s by default),
so 100 worker hosts make 100 sweep calls per period. This bench makes them: ``N``
calls of ``core.sweeper.sweep`` back to back (one period's worth of N hosts, spread
out in time as unsynchronised hosts are), in this process, **direct** to Postgres,
against a bench database in one of two states:

* ``idle``: 50,000 finished runs and 1,000 queued runs whose message is fresh — the
  common case: nothing to reclaim, nothing to re-publish;
* ``stale``: 20,000 queued, due runs whose message is an hour old (a broker that
  restarted without persistence, or a backlog deeper than ``MOTIR_REPUBLISH_AFTER``).

Each N is measured twice: **every host sweeping** (the previous release, or direct
calls) and **one sweep per period** (this release's workers: ``once_per_period``, the
sweep slot of migration 0007: the first call takes the period, the other N − 1 make
one conditional UPDATE that finds the slot taken and writes nothing).

Per N: the transactions the sweeps made (``pg_stat_database.xact_commit`` of the
bench database, flushed), the Postgres backend CPU they used (``/proc/<pid>/stat``
of the backends, utime + stime), their wall time, and the runs they re-published.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import text

from bench.common import create_bench_database, drop_database, server_url, write_block

DB = "motir_bench_sweepers"
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Row:
    state: str
    slotted: bool
    sweeps: int
    xacts: int
    cpu_ms: float
    wall_ms: float
    republished: int
    interval: float

    @property
    def xacts_per_s(self) -> float:
        return self.xacts / self.interval

    @property
    def cpu_share(self) -> float:
        """Postgres CPU per period over the period: the share of one core."""
        return self.cpu_ms / (self.interval * 1000)


def _dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _fill(url: str, state: str) -> None:
    """The table state, written with generate_series (cron-shaped rows: no event needed)."""
    with psycopg.connect(_dsn(url), autocommit=True) as conn:
        conn.execute("TRUNCATE job_run_dlq, job_step, job_run, job_queue, job_event CASCADE")
        conn.execute("UPDATE job_sweep SET swept_at = '-infinity'")  # a new period
        insert = ("INSERT INTO job_queue (id, job_id, event_name, retry_policy, scheduled_for, state, run_at,"
                  " dispatched_at, attempts, max_attempts, finished_at)"
                  " SELECT gen_random_uuid(), 'bench.sweep', 'scheduled.bench.sweep', 'transient',"
                  " timestamptz '2026-01-01' + make_interval(secs => %(offset)s + g), %(state)s, now() - interval '2 hours',"
                  " now() - %(age)s::interval, %(attempts)s, 3, %(finished)s FROM generate_series(1, %(n)s) g")
        if state == "idle":
            conn.execute(insert, {"offset": 0, "state": "succeeded", "age": "2 hours", "attempts": 1,
                                  "finished": datetime.now(timezone.utc), "n": 50_000})
            conn.execute(insert, {"offset": 100_000, "state": "queued", "age": "0 seconds", "attempts": 0,
                                  "finished": None, "n": 1_000})
        else:
            conn.execute(insert, {"offset": 0, "state": "queued", "age": "1 hour", "attempts": 0,
                                  "finished": None, "n": 20_000})
        conn.execute("VACUUM ANALYZE job_queue")


def _backends_cpu_ms(admin: psycopg.Connection[Any]) -> float:
    pids = [r[0] for r in admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name = 'motir-celery'", (DB,))]
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total * 1000 / TICKS


def _xacts(admin: psycopg.Connection[Any]) -> int:
    row = admin.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s", (DB,)).fetchone()
    return int(row[0]) if row else 0


def measure(url: str, state: str, sweeps: int, interval: float, slotted: bool) -> Row:
    from motir_celery.core.worker import sweeper
    from motir_celery.settings import Settings
    from motir_celery.store.db import dispose_engines, get_engine

    _fill(url, state)
    settings = Settings(database_url=url, sweep_interval=interval, republish_after=60.0)
    published: list[Any] = []

    def publish(run_id: Any, job_id: str, countdown: float = 0.0) -> None:
        published.append(run_id)
    dispose_engines()
    with get_engine(settings=settings).connect() as warm:  # the pool's connection exists before measuring
        warm.execute(text("SELECT 1"))
    with psycopg.connect(_dsn(server_url()), autocommit=True, application_name="bench-sweepers") as admin:
        flush = "SELECT pg_stat_force_next_flush()"
        with get_engine(settings=settings).connect() as conn:
            conn.execute(text(flush))
        time.sleep(0.6)
        x0, c0, t0 = _xacts(admin), _backends_cpu_ms(admin), time.perf_counter()
        for _ in range(sweeps):
            sweeper.sweep(publish, settings=settings, once_per_period=slotted)
        wall = (time.perf_counter() - t0) * 1000
        c1 = _backends_cpu_ms(admin)
        with get_engine(settings=settings).connect() as conn:
            conn.execute(text(flush))
        time.sleep(0.6)  # the flush happens at the end of that statement's transaction
        x1 = _xacts(admin) - 1  # minus the flush's own transaction
    dispose_engines()
    return Row(state, slotted, sweeps, x1 - x0, c1 - c0, wall, len(published), interval)


def render(rows: list[Row], *, command: str, started: str) -> str:
    out = [f"Measured {started} with `{command}` ({os.cpu_count()} cores shared with other work;"
           f" MOTIR_SWEEP_INTERVAL {rows[0].interval:.0f} s, MOTIR_REPUBLISH_AFTER 60 s, batch 500).", "",
           "| table state | sweeps | sweep calls per period (= worker hosts) | transactions per period | per second "
           "| Postgres CPU ms per period | share of one core | wall ms per sweep | runs re-published per period |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mode = "one per period (slot)" if r.slotted else "every host"
        out.append(f"| {r.state} | {mode} | {r.sweeps} | {r.xacts} | {r.xacts_per_s:.1f} | {r.cpu_ms:.0f} "
                   f"| {100 * r.cpu_share:.2f} % | {r.wall_ms / r.sweeps:.2f} | {r.republished:,} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sweepers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweeps", default="1,10,100", help="sweep calls per period to measure")
    parser.add_argument("--interval", type=float, default=10.0, help="MOTIR_SWEEP_INTERVAL the rates are per")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if not os.environ.get("MOTIR_DATABASE_URL"):
        parser.error("MOTIR_DATABASE_URL must name a Postgres server")
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(["python -m bench.sweepers", *(sys.argv[1:] if argv is None else argv)])
    url = create_bench_database(DB)
    rows = []
    try:
        for state in ("idle", "stale"):
            for slotted in (False, True):
                for n in (int(x) for x in args.sweeps.split(",")):
                    row = measure(url, state, n, args.interval, slotted)
                    print(f"sweepers: {row}", file=sys.stderr)
                    rows.append(row)
    finally:
        drop_database(DB)
    block = render(rows, command=command, started=started)
    print(block)
    if not args.no_write:
        write_block("bench.sweepers", block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
