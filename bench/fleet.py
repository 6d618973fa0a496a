"""A fleet of worker hosts on one Postgres, through PgBouncer (issue 19); rewrites its block of docs/scaling.md.

    python -m bench.fleet [--runs 5000 --hosts 4 --procs 2 --pool-size 4] [--no-direct] [--no-write]

Needs MOTIR_DATABASE_URL, CELERY_BROKER_URL and Debian's ``pgbouncer`` (``motir_celery.dev.private.PgBouncer``);
docs/scaling.md says what runs and what is checked (a failed check fails the bench).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import psycopg

from bench import harness as h

DB = "motir_bench_fleet"
COUNTS = """
    SELECT (SELECT count(*) FROM job_queue WHERE state = 'succeeded'), (SELECT count(*) FROM job_run),
           (SELECT count(*) FROM job_step), (SELECT count(*) FROM bench.side_effect),
           (SELECT count(*) FROM (SELECT 1 FROM bench.side_effect GROUP BY run_id, step HAVING count(*) > 1) t)
"""


@dataclass
class Peaks:
    server: int = 0  # client backends of the bench database in pg_stat_activity
    server_in_tx: int = 0  # of which active or idle in transaction
    clients: int = 0  # PgBouncer cl_active + cl_waiting
    waiting: int = 0  # PgBouncer cl_waiting
    pooled: int = 0  # PgBouncer's own count of its server connections (sv_*)
    by_app: dict[str, int] = field(default_factory=dict)  # application_name -> count at the server peak
    samples: int = 0
    waiting_samples: int = 0  # samples with cl_waiting > 0


@dataclass
class FleetResult:
    hosts: int
    procs: int
    pool_size: int | None  # None: direct
    runs: int
    seconds: float
    peaks: Peaks
    counts: tuple[int, ...]  # succeeded, attempts, steps stored, steps executed, executed twice (COUNTS)
    log_errors: list[str]
    wait_us_per_xact: float | None = None
    xacts: int | None = None

    @property
    def ok(self) -> bool:
        return self.counts == (self.runs, self.runs, 2 * self.runs, 2 * self.runs, 0) and not self.log_errors


class Sampler(threading.Thread):
    """Peaks of server connections (Postgres, directly) and of PgBouncer's clients, every 0.1 s."""

    def __init__(self, db: h.Database, bouncer: Any | None) -> None:
        super().__init__(name="fleet-sampler", daemon=True)
        self.db, self.bouncer, self.peaks, self._halt = db, bouncer, Peaks(), threading.Event()

    def run(self) -> None:
        from psycopg.rows import dict_row

        admin = self.bouncer and psycopg.connect(self.bouncer.admin_dsn(), autocommit=True, prepare_threshold=None,
                                                 row_factory=dict_row)
        p = self.peaks
        with h.connect(self.db.url, application_name="bench-sampler") as pg:
            while not self._halt.wait(0.1):
                rows = pg.execute(
                    "SELECT coalesce(application_name, ''), state FROM pg_stat_activity"
                    " WHERE datname = %s AND backend_type = 'client backend' AND application_name NOT LIKE 'bench%%'",
                    (DB,)).fetchall()
                p.samples += 1
                if len(rows) > p.server:
                    p.server, p.by_app = len(rows), {}
                    for app, _ in rows:
                        p.by_app[app] = p.by_app.get(app, 0) + 1
                p.server_in_tx = max(p.server_in_tx, sum(1 for _, s in rows if s and s != "idle"))
                if admin:
                    pools = [r for r in admin.execute(b"SHOW POOLS", prepare=False).fetchall() if r["database"] == DB]
                    waiting = sum(int(r["cl_waiting"]) for r in pools)
                    p.waiting, p.waiting_samples = max(p.waiting, waiting), p.waiting_samples + (waiting > 0)
                    p.clients = max(p.clients, sum(int(r["cl_active"]) + int(r["cl_waiting"]) for r in pools))
                    p.pooled = max(p.pooled, sum(int(r[k]) for r in pools for k in
                                                 ("sv_active", "sv_idle", "sv_used", "sv_tested", "sv_login")))
        if admin:
            admin.close()

    def stop(self) -> Peaks:
        self._halt.set()
        self.join(timeout=10)
        return self.peaks


