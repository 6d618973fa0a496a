"""What one Postgres carries (issue 19): the database's work per run, and a model of the bounds.

    python -m bench.pgcost [--runs 2000 --procs 1,2,4] [--no-checkpoint-point] [--no-write]

Needs CELERY_BROKER_URL and Debian's Postgres binaries (a private server, ``SERVER_SETTINGS``).
Per point: a producer phase (``send_event`` one by one, as a login of its own, messages held back)
and a drain phase (published, drained by a warm worker), each between two snapshots of
``pg_stat_statements``, ``pg_stat_wal``, ``pg_stat_database``, the XIDs, the WAL (``pg_waldump``)
and the whole server's CPU; docs/scaling.md says how to read them.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from bench import harness as h

DB, PRODUCER, MONITOR = "motir_bench_pgcost", "motir_bench_producer", "motir_bench_monitor"
JOB, WARMUP = "bench.three", 50
SERVER_SETTINGS = (
    "fsync=on", "full_page_writes=on", "synchronous_commit=on",
    "shared_preload_libraries=pg_stat_statements", "pg_stat_statements.track=all", "track_io_timing=on",
    "track_wal_io_timing=on", "checkpoint_timeout=30min", "max_wal_size=8GB",
)
#: pg_stat_statements' counters summed per statement (the names are its columns).
PGSS = ("calls", "total_exec_time", "shared_blks_hit", "shared_blks_read", "shared_blks_dirtied",
        "shared_blks_written", "wal_records", "wal_fpi", "wal_bytes")
TX_CONTROL = re.compile(r"^\s*(BEGIN|COMMIT|ROLLBACK|START TRANSACTION|SAVEPOINT|RELEASE)\b", re.I)
#: An idle backend that flushed its statistics less than a second ago flushes the rest after
#: 10 s (PGSTAT_IDLE_INTERVAL); one that exits flushes at once.
IDLE_FLUSH = 11.0
# DBOS's and Hatchet's published figures (docs/scaling.md cites them)
DBOS_URL = "https://www.dbos.dev/blog/benchmarking-workflow-execution-scalability-on-postgres"
DBOS_WORKFLOWS_S, DBOS_WRITES_S, DBOS_VCPUS = 43_000, 144_000, 96
HATCHET_URL = "https://news.ycombinator.com/item?id=43572733"
HATCHET_TX_PER_TASK = 5


@dataclass
class Snap:
    at: float
    lsn: str
    wal: dict[str, float]
    db: dict[str, int]
    xid: int
    cpu: h.Reading


def snapshot(admin: psycopg.Connection[Any], postmaster: int, mine: tuple[int, ...]) -> Snap:
    wal = admin.execute("SELECT wal_records, wal_fpi, wal_bytes, wal_buffers_full, wal_write, wal_sync,"
                        " wal_write_time, wal_sync_time FROM pg_stat_wal").fetchone()
    db = admin.execute("SELECT xact_commit, xact_rollback, blks_hit, blks_read FROM pg_stat_database"
                       " WHERE datname = %s", (DB,)).fetchone()
    lsn, lsn_bytes, xid = admin.execute(
        "SELECT pg_current_wal_lsn()::text, pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint,"
        " pg_snapshot_xmax(pg_current_snapshot())::text::bigint").fetchone()  # type: ignore[misc]
    assert wal is not None and db is not None
    names = ("records", "fpi", "bytes", "buffers_full", "write", "sync", "write_time", "sync_time")
    return Snap(time.monotonic(), lsn, {**dict(zip(names, map(float, wal))), "lsn_bytes": float(lsn_bytes)},
                dict(zip(("commit", "rollback", "hit", "read"), map(int, db))), int(xid),
                h.read_cpu([postmaster], exclude=mine))


def read_statements(admin: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    """Top-level statements of the bench database since the last reset, with their login."""
    rows = admin.execute(
        f"SELECT r.rolname, s.query, {', '.join(f's.{c}' for c in PGSS)} FROM pg_stat_statements s"
        " JOIN pg_roles r ON r.oid = s.userid"
        " WHERE s.toplevel AND s.dbid = (SELECT oid FROM pg_database WHERE datname = %s)", (DB,)).fetchall()
    return [{"role": r[0], "query": r[1], **dict(zip(PGSS, map(float, r[2:])))} for r in rows]


def waldump(bindir: Path, data: Path, start: str, end: str) -> dict[str, tuple[int, int, int]]:
    """``pg_waldump --stats=record``: record type -> (count, record bytes, FPI bytes); key ``Total``."""
    out = subprocess.run([str(bindir / "pg_waldump"), "-p", str(data / "pg_wal"), "-s", start, "-e", end,
                          "--stats=record"], capture_output=True, text=True, timeout=120)
    row = re.compile(r"^(\S+)\s+(\d+)\s+\(\s*[\d.]+\)\s+(\d+)\s+\(\s*[\d.]+\)\s+(\d+)\s+\(")
    total = re.compile(r"^(Total)\s+(\d+)\s+(\d+)\s+\[[\d.]+%\]\s+(\d+)\s+\[")
    return {m[1]: (int(m[2]), int(m[3]), int(m[4])) for line in out.stdout.splitlines()
            if (m := total.match(line) or row.match(line))}


@dataclass
class Phase:
    """One measured window (producer or drain) of ``runs`` runs."""

    runs: int
    seconds: float
    statements: list[dict[str, Any]]
    wal: dict[str, float]
    commits: int
    xids: int
    cpu_ms: float
    background_cpu_ms: float
    walstats: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    @classmethod
    def between(cls, a: Snap, b: Snap, runs: int, statements: list[dict[str, Any]],
                walstats: dict[str, tuple[int, int, int]], polls: int) -> "Phase":
        """The live children but client backends (of the bench database, or of the ``postgres``
        login) are the server's background processes: checkpointer, WAL writer, autovacuum..."""
        background = [pid for pid in b.cpu.ticks if pid != b.cpu.roots[0]
                      and f" {DB} " not in f"{h.cmdline(pid)} " and "postgres postgres" not in h.cmdline(pid)]
        return cls(runs, b.at - a.at, [s for s in statements if s["role"] != MONITOR],
                   {k: b.wal[k] - a.wal[k] for k in a.wal}, b.db["commit"] - a.db["commit"] - polls,
                   b.xid - a.xid, h.cpu_ms(a.cpu, b.cpu), h.cpu_ms(a.cpu, b.cpu, only=background), walstats)


