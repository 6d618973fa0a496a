"""A fleet of worker hosts on one Postgres, through PgBouncer (issue 19); rewrites docs/scaling.md.

    python -m bench.fleet [--runs 5000 --hosts 4 --procs 2 --pool-size 4] [--no-direct] [--no-write]

Needs MOTIR_DATABASE_URL (the bench creates ``motir_bench_fleet`` there and migrates it
direct), CELERY_BROKER_URL and Debian's ``pgbouncer`` (``tests/fixtures/pgbouncer.py`` starts a
private one in transaction pooling). ``pgbouncer``: ``--hosts`` celery workers with
distinct host names, ``-c --procs`` each, all through the one PgBouncer (``default_pool_size
= --pool-size``, fewer than the fleet's processes), ``MOTIR_PREPARED_STATEMENTS=0``; events
of ``fleet.two`` (two steps, each writing a ledger row) are sent in batches through it
while the fleet drains them. ``direct``: the same fleet straight to Postgres. A sampler
reads the server's client backends and PgBouncer's ``SHOW POOLS`` every 0.1 s. Every run
must succeed in one attempt, every step be stored and executed once (the ledger), and no
worker log name a database error: anything else fails the bench.
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
    mode: str
    hosts: int
    procs: int
    pool_size: int | None
    runs: int
    seconds: float
    peaks: Peaks
    succeeded: int
    attempts: int
    steps_stored: int
    executions: int
    executed_twice: int
    log_errors: list[str]
    wait_us_per_xact: float | None = None
    xacts: int | None = None

    @property
    def ok(self) -> bool:
        return (self.succeeded == self.runs and self.attempts == self.runs and self.steps_stored == 2 * self.runs
                and self.executions == 2 * self.runs and self.executed_twice == 0 and not self.log_errors)


COUNTS = """
    SELECT (SELECT count(*) FROM job_queue WHERE state = 'succeeded'), (SELECT count(*) FROM job_queue),
           (SELECT count(*) FROM job_run), (SELECT count(*) FROM job_step), (SELECT count(*) FROM bench.side_effect),
           (SELECT count(*) FROM (SELECT 1 FROM bench.side_effect GROUP BY run_id, step HAVING count(*) > 1) t)
"""


def _counts(db: h.Database) -> dict[str, int]:
    return dict(zip(("succeeded", "runs", "attempts", "steps", "executions", "twice"), map(int, db.rows(COUNTS)[0])))


# --- sampling -----------------------------------------------------------------------------


class Sampler(threading.Thread):
    """Peaks of server connections (Postgres, directly) and of PgBouncer's clients, every 0.1 s."""

    def __init__(self, db: h.Database, bouncer: Any | None) -> None:
        super().__init__(name="fleet-sampler", daemon=True)
        self.db, self.bouncer = db, bouncer
        self.peaks = Peaks()
        self._halt = threading.Event()

    def run(self) -> None:
        admin = None
        if self.bouncer is not None:
            from psycopg.rows import dict_row

            admin = psycopg.connect(self.bouncer.admin_dsn(), autocommit=True, prepare_threshold=None,
                                    row_factory=dict_row)
        with h.connect(self.db.url, application_name="bench-sampler") as pg:
            while not self._halt.wait(0.1):
                rows = pg.execute(
                    "SELECT coalesce(application_name, ''), state FROM pg_stat_activity"
                    " WHERE datname = %s AND backend_type = 'client backend' AND application_name NOT LIKE 'bench%%'",
                    (DB,)).fetchall()
                p = self.peaks
                p.samples += 1
                if len(rows) > p.server:
                    p.server = len(rows)
                    p.by_app = {}
                    for app, _ in rows:
                        p.by_app[app] = p.by_app.get(app, 0) + 1
                p.server_in_tx = max(p.server_in_tx, sum(1 for _, s in rows if s and s != "idle"))
                if admin is not None:
                    pools = [r for r in admin.execute(b"SHOW POOLS", prepare=False).fetchall()
                             if r["database"] == DB]
                    waiting = sum(int(r["cl_waiting"]) for r in pools)
                    p.waiting = max(p.waiting, waiting)
                    p.waiting_samples += waiting > 0
                    p.clients = max(p.clients, sum(int(r["cl_active"]) + int(r["cl_waiting"]) for r in pools))
                    p.pooled = max(p.pooled, sum(int(r[k]) for r in pools for k in
                                                 ("sv_active", "sv_idle", "sv_used", "sv_tested", "sv_login")))
        if admin is not None:
            admin.close()

    def stop(self) -> Peaks:
        self._halt.set()
        self.join(timeout=10)
        return self.peaks


# --- the fleet ------------------------------------------------------------------------------