def run_fleet(db: h.Database, runs: int, hosts: int, procs: int, pool_size: int | None, timeout: float) -> FleetResult:
    """``hosts`` x ``procs`` workers drain ``runs`` events of ``fleet.two`` sent in batches meanwhile,
    through a PgBouncer of ``pool_size`` (None: straight to Postgres)."""
    from motir_celery.dev.private import PgBouncer, database_errors
    from motir_celery.settings import Settings, reset_settings
    from motir_celery.store.db import dispose_engines

    db.truncate("bench.side_effect")
    queue = f"bench-fleet-{uuid.uuid4().hex[:8]}"
    bouncer = PgBouncer(db.url, pool_size=pool_size).start() if pool_size else None
    # Behind PgBouncer the engine finds the pooler at its first connection and prepares nothing.
    env = h.engine_env(bouncer.url(DB) if bouncer else db.url, queue, "bench.jobs", PYTHONUNBUFFERED="1")
    sampler, stats, logs = Sampler(db, bouncer), [], h.LOGS / f"fleet-{'pgbouncer' if bouncer else 'direct'}"
    shutil.rmtree(logs, ignore_errors=True)  # database_errors reads every log there
    try:
        with h.workers("motir_celery", queue, hosts, procs, env=env, tag="fleet", loglevel="INFO", logs=logs,
                       hosts=[f"fleet-host-{i}" for i in range(hosts)], ready=True) as fleet:
            sampler.start()
            t0 = time.monotonic()
            feeder = h.Feeder(Settings.from_env(env), "fleet.two", total=runs)
            feeder.start()
            fleet.wait(lambda: db.value("SELECT count(*) FROM job_queue WHERE state = 'succeeded'") >= runs,
                       timeout, poll=0.2)
            seconds = time.monotonic() - t0
            feeder.stop()
            peaks = sampler.stop()
            stats = [s for s in bouncer.show("STATS") if s.get("database") == DB] if bouncer else []
    finally:
        sampler.stop()
        dispose_engines()
        reset_settings()
        if bouncer:
            bouncer.stop()
    xacts = sum(int(s["total_xact_count"]) for s in stats) if stats else None
    wait = sum(int(s["total_wait_time"]) for s in stats) / xacts if stats and xacts else None
    return FleetResult(hosts, procs, pool_size, runs, seconds, peaks, tuple(map(int, db.rows(COUNTS)[0])),
                       database_errors(logs), wait, xacts)


def _row(r: FleetResult) -> str:
    p, pooled = r.peaks, r.pool_size is not None
    apps = ", ".join(f"{k or '(none)'} {v}" for k, v in sorted(p.by_app.items()))
    return " | ".join([
        "", f"PgBouncer, pool {r.pool_size} (PgBouncer counts {p.pooled})" if pooled else "direct",
        f"{r.hosts} × {r.procs}", f"{r.runs:,}", f"{r.seconds:.1f}", f"{r.runs / r.seconds:.0f}",
        f"**{p.server}** ({apps})", str(p.server_in_tx), str(p.clients) if pooled else "—",
        f"{p.waiting} ({p.waiting_samples}/{p.samples} samples)" if pooled else "—",
        f"{r.wait_us_per_xact / 1000:.2f}" if r.wait_us_per_xact is not None else "—",
        f"{r.xacts / r.runs:.1f}" if r.xacts else "—", str(r.counts[4]), str(len(r.log_errors)),
        "yes" if r.ok else "**NO**", ""]).strip()


def main(argv: list[str] | None = None) -> int:
    parser = h.parser("bench.fleet", __doc__)
    parser.add_argument("--runs", type=int, default=5000)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--procs", type=int, default=2, help="prefork processes per host (-c)")
    parser.add_argument("--pool-size", type=int, default=4, help="PgBouncer default_pool_size")
    parser.add_argument("--direct-runs", type=int, default=None, help="runs of the direct comparison (default: --runs)")
    parser.add_argument("--no-direct", action="store_true", help="skip the direct comparison")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)
    h.need("MOTIR_DATABASE_URL", "CELERY_BROKER_URL")
    from bench.jobs import LEDGER_DDL
    from motir_celery.dev.private import pgbouncer_binary

    started, command, log = h.now(), h.command("bench.fleet", argv), h.logger("fleet")
    out = subprocess.run([pgbouncer_binary() or "pgbouncer", "--version"], capture_output=True, text=True).stdout
    machine = h.machine(h.server_url(), PgBouncer=(re.findall(r"PgBouncer (\S+)", out) or ["?"])[0])
    results = []
    with h.Database.create(DB) as db:  # migrated direct: never through the pooler (operations.md)
        db.rows(LEDGER_DDL)
        for pool, runs in [(args.pool_size, args.runs), *([] if args.no_direct else [(None, args.direct_runs or args.runs)])]:
            log(f"{'pgbouncer' if pool else 'direct'}, {args.hosts} hosts x {args.procs} processes, {runs} runs ...")
            results.append(run_fleet(db, runs, args.hosts, args.procs, pool, args.timeout))
            log(_row(results[-1]))
            for line in results[-1].log_errors[:10]:
                log(f"log error: {line}")
    h.write_block("bench.fleet", "\n".join([
        f"Measured {started} on {machine} with `{command}`.", "",
        "| connections | hosts × processes | runs | drain s | runs/s | peak server connections (by application_name) "
        "| peak in a transaction | peak PgBouncer clients | peak waiting clients (cl_waiting) "
        "| mean wait ms / transaction | transactions per run | steps executed twice | log errors | all checks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", *map(_row, results)]), write=not args.no_write)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