@dataclass
class Point:
    procs: int
    runs: int
    rate: float  # runs/s over the drain's 5%..95% span
    producer: Phase
    drain: Phase
    checkpoint_between: bool = False

    @property
    def label(self) -> str:
        return f"{self.procs}, backlog across a `CHECKPOINT`" if self.checkpoint_between else str(self.procs)

    def per_run(self, key: str) -> float:
        return (getattr(self.producer, key) + getattr(self.drain, key)) / self.runs

    def wal_per_run(self, key: str) -> float:
        return (self.producer.wal[key] + self.drain.wal[key]) / self.runs

    def stmt_per_run(self, key: str = "calls", *, control: bool = True) -> float:
        return sum(s[key] for p in (self.producer, self.drain) for s in p.statements
                   if control or not TX_CONTROL.match(s["query"])) / self.runs

    def flush_ms(self) -> float:
        syncs = self.producer.wal["sync"] + self.drain.wal["sync"]
        return (self.producer.wal["sync_time"] + self.drain.wal["sync_time"]) / syncs if syncs else float("nan")

    def fpi_bytes_share(self) -> float:
        totals = [t for p in (self.producer, self.drain) if (t := p.walstats.get("Total"))]
        rec, fpi = sum(t[1] for t in totals), sum(t[2] for t in totals)
        return fpi / (rec + fpi) if rec + fpi else float("nan")