def run_fleet(mode: str, *, db: h.Database, runs: int, hosts: int, procs: int, pool_size: int,
              timeout: float) -> FleetResult:
    from motir_celery.settings import Settings, reset_settings
    from motir_celery.store.db import dispose_engines
    from tests.fixtures.pgbouncer import PgBouncer, database_errors

    db.truncate("bench.side_effect")
    queue = f"bench-fleet-{uuid.uuid4().hex[:8]}"
    bouncer = PgBouncer(db.url, pool_size=pool_size).start() if mode == "pgbouncer" else None
    url = bouncer.url(DB) if bouncer is not None else db.url
    env = h.child_env(MOTIR_DATABASE_URL=url, MOTIR_QUEUE=queue, MOTIR_IMPORTS="bench.fleet_jobs",
                      MOTIR_PREPARED_STATEMENTS="0" if bouncer is not None else "1", PYTHONUNBUFFERED="1")
    env.pop("MOTIR_APP_DATABASE_URL", None)
    sampler, stats = Sampler(db, bouncer), []
    logs = h.LOGS / f"fleet-{mode}"
    shutil.rmtree(logs, ignore_errors=True)  # database_errors reads every log there
    try:
        with h.workers("motir_celery", queue, hosts, procs, env=env, tag="fleet", loglevel="INFO", logs=logs,
                       hosts=[f"fleet-host-{i}" for i in range(hosts)], ready=True) as fleet:
            sampler.start()
            t0 = time.monotonic()
            feeder = h.Feeder(Settings.from_env(env), "fleet.two", total=runs)
            feeder.start()
            fleet.wait(lambda: _counts(db)["succeeded"] >= runs, timeout, poll=0.2)
            seconds = time.monotonic() - t0
            feeder.stop()
            peaks = sampler.stop()
            stats = bouncer.show("STATS") if bouncer is not None else []
    finally:
        sampler.stop()
        dispose_engines()
        reset_settings()
        if bouncer is not None:
            bouncer.stop()
    c = _counts(db)
    ours = [s for s in stats if s.get("database") == DB]
    xacts = sum(int(s["total_xact_count"]) for s in ours) if ours else None
    wait = sum(int(s["total_wait_time"]) for s in ours) / xacts if ours and xacts else None
    return FleetResult(mode, hosts, procs, pool_size if bouncer is not None else None, runs, seconds, peaks,
                       c["succeeded"], c["attempts"], c["steps"], c["executions"], c["twice"],
                       database_errors(logs), wait, xacts)


# --- the report -------------------------------------------------------------------------------


def _row(r: FleetResult) -> str:
    p = r.peaks
    apps = ", ".join(f"{k or '(none)'} {v}" for k, v in sorted(p.by_app.items()))
    pooled = f"PgBouncer, pool {r.pool_size}" if r.pool_size else "direct"
    waiting = f"{p.waiting} ({p.waiting_samples}/{p.samples} samples)" if r.pool_size else "—"
    clients = str(p.clients) if r.pool_size else "—"
    pooled = f"{pooled} (PgBouncer counts {p.pooled})" if r.pool_size else pooled
    wait = f"{r.wait_us_per_xact / 1000:.2f}" if r.wait_us_per_xact is not None else "—"
    per_run = f"{r.xacts / r.runs:.1f}" if r.xacts else "—"
    ok = "yes" if r.ok else "**NO**"
    return (f"| {pooled} | {r.hosts} × {r.procs} | {r.runs:,} | {r.seconds:.1f} | {r.runs / r.seconds:.0f} "
            f"| **{p.server}** ({apps}) | {p.server_in_tx} | {clients} | {waiting} | {wait} "
            f"| {per_run} | {r.executed_twice} | {len(r.log_errors)} | {ok} |")


def render(results: list[FleetResult], *, command: str, started: str, machine: str) -> str:
    lines = [
        f"Measured {started} on {machine} with `{command}`.",
        "",
        "| connections | hosts × processes | runs | drain s | runs/s | peak server connections (by application_name) "
        "| peak in a transaction | peak PgBouncer clients | peak waiting clients (cl_waiting) "
        "| mean wait ms / transaction | transactions per run | steps executed twice | log errors | all checks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(_row(r) for r in results),
        "",
        "Checks, per row: every run `succeeded` in exactly one attempt, 2 steps stored per run, 2 ledger",
        "rows per run (`bench.side_effect`, written by each step body before it returns: *executed*",
        "once, not only stored once), no worker log line naming a database error.",
        "Server connections are client backends of the bench database in `pg_stat_activity`, read",
        "from Postgres directly every 0.1 s; `fleet-ledger` is the job's own side-effect connection,",
        "`motir-celery` the engine's. Waiting clients are PgBouncer's `SHOW POOLS` `cl_waiting`, same",
        "period (a sample, so a lower bound); the mean wait is PgBouncer's `total_wait_time` over",
        "`total_xact_count` (`SHOW STATS`), exact. Transactions per run are all of PgBouncer's for the",
        "database over the runs: the engine's claim, one per step record and the settle (4 for this job),",
        "the job's own 2 ledger inserts, the producer's batches and the sweeps.",
    ]
    return "\n".join(lines)


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
    from bench.fleet_jobs import LEDGER_DDL
    from tests.fixtures.pgbouncer import binary

    started, command = h.now(), h.command("bench.fleet", argv)
    out = subprocess.run([binary() or "pgbouncer", "--version"], capture_output=True, text=True).stdout
    machine = h.machine(h.server_url(), PgBouncer=(re.findall(r"PgBouncer (\S+)", out) or ["?"])[0])
    results = []
    with h.Database.create(DB) as db:  # migrated direct: never through the pooler (operations.md)
        db.rows(LEDGER_DDL)
        for mode, runs in [("pgbouncer", args.runs)] + ([] if args.no_direct else [("direct", args.direct_runs or args.runs)]):
            print(f"fleet: {mode}, {args.hosts} hosts x {args.procs} processes, {runs} runs ...", file=sys.stderr)
            result = run_fleet(mode, db=db, runs=runs, hosts=args.hosts, procs=args.procs, pool_size=args.pool_size,
                               timeout=args.timeout)
            print(_row(result), file=sys.stderr)
            for line in result.log_errors[:10]:
                print(f"fleet: log error: {line}", file=sys.stderr)
            results.append(result)
    block = render(results, command=command, started=started, machine=machine)
    h.write_block("bench.fleet", block, write=not args.no_write)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
