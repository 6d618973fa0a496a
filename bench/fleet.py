"""A fleet of worker hosts on one Postgres, through PgBouncer (issue 19); rewrites docs/scaling.md.

    python -m bench.fleet                       # 4 hosts x 2 processes, pool 4, 5,000 runs (+ a direct run)
    python -m bench.fleet --runs 1000 --no-direct --no-write

Needs MOTIR_DATABASE_URL (a Postgres server: the bench creates ``motir_bench_fleet``
on it, migrates it **direct**, and drops it at the end), CELERY_BROKER_URL (Redis; a
queue of its own) and Debian's ``pgbouncer`` (``tests/pgbouncer.py`` starts a private
one in transaction pooling on a free port).

What it does, per mode:

* ``pgbouncer``: ``--hosts`` celery workers with distinct host names (``-n
  fleet0@fleet-host-0`` …), each ``-P prefork -c --procs``, every process
  connected through the one PgBouncer (``default_pool_size = --pool-size``, smaller
  than the fleet's processes), ``MOTIR_PREPARED_STATEMENTS=0``. ``--runs`` events
  of ``fleet.two`` (``bench/fleet_jobs.py``: two steps, each writing a ledger row)
  are sent in batches through the same PgBouncer while the fleet drains them.
* ``direct`` (unless ``--no-direct``): the same fleet straight to Postgres, fewer
  runs, to show what the pooler saves.

Every 0.1 s a sampler reads, from Postgres directly, ``pg_stat_activity``'s client
backends of the bench database (all of them, and those in a transaction), and from
PgBouncer's admin console ``SHOW POOLS`` (``cl_active``, ``cl_waiting``, server
connections). At the end: every run succeeded in one attempt, every step stored
once and **executed once** (the ledger), and no worker log names a database error
(``tests.pgbouncer.database_errors``); any of these failing fails the bench.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from bench.common import ROOT, SCALING_DOC, child_env, create_bench_database, drop_database, server_url, write_block

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


# --- the database -----------------------------------------------------------------------


def _create_database() -> str:
    """A fresh bench database, migrated and given its ledger, all **direct** (migrations never
    go through the pooler: docs/operations.md, "Behind PgBouncer")."""
    from bench.fleet_jobs import LEDGER_DDL

    url = create_bench_database(DB)
    eng = create_engine(url, poolclass=NullPool)
    with eng.begin() as conn:
        conn.execute(text(LEDGER_DDL))
    eng.dispose()
    return url


def _reset(url: str) -> None:
    eng = create_engine(url, poolclass=NullPool)
    with eng.begin() as conn:
        conn.execute(text("TRUNCATE job_run_dlq, job_step, job_run, job_queue, job_event, bench.side_effect CASCADE"))
    eng.dispose()


def _dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _counts(direct_url: str) -> dict[str, int]:
    with psycopg.connect(_dsn(direct_url), autocommit=True, application_name="fleet-bench") as conn:
        row = conn.execute("""
            SELECT (SELECT count(*) FROM job_queue WHERE state = 'succeeded') AS succeeded,
                   (SELECT count(*) FROM job_queue) AS runs,
                   (SELECT count(*) FROM job_run) AS attempts,
                   (SELECT count(*) FROM job_step) AS steps,
                   (SELECT count(*) FROM bench.side_effect) AS executions,
                   (SELECT count(*) FROM (SELECT 1 FROM bench.side_effect GROUP BY run_id, step
                                          HAVING count(*) > 1) t) AS twice""").fetchone()
    assert row is not None
    return dict(zip(("succeeded", "runs", "attempts", "steps", "executions", "twice"), map(int, row)))


# --- sampling -----------------------------------------------------------------------------


class Sampler(threading.Thread):
    """Peaks of server connections (Postgres, directly) and of PgBouncer's clients, every 0.1 s."""

    def __init__(self, direct_url: str, bouncer: Any | None) -> None:
        super().__init__(name="fleet-sampler", daemon=True)
        self.direct_url, self.bouncer = direct_url, bouncer
        self.peaks = Peaks()
        self._halt = threading.Event()

    def run(self) -> None:
        admin = None
        if self.bouncer is not None:
            from psycopg.rows import dict_row

            admin = psycopg.connect(self.bouncer.admin_dsn(), autocommit=True, prepare_threshold=None,
                                    row_factory=dict_row)
        with psycopg.connect(_dsn(self.direct_url), autocommit=True, application_name="fleet-bench") as pg:
            while not self._halt.wait(0.1):
                rows = pg.execute(
                    "SELECT coalesce(application_name, ''), state FROM pg_stat_activity"
                    " WHERE datname = %s AND backend_type = 'client backend' AND application_name <> 'fleet-bench'",
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


def _start_fleet(hosts: int, procs: int, env: dict[str, str], queue: str, logs: Path) -> list[subprocess.Popen[bytes]]:
    fleet = []
    for i in range(hosts):
        log = open(logs / f"worker-fleet{i}.log", "wb")
        fleet.append(subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "motir_celery", "worker", "-l", "INFO", "-c", str(procs),
             "-P", "prefork", "-Q", queue, "-n", f"fleet{i}@fleet-host-{i}", "--without-gossip", "--without-mingle"],
            stdout=log, stderr=subprocess.STDOUT, env={**env, "FLEET_HOST": f"fleet-host-{i}"}, cwd=ROOT,
            start_new_session=True))
        log.close()
    deadline = time.monotonic() + 120
    for i, proc in enumerate(fleet):
        path = logs / f"worker-fleet{i}.log"
        while "ready." not in path.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                _stop_fleet(fleet)
                raise RuntimeError(f"worker fleet{i} did not start:\n{path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)
    return fleet


def _stop_fleet(fleet: list[subprocess.Popen[bytes]]) -> None:
    for proc in fleet:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in fleet:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _feed(runs: int, settings: Any, batch: int = 250) -> None:
    """``runs`` events of fleet.two in batches of ``batch`` (one statement each), published after commit."""
    from motir_celery.adapter.celery_app import create_app, publisher
    from motir_celery.core.producer.batch import send_events

    publish = publisher(create_app(settings))
    for start in range(0, runs, batch):
        items = [("fleet.two", {"n": n, "workspace_id": f"ws-{n % 8}"}) for n in range(start, min(start + batch, runs))]
        send_events(items, publish=publish, settings=settings)


def run_fleet(mode: str, *, direct_url: str, runs: int, hosts: int, procs: int, pool_size: int,
              timeout: float) -> FleetResult:
    import bench.fleet_jobs  # noqa: F401  (fleet.two in this process too, for the fan-out)
    from motir_celery.settings import Settings, reset_settings
    from motir_celery.store.db import dispose_engines
    from tests.pgbouncer import PgBouncer, database_errors

    _reset(direct_url)
    queue = f"bench-fleet-{uuid.uuid4().hex[:8]}"
    logs = Path(tempfile.mkdtemp(prefix=f"motir-fleet-{mode}-"))
    bouncer = PgBouncer(direct_url, pool_size=pool_size).start() if mode == "pgbouncer" else None
    url = bouncer.url(DB) if bouncer is not None else direct_url
    env = child_env(MOTIR_DATABASE_URL=url, MOTIR_QUEUE=queue, MOTIR_IMPORTS="bench.fleet_jobs",
                    MOTIR_PREPARED_STATEMENTS="0" if bouncer is not None else "1", PYTHONUNBUFFERED="1")
    env.pop("MOTIR_APP_DATABASE_URL", None)
    settings = Settings.from_env(env)
    fleet: list[subprocess.Popen[bytes]] = []
    sampler = Sampler(direct_url, bouncer)
    try:
        fleet = _start_fleet(hosts, procs, env, queue, logs)
        sampler.start()
        t0 = time.monotonic()
        _feed(runs, settings)
        deadline = t0 + timeout
        while (c := _counts(direct_url))["succeeded"] < runs:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{mode}: {c['succeeded']}/{runs} runs succeeded after {timeout:.0f}s ({c})")
            if any(p.poll() is not None for p in fleet):
                raise RuntimeError(f"{mode}: a worker exited; logs in {logs}")
            time.sleep(0.2)
        seconds = time.monotonic() - t0
        peaks = sampler.stop()
        stats = bouncer.show("STATS") if bouncer is not None else []
    finally:
        try:
            sampler.stop()
        finally:
            try:
                _stop_fleet(fleet)
            finally:
                dispose_engines()
                reset_settings()
                if bouncer is not None:
                    bouncer.stop()
    c = _counts(direct_url)
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


def _machine() -> str:
    cores = os.cpu_count()
    try:
        with psycopg.connect(_dsn(server_url()), autocommit=True) as conn:
            row = conn.execute("SHOW server_version").fetchone()
            pg = row[0].split()[0] if row else "?"
    except Exception:  # noqa: BLE001
        pg = "?"
    from tests.pgbouncer import binary

    version = "?"
    if (exe := binary()) is not None:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
        version = (re.findall(r"PgBouncer (\S+)", out) or ["?"])[0]
    return (f"{platform.machine()}, {cores} cores shared with other work, Postgres {pg}, PgBouncer {version}, "
            f"Python {platform.python_version()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5000)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--procs", type=int, default=2, help="prefork processes per host (-c)")
    parser.add_argument("--pool-size", type=int, default=4, help="PgBouncer default_pool_size")
    parser.add_argument("--direct-runs", type=int, default=None, help="runs of the direct comparison (default: --runs)")
    parser.add_argument("--no-direct", action="store_true", help="skip the direct comparison")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--no-write", action="store_true", help="print the table, leave docs/scaling.md")
    args = parser.parse_args(argv)
    if not os.environ.get("MOTIR_DATABASE_URL") or not os.environ.get("CELERY_BROKER_URL"):
        parser.error("MOTIR_DATABASE_URL and CELERY_BROKER_URL must be set")
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(["python -m bench.fleet", *(sys.argv[1:] if argv is None else argv)])
    direct_url = _create_database()
    results = []
    try:
        plan = [("pgbouncer", args.runs)] + ([] if args.no_direct else [("direct", args.direct_runs or args.runs)])
        for mode, runs in plan:
            print(f"fleet: {mode}, {args.hosts} hosts x {args.procs} processes, {runs} runs ...", file=sys.stderr)
            result = run_fleet(mode, direct_url=direct_url, runs=runs, hosts=args.hosts, procs=args.procs,
                               pool_size=args.pool_size, timeout=args.timeout)
            print(_row(result), file=sys.stderr)
            for line in result.log_errors[:10]:
                print(f"fleet: log error: {line}", file=sys.stderr)
            results.append(result)
    finally:
        drop_database(DB)
    block = render(results, command=command, started=started, machine=_machine())
    print(block)
    if not args.no_write:
        write_block("bench.fleet", block)
        print(f"fleet: wrote {SCALING_DOC.relative_to(ROOT)}", file=sys.stderr)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