def _gone(admin: psycopg.Connection[Any], login: str, timeout: float = 60) -> None:
    """Wait until no backend of ``login`` is connected to the bench database (then a moment for the
    postmaster to reap them: their CPU is in its cutime once reaped)."""
    deadline = time.monotonic() + timeout
    while admin.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND usename = %s",
                        (DB, login)).fetchone()[0]:  # type: ignore[index]
        if time.monotonic() > deadline:
            raise TimeoutError(f"backends of {login} still connected after {timeout:.0f}s")
        time.sleep(0.1)
    time.sleep(0.5)


def measure(pg: Any, admin: psycopg.Connection[Any], db: h.Database, producer_url: str, queue: str, procs: int,
            runs: int, timeout: float, *, checkpoint_between: bool = False) -> Point:
    from motir_celery.store.db import dispose_engines

    motir = h.Motir(db, queue=queue, sender_url=producer_url)
    motir.reset()
    admin.execute("CHECKPOINT")
    data = lambda n: {"n": n, "workspace_id": f"ws-{n % 8}"}  # noqa: E731
    mine = (db.monitor_pid, admin.info.backend_pid)  # the bench's own backends: left out of the CPU
    with motir.workers(1, procs, f"pgcost{procs}") as workers:
        h.publish_runs(h.send(WARMUP, JOB, data=data), JOB)
        h.settle(motir, workers, WARMUP, timeout=180)
        dispose_engines()
        time.sleep(IDLE_FLUSH)  # the workers' backends stay: their warm-up statistics must be in s0
        admin.execute("SELECT pg_stat_statements_reset()")
        s0 = snapshot(admin, pg.postmaster, mine)
        ids = h.send(runs, JOB, offset=WARMUP, data=data)
        dispose_engines()  # the producer's backend exits: its statistics are flushed
        _gone(admin, PRODUCER)
        produced = read_statements(admin)
        if checkpoint_between:  # the backlog's pages were last written before a checkpoint
            admin.execute("CHECKPOINT")
        admin.execute("SELECT pg_stat_statements_reset()")
        s1 = snapshot(admin, pg.postmaster, mine)
        polls = db.polls
        h.publish_runs(ids, JOB)
        h.settle(motir, workers, WARMUP + runs, timeout=timeout, poll=0.2)
        polls = db.polls - polls
    _gone(admin, "postgres")  # the workers stopped: their backends exited, statistics flushed
    drained = read_statements(admin)
    s2 = snapshot(admin, pg.postmaster, mine)
    producer = Phase.between(s0, s1, runs, produced, waldump(pg.bindir, pg.data, s0.lsn, s1.lsn), 0)
    drain = Phase.between(s1, s2, runs, drained, waldump(pg.bindir, pg.data, s1.lsn, s2.lsn), polls)
    return Point(procs, runs, h.drain_rate(db.finished(ids).values()), producer, drain, checkpoint_between)


def start_server(pg: Any) -> tuple[h.Database, str]:
    """The bench database on the private server, migrated, and the producer's login; (database, producer URL)."""
    with h.connect(pg.url()) as c:
        c.execute(f'CREATE DATABASE "{DB}"')
        c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")  # the admin's reads and resets
        for role in (PRODUCER, MONITOR):
            c.execute(f'CREATE ROLE "{role}" LOGIN SUPERUSER')
    worker_url = pg.url(DB)
    with h.connect(worker_url) as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    from motir_celery.store.migrate import upgrade

    upgrade(worker_url)
    db = h.Database(worker_url, monitor_url=worker_url.replace("//postgres@", f"//{MONITOR}@", 1))
    return db, worker_url.replace("//postgres@", f"//{PRODUCER}@", 1)


# --- the model and the report ---------------------------------------------------------------------


@dataclass
class Assumptions:
    host_procs: int = 8
    vcpus: tuple[int, ...] = (16, 32, 96)
    cpu_util: float = 0.7
    wal_mbps: tuple[float, ...] = (100.0, 300.0)
    commits_per_vcpu: float = DBOS_WRITES_S / DBOS_VCPUS
    proc_rate: float | None = None  # runs/s of one worker process; None: the 1-process point's


