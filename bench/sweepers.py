"""What N sweepers cost Postgres per sweep period (issue 19); rewrites its block of docs/scaling.md.

    python -m bench.sweepers [--sweeps 1,10,100] [--no-write]

N calls of ``Engine.sweep`` back to back in this process, on an ``idle`` or a ``stale`` table
(``STATES``), every host sweeping and one sweep per period (the slot); docs/scaling.md says more.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from bench import harness as h

INSERT = ("INSERT INTO job_queue (id, job_id, event_name, retry_policy, scheduled_for, state, run_at, dispatched_at,"
          " attempts, max_attempts, finished_at)"
          " SELECT gen_random_uuid(), 'bench.sweep', 'scheduled.bench.sweep', 'transient',"
          " timestamptz '2026-01-01' + make_interval(secs => %(offset)s + g), %(state)s, now() - interval '2 hours',"
          " now() - %(age)s::interval, %(attempts)s, 3, %(finished)s FROM generate_series(1, %(n)s) g")
#: idle: 50,000 finished runs and 1,000 queued with a fresh message (nothing to do); stale: 20,000
#: queued, due runs whose message is an hour old.
STATES = {
    "idle": [{"offset": 0, "state": "succeeded", "age": "2 hours", "attempts": 1, "finished": "now", "n": 50_000},
             {"offset": 100_000, "state": "queued", "age": "0 seconds", "attempts": 0, "finished": None, "n": 1_000}],
    "stale": [{"offset": 0, "state": "queued", "age": "1 hour", "attempts": 0, "finished": None, "n": 20_000}],
}


@dataclass
class Row:
    state: str
    slotted: bool
    sweeps: int
    xacts: int
    cpu_ms: float
    wall_ms: float
    republished: int


def measure(db: h.Database, state: str, sweeps: int, interval: float, slotted: bool) -> Row:
    """The transactions (``pg_stat_database``, flushed), the backends' CPU, the wall time and the runs
    re-published of ``sweeps`` calls in one period."""
    from motir_celery import Engine
    from motir_celery.settings import Settings
    from motir_celery.store.db import dispose_engines
    from motir_celery.testing import Held

    db.truncate()
    db.rows("UPDATE job_sweep SET swept_at = '-infinity'")  # a new period
    for part in STATES[state]:
        db.rows(INSERT, {**part, "finished": datetime.now(timezone.utc) if part["finished"] else None})
    db.rows("VACUUM ANALYZE job_queue")
    settings = Settings(database_url=db.url, sweep_interval=interval, republish_after=60.0)
    published = Held()
    engine = Engine(settings, host=published)
    dispose_engines()
    with h.connect(h.server_url()) as admin:  # on another database: its reads are not counted

        def flushed_xacts() -> int:
            with engine.pool().connect() as conn:  # the sweeper's connection, made before measuring
                conn.raw.execute("SELECT pg_stat_force_next_flush()")
            time.sleep(0.6)  # flushed at the end of that statement's transaction
            return int(admin.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
                                     (db.name,)).fetchone()[0])  # type: ignore[index]

        def backends() -> list[int]:
            return [r[0] for r in admin.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s"
                                                " AND application_name = 'motir-celery'", (db.name,))]

        x0 = flushed_xacts()
        c0, t0 = h.read_cpu(backends(), tree=False), time.perf_counter()
        for _ in range(sweeps):
            engine.sweep(once_per_period=slotted)
        wall = (time.perf_counter() - t0) * 1000
        cpu = h.cpu_ms(c0, h.read_cpu(backends(), tree=False))
        x1 = flushed_xacts() - 1  # less the first flush's own transaction
    dispose_engines()
    return Row(state, slotted, sweeps, x1 - x0, cpu, wall, len(published))


def main(argv: list[str] | None = None) -> int:
    parser = h.parser("bench.sweepers", __doc__)
    parser.add_argument("--sweeps", default="1,10,100", help="sweep calls per period to measure")
    parser.add_argument("--interval", type=float, default=10.0, help="MOTIR_SWEEP_INTERVAL the rates are per")
    args = parser.parse_args(argv)
    h.need("MOTIR_DATABASE_URL")
    started, command, interval = h.now(), h.command("bench.sweepers", argv), args.interval
    with h.Database.create("motir_bench_sweepers") as db:
        rows = [measure(db, state, int(n), interval, slotted)
                for state in STATES for slotted in (False, True) for n in args.sweeps.split(",")]
    h.write_block("bench.sweepers", "\n".join([
        f"Measured {started} with `{command}` ({os.cpu_count()} cores shared with other work;"
        f" MOTIR_SWEEP_INTERVAL {interval:.0f} s, MOTIR_REPUBLISH_AFTER 60 s, batch 500).", "",
        "| table state | sweeps | sweep calls per period (= worker hosts) | transactions per period | per second "
        "| Postgres CPU ms per period | share of one core | wall ms per sweep | runs re-published per period |",
        "|---|---|---|---|---|---|---|---|---|",
        *(f"| {r.state} | {'one per period (slot)' if r.slotted else 'every host'} | {r.sweeps} | {r.xacts} "
          f"| {r.xacts / interval:.1f} | {r.cpu_ms:.0f} | {100 * r.cpu_ms / (interval * 1000):.2f} % "
          f"| {r.wall_ms / r.sweeps:.2f} | {r.republished:,} |" for r in rows)]), write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