def _n(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def _row(*cells: Any) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def render(points: list[Point], a: Assumptions, *, command: str, started: str, machine: str,
           seconds: float) -> str:
    # The model: medians over the plain points (the backlog-across-a-checkpoint one is the WAL's worst case).
    plain = [p for p in points if not p.checkpoint_between] or points
    worst = next((p for p in points if p.checkpoint_between), None)
    cpu_ms, wal_bytes, commits, writes = (statistics.median(f(p) for p in plain) for f in (
        lambda p: p.per_run("cpu_ms"), lambda p: p.wal_per_run("lsn_bytes"), lambda p: p.per_run("commits"),
        lambda p: p.per_run("xids")))
    one = min(plain, key=lambda p: p.procs)
    per_proc = a.proc_rate or one.rate / one.procs
    big = max(plain, key=lambda p: p.procs)
    lines = [
        f"Measured {started} on {machine}, with `{command}` ({seconds / 60:.1f} min): {points[0].runs:,} runs "
        f"per point after {WARMUP} warm-up runs.", "",
        "**Work per run** (Postgres side only; statements are top-level `pg_stat_statements` calls, "
        "transaction control included, then without it)", "",
        "| worker processes | runs/s (drain) | statements | without BEGIN/COMMIT | commits | of which wrote (XIDs) "
        "| WAL bytes | WAL records | full-page images | FPI share of WAL bytes | WAL flushes (`wal_sync`) | ms per flush "
        "| shared hit | read | dirtied | written | Postgres CPU ms | of which background |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(_row(p.label, _n(p.rate), f"{p.stmt_per_run():.2f}", f"{p.stmt_per_run(control=False):.2f}",
               f"{p.per_run('commits'):.2f}", f"{p.per_run('xids'):.2f}", _n(p.wal_per_run('lsn_bytes')),
               f"{p.wal_per_run('records'):.1f}", f"{p.wal_per_run('fpi'):.2f}", f"{p.fpi_bytes_share():.0%}",
               f"{p.wal_per_run('sync'):.2f}", f"{p.flush_ms():.2f}", f"{p.stmt_per_run('shared_blks_hit'):.1f}",
               *(f"{p.stmt_per_run(f'shared_blks_{k}'):.2f}" for k in ("read", "dirtied", "written")),
               f"{p.per_run('cpu_ms'):.2f}", f"{p.per_run('background_cpu_ms'):.2f}") for p in points),
        "",
        f"Split of the {big.procs}-process point: the producer (`send_event`) and the drain (claim, 3 step "
        "records, settle, sweeps), per run.", "",
        "| phase | statements | commits | of which wrote | WAL bytes | full-page images | Postgres CPU ms |",
        "|---|---|---|---|---|---|---|",
        *(_row(name, f"{sum(s['calls'] for s in ph.statements) / ph.runs:.2f}", f"{ph.commits / ph.runs:.2f}",
               f"{ph.xids / ph.runs:.2f}", _n(ph.wal['lsn_bytes'] / ph.runs), f"{ph.wal['fpi'] / ph.runs:.2f}",
               f"{ph.cpu_ms / ph.runs:.2f}") for name, ph in (("producer", big.producer), ("drain", big.drain))),
    ]
    stmts: dict[tuple[str, str], dict[str, float]] = {}
    kinds: dict[str, list[int]] = {}
    for ph in (big.producer, big.drain):
        for s in ph.statements:
            acc = stmts.setdefault((s["role"], s["query"]), dict.fromkeys(PGSS, 0.0))
            for k in PGSS:
                acc[k] += s[k]
        for k, counts in ph.walstats.items():
            kinds[k] = [x + y for x, y in zip(kinds.get(k, [0, 0, 0]), counts)]
    lines += ["", f"Top statements of the {big.procs}-process point, by calls (then time): per run, and per call.", "",
              "| login | statement | calls / run | mean ms | WAL bytes / call | FPI / call | shared hit / call | read / call |",
              "|---|---|---|---|---|---|---|---|"]
    for (role, query), s in sorted(stmts.items(), key=lambda kv: (-kv[1]["calls"], -kv[1]["total_exec_time"]))[:8]:
        c, q = s["calls"] or 1, " ".join(query.split()).replace("|", "\\|")
        lines.append(_row("producer" if role == PRODUCER else "worker", f"`{q if len(q) <= 90 else q[:89] + '…'}`",
                          f"{s['calls'] / big.runs:.2f}", f"{s['total_exec_time'] / c:.3f}", _n(s['wal_bytes'] / c),
                          f"{s['wal_fpi'] / c:.2f}", f"{s['shared_blks_hit'] / c:.1f}", f"{s['shared_blks_read'] / c:.2f}"))
    total = kinds.pop("Total", [0, 0, 0])
    if total[1] + total[2]:
        lines += ["", f"What the WAL of the {big.procs}-process point is made of (`pg_waldump --stats=record`), per run:",
                  "", "| record type | records | record bytes | full-page image bytes | share of WAL bytes |",
                  "|---|---|---|---|---|"]
        lines += [_row(f"`{k}`", f"{n / big.runs:.2f}", _n(rec / big.runs), _n(fpi / big.runs),
                       f"{(rec + fpi) / (total[1] + total[2]):.0%}")
                  for k, (n, rec, fpi) in sorted(kinds.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:8]]
        lines.append(_row("all", f"{total[0] / big.runs:.2f}", _n(total[1] / big.runs), _n(total[2] / big.runs), "100%"))
    host = a.host_procs * per_proc
    lines += [
        "",
        "**The model** (medians of the points above): "
        f"{cpu_ms:.2f} Postgres CPU ms, {_n(wal_bytes)} WAL bytes, {commits:.2f} commits ({writes:.2f} that wrote) per run →",
        "", "| | value |", "|---|---|",
        f"| runs/s per fully busy Postgres vCPU (1000 / CPU ms per run) | **{_n(1000 / cpu_ms)}** |",
        f"| runs/s per WAL MB/s (10⁶ / WAL bytes per run) | **{_n(1e6 / wal_bytes)}** |",
        *([f"| the same, backlog across a checkpoint ({_n(worst.wal_per_run('lsn_bytes'))} WAL bytes per run) "
           f"| {_n(1e6 / worst.wal_per_run('lsn_bytes'))} |"] if worst else []),
        f"| commits/s per 1,000 runs/s (of which wrote) | {_n(1000 * commits)} ({_n(1000 * writes)}) |",
        f"| a worker process ({'given' if a.proc_rate else 'measured here, the 1-process point'}) | {_n(per_proc)} runs/s |",
        f"| a worker host (assumed: {a.host_procs} such processes) | {_n(host)} runs/s |",
        "",
        f"Worker hosts one primary carries. Assumptions (options of the bench): a host is {a.host_procs} "
        f"worker processes at the rate above; Postgres may use {a.cpu_util:.0%} of its vCPUs (the rest: "
        "dashboards, `motir purge`, spikes); a sustained WAL rate of "
        f"{' or '.join(_n(w) for w in a.wal_mbps)} MB/s (the disk and the standbys' replay); writing commits "
        f"at {_n(a.commits_per_vcpu)}/s per vCPU (DBOS's {_n(DBOS_WRITES_S)} single-row insert transactions/s "
        f"on {DBOS_VCPUS} vCPUs). Every bound is linear in its resource.",
        "",
        "| primary | CPU bound, runs/s | " + " | ".join(f"WAL bound at {_n(w)} MB/s" for w in a.wal_mbps)
        + " | commit bound, runs/s | binds first | runs/s | worker hosts |",
        "|---|---|" + "---|" * len(a.wal_mbps) + "---|---|---|---|",
    ]
    for v in a.vcpus:
        bounds = {"CPU": v * a.cpu_util * 1000 / cpu_ms, **{f"WAL {_n(w)} MB/s": w * 1e6 / wal_bytes for w in a.wal_mbps},
                  "commits": v * a.commits_per_vcpu / writes}
        first = min(bounds, key=lambda k: bounds[k])
        lines.append(_row(f"{v} vCPUs", *map(_n, bounds.values()), first, _n(bounds[first]),
                          f"**{bounds[first] / host:,.0f}**"))
    lines += [
        "", "Compared:", "",
        "| system | published or measured | transactions per run / task | runs/s per database vCPU |",
        "|---|---|---|---|",
        f"| DBOS ([blog]({DBOS_URL})) | {_n(DBOS_WORKFLOWS_S)} workflows/s and {_n(DBOS_WRITES_S)} writes/s on "
        f"an RDS db.m7i.24xlarge, {DBOS_VCPUS} vCPUs | ≈ {DBOS_WRITES_S / DBOS_WORKFLOWS_S:.1f} writes per "
        f"workflow (their two figures' ratio) | ≈ {_n(DBOS_WORKFLOWS_S / DBOS_VCPUS)} (throughput ÷ vCPUs, at whatever "
        "utilisation they reached) |",
        f"| Hatchet ([Show HN, v1]({HATCHET_URL})) | \"at minimum {HATCHET_TX_PER_TASK} Postgres transactions\" "
        f"per task (5k tasks/s ≈ 25k transactions/s) | ≥ {HATCHET_TX_PER_TASK} | — |",
        f"| motir-celery (measured here, {JOB}) | {_n(max(p.rate for p in points))} runs/s at best on 2 shared "
        f"cores | {commits:.2f} commits, {writes:.2f} that wrote | {_n(1000 / cpu_ms)} per fully busy "
        f"vCPU; {_n(1000 / cpu_ms * a.cpu_util)} at {a.cpu_util:.0%} |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = h.parser("bench.pgcost", __doc__)
    parser.add_argument("--runs", type=int, default=2000, help="measured runs per point")
    parser.add_argument("--procs", default="1,2,4", help="worker processes per point (prefork -c)")
    parser.add_argument("--host-procs", type=int, default=Assumptions.host_procs)
    parser.add_argument("--vcpus", default="16,32,96")
    parser.add_argument("--cpu-util", type=float, default=Assumptions.cpu_util)
    parser.add_argument("--wal-mbps", default="100,300")
    parser.add_argument("--commits-per-vcpu", type=float, default=Assumptions.commits_per_vcpu)
    parser.add_argument("--proc-rate", type=float, default=None,
                        help="runs/s of one worker process in the model (default: the 1-process point's)")
    parser.add_argument("--no-checkpoint-point", action="store_true",
                        help="skip the extra point whose backlog spans a CHECKPOINT")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)
    h.need("CELERY_BROKER_URL")
    assumptions = Assumptions(args.host_procs, tuple(int(v) for v in args.vcpus.split(",")), args.cpu_util,
                              tuple(float(w) for w in args.wal_mbps.split(",")), args.commits_per_vcpu,
                              args.proc_rate)
    procs = [int(p) for p in args.procs.split(",")]
    started, command, t0, log = h.now(), h.command("bench.pgcost", argv), time.monotonic(), h.logger("pgcost")
    queue, points = f"bench-pgcost-{uuid.uuid4().hex[:8]}", []
    with h.private_postgres(*SERVER_SETTINGS) as pg, h.connect(pg.url()) as admin:
        machine = h.machine(pg.url(), load=True)
        db, producer_url = start_server(pg)
        h.use_engine(producer_url, queue)  # the producer sends as a login of its own
        try:
            for n, between in [(n, False) for n in procs] + ([] if args.no_checkpoint_point else [(max(procs), True)]):
                log(f"{n} worker process(es), {args.runs} runs{' across a checkpoint' * between} ...")
                points.append(p := measure(pg, admin, db, producer_url, queue, n, args.runs, args.timeout,
                                           checkpoint_between=between))
                log(f"{n}: {p.rate:.0f} runs/s, {p.per_run('cpu_ms'):.2f} CPU ms/run, "
                    f"{p.wal_per_run('lsn_bytes'):.0f} WAL B/run, {p.per_run('commits'):.2f} commits/run")
        finally:
            from motir_celery.store.db import dispose_engines

            db.close()
            dispose_engines()
            h.purge_queue(queue)
    block = render(points, assumptions, command=command, started=started, machine=machine,
                   seconds=time.monotonic() - t0)
    h.write_block("bench.pgcost", block, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
