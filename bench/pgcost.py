"""What one Postgres carries (issue 19): the database's work per run, and a model of the bounds.

    python -m bench.pgcost                      # 1, 2 and 4 worker processes (+ 4 across a checkpoint), 2,000 runs each
    python -m bench.pgcost --runs 300 --procs 1,2 --no-write

Needs CELERY_BROKER_URL (Redis; a queue of its own, ``bench-pgcost-<random>``). It does
**not** use the machine's Postgres: it starts a private server of its own
(``tests.chaos.harness.PrivatePostgres``) with ``fsync``, ``full_page_writes`` and
``synchronous_commit`` on (realistic WAL and commits), ``pg_stat_statements`` preloaded
(``track=all``), ``track_io_timing`` on, and ``checkpoint_timeout`` / ``max_wal_size``
large enough that no checkpoint falls inside a measurement. The server is stopped and
its folder removed at the end, also on error.

The job is ``bench.three`` (``bench/workload.py``): an event-triggered job of three
trivial steps, the suite's representative workload. Each point runs **one** ``celery
worker -P prefork -c N`` (one host of N processes). Per point:

1. empty the tables, ``CHECKPOINT`` (every point starts at the same place of the
   checkpoint cycle: the first write of a page after it is a full-page image);
2. start the worker, drain 50 warm-up runs (connections, prepared statements and
   caches are made outside the measurement);
3. **producer**: ``--runs`` events sent one by one with ``send_event`` (one transaction
   each, as an application sends them), as a login of its own (``motir_bench_producer``,
   a superuser like the workers' ``postgres``), so ``pg_stat_statements`` tells its
   statements from the workers'. Messages are published only after this phase (Redis
   only: no database work), so the producer and the drain are measured apart;
4. **drain**: the messages are published and the warm worker drains them.

Between snapshots: ``pg_stat_statements`` is reset and read (top-level statements of the
bench database), and deltas are taken of ``pg_stat_wal``, ``pg_stat_database``
(``xact_commit``), ``pg_current_wal_lsn()``, the XIDs assigned
(``pg_snapshot_xmax(pg_current_snapshot())``: transactions that wrote) and the server's
CPU. ``pg_waldump --stats=record`` over the measured WAL gives its make-up (full-page
images against records, by record type). A snapshot is taken 2 s after the last
transaction, so the backends' cumulative statistics (flushed at most once a second by an
idle backend) are in it.

Postgres CPU is utime + stime from ``/proc/<pid>/stat`` (clock ticks) of: the postmaster
itself, every live child of the postmaster (client backends, checkpointer, background
writer, WAL writer, autovacuum launcher and workers, stats) at both ends, plus the
postmaster's cutime + cstime (the children it reaped during the window: short-lived
backends and autovacuum workers are not lost).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg

from bench.common import celery_workers, child_env, purge, succeeded, truncate, wait_for, write_block

DB = "motir_bench_pgcost"
PRODUCER = "motir_bench_producer"
MONITOR = "motir_bench_monitor"
JOB = "bench.three"
WARMUP = 50
TICKS = os.sysconf("SC_CLK_TCK")
SERVER_SETTINGS = (
    "fsync=on", "full_page_writes=on", "synchronous_commit=on",
    "shared_preload_libraries=pg_stat_statements", "pg_stat_statements.track=all", "track_io_timing=on",
    "track_wal_io_timing=on", "checkpoint_timeout=30min", "max_wal_size=8GB",
)
#: pg_stat_statements' counters summed per statement (the names are its columns).
PGSS = ("calls", "total_exec_time", "shared_blks_hit", "shared_blks_read", "shared_blks_dirtied",
        "shared_blks_written", "wal_records", "wal_fpi", "wal_bytes")
TX_CONTROL = re.compile(r"^\s*(BEGIN|COMMIT|ROLLBACK|START TRANSACTION|SAVEPOINT|RELEASE)\b", re.I)

# --- DBOS's and Hatchet's published figures (docs/scaling.md cites them) -------------------
DBOS_URL = "https://www.dbos.dev/blog/benchmarking-workflow-execution-scalability-on-postgres"
DBOS_WORKFLOWS_S, DBOS_WRITES_S, DBOS_VCPUS = 43_000, 144_000, 96
HATCHET_URL = "https://news.ycombinator.com/item?id=43572733"
HATCHET_TX_PER_TASK = 5


# --- the server's processes -------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


@dataclass
class Cpu:
    """Ticks: the postmaster's own and reaped children's, and each live child's (utime + stime)."""

    postmaster: int
    reaped: int
    live: dict[int, int]
    kinds: dict[int, str]


def server_cpu(postmaster: int) -> Cpu:
    """After ``rsplit(")")``, index 1 is ppid (field 4), 11/12 utime/stime, 13/14 cutime/cstime."""
    own = _stat(postmaster)
    assert own is not None, "the private postmaster is gone"
    live, kinds = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat(int(entry))
        if fields is None or int(fields[1]) != postmaster:
            continue
        pid = int(entry)
        live[pid] = int(fields[11]) + int(fields[12])
        cmd = _cmdline(pid)
        kinds[pid] = "client" if (f" {DB} " in f"{cmd} " or "postgres postgres" in cmd) else "background"
    return Cpu(int(own[11]) + int(own[12]), int(own[13]) + int(own[14]), live, kinds)


def cpu_delta_ms(a: Cpu, b: Cpu, exclude: tuple[int, ...] = ()) -> tuple[float, float]:
    """(total, of which live background processes) in ms between two readings. A child
    that exited in between is in b.reaped whole; its share before ``a`` is taken off.
    ``exclude``: live backends left out (the bench's own monitor and snapshot connections)."""
    gone = sum(t for pid, t in a.live.items() if pid not in b.live)
    total = (b.postmaster - a.postmaster) + (b.reaped - a.reaped) - gone
    total += sum(t - a.live.get(pid, 0) for pid, t in b.live.items() if pid not in exclude)
    background = sum(t - a.live.get(pid, 0) for pid, t in b.live.items() if b.kinds[pid] == "background")
    return total * 1000 / TICKS, background * 1000 / TICKS


# --- snapshots --------------------------------------------------------------------------------


@dataclass
class Snap:
    at: float
    lsn: str
    wal: dict[str, float]
    db: dict[str, int]
    xid: int
    cpu: Cpu


def snapshot(admin: psycopg.Connection[Any], postmaster: int) -> Snap:
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
                dict(zip(("commit", "rollback", "hit", "read"), map(int, db))), int(xid), server_cpu(postmaster))


def read_statements(admin: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    """Top-level statements of the bench database since the last reset, with their login."""
    cols = ", ".join(f"s.{c}" for c in PGSS)
    rows = admin.execute(
        f"SELECT r.rolname, s.query, {cols} FROM pg_stat_statements s JOIN pg_roles r ON r.oid = s.userid"
        " WHERE s.toplevel AND s.dbid = (SELECT oid FROM pg_database WHERE datname = %s)", (DB,)).fetchall()
    return [{"role": r[0], "query": r[1], **dict(zip(PGSS, map(float, r[2:])))} for r in rows]


def waldump(bindir: Path, data: Path, start: str, end: str) -> dict[str, tuple[int, int, int]]:
    """``pg_waldump --stats=record``: record type -> (count, record bytes, FPI bytes); key ``Total``."""
    out = subprocess.run([str(bindir / "pg_waldump"), "-p", str(data / "pg_wal"), "-s", start, "-e", end,
                          "--stats=record"], capture_output=True, text=True, timeout=120)
    stats: dict[str, tuple[int, int, int]] = {}
    row = re.compile(r"^(\S+)\s+(\d+)\s+\(\s*[\d.]+\)\s+(\d+)\s+\(\s*[\d.]+\)\s+(\d+)\s+\(")
    total = re.compile(r"^Total\s+(\d+)\s+(\d+)\s+\[[\d.]+%\]\s+(\d+)\s+\[")
    for line in out.stdout.splitlines():
        if m := total.match(line):
            stats["Total"] = (int(m[1]), int(m[2]), int(m[3]))
        elif m := row.match(line):
            stats[m[1]] = (int(m[2]), int(m[3]), int(m[4]))
    return stats


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
                walstats: dict[str, tuple[int, int, int]], exclude: tuple[int, ...], polls: int) -> "Phase":
        cpu, background = cpu_delta_ms(a.cpu, b.cpu, exclude)
        return cls(runs, b.at - a.at, [s for s in statements if s["role"] != MONITOR],
                   {k: b.wal[k] - a.wal[k] for k in a.wal}, b.db["commit"] - a.db["commit"] - polls,
                   b.xid - a.xid, cpu, background, walstats)


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

    def total(self, key: str) -> float:
        return getattr(self.producer, key) + getattr(self.drain, key)

    def per_run(self, key: str) -> float:
        return self.total(key) / self.runs

    def wal_per_run(self, key: str) -> float:
        return (self.producer.wal[key] + self.drain.wal[key]) / self.runs

    def stmt_per_run(self, key: str = "calls", *, control: bool = True, role: str | None = None) -> float:
        rows = [s for p in (self.producer, self.drain) for s in p.statements
                if (control or not TX_CONTROL.match(s["query"])) and (role is None or s["role"] == role)]
        return sum(s[key] for s in rows) / self.runs

    def flush_ms(self) -> float:
        syncs = self.producer.wal["sync"] + self.drain.wal["sync"]
        return (self.producer.wal["sync_time"] + self.drain.wal["sync_time"]) / syncs if syncs else float("nan")

    def fpi_bytes_share(self) -> float:
        totals = [p.walstats.get("Total") for p in (self.producer, self.drain)]
        rec = sum(t[1] for t in totals if t)
        fpi = sum(t[2] for t in totals if t)
        return fpi / (rec + fpi) if rec + fpi else float("nan")


# --- the measurement ----------------------------------------------------------------------------


class Monitor:
    """How many runs succeeded, polled on one connection of its own login (``motir_bench_monitor``):
    its statements are left out of ``pg_stat_statements``' figures, its transactions counted and
    taken off the commits, its backend's CPU taken off the server's."""

    def __init__(self, port: int) -> None:
        self.conn = psycopg.connect(f"host=127.0.0.1 port={port} user={MONITOR} dbname={DB}", autocommit=True)
        self.pid = int(self.conn.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
        self.polls = 0

    def succeeded(self) -> int:
        self.polls += 1
        row = self.conn.execute("SELECT count(*) FROM job_queue WHERE state = 'succeeded'").fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        self.conn.close()


#: An idle backend that flushed its statistics less than a second ago flushes the rest after
#: 10 s (PGSTAT_IDLE_INTERVAL); one that exits flushes at once.
IDLE_FLUSH = 11.0


def _quiet(seconds: float) -> None:
    time.sleep(seconds)


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


def _send(runs: int, offset: int) -> list[uuid.UUID]:
    """``runs`` events, one ``send_event`` (one transaction) each, messages not published."""
    from motir_celery.core.producer.events import send_event

    ids: list[uuid.UUID] = []
    for n in range(offset, offset + runs):
        ids.extend(send_event(JOB, {"n": n, "workspace_id": f"ws-{n % 8}"}, publish=None).run_ids)
    return ids


def _publish(ids: list[uuid.UUID]) -> None:
    from motir_celery.adapter.celery_app import default_app, publisher

    publish = publisher(default_app())
    for run_id in ids:
        publish(run_id, JOB, 0.0)


def _finished(url: str, ids: list[uuid.UUID]) -> list[float]:
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://", 1), autocommit=True) as conn:
        rows = conn.execute("SELECT extract(epoch FROM finished_at)::float8, state FROM job_queue"
                            " WHERE id = ANY(%s)", ([str(i) for i in ids],)).fetchall()
    bad = [r for r in rows if r[1] != "succeeded"]
    if bad or len(rows) != len(ids):
        raise RuntimeError(f"{len(bad)} runs did not succeed, {len(ids) - len(rows)} missing")
    return [float(r[0]) for r in rows]


def measure(pg: Any, admin: psycopg.Connection[Any], worker_url: str, queue: str, procs: int,
            runs: int, timeout: float, *, checkpoint_between: bool = False) -> Point:
    from bench.stats import drain_rate
    from motir_celery.adapter.celery_app import default_app
    from motir_celery.store.db import dispose_engines

    postmaster = int((pg.data / "postmaster.pid").read_text().split()[0])
    truncate(worker_url)
    purge(default_app(), queue)
    admin.execute("CHECKPOINT")
    env = child_env(MOTIR_DATABASE_URL=worker_url, PYTHONUNBUFFERED="1")
    tag = f"pgcost{procs}"
    monitor = Monitor(pg.port)
    try:
        with celery_workers("motir_celery", queue, 1, procs, env, tag=tag) as workers:
            _publish(_send(WARMUP, 0))
            wait_for(lambda: succeeded(worker_url) >= WARMUP, workers, timeout=180, tag=tag)
            dispose_engines()
            _quiet(IDLE_FLUSH)  # the workers' backends stay: their warm-up statistics must be in s0
            admin.execute("SELECT pg_stat_statements_reset()")
            s0 = snapshot(admin, postmaster)
            ids = _send(runs, WARMUP)
            dispose_engines()  # the producer's backend exits: its statistics are flushed
            _gone(admin, PRODUCER)
            produced = read_statements(admin)
            if checkpoint_between:  # the backlog's pages were last written before a checkpoint
                admin.execute("CHECKPOINT")
            admin.execute("SELECT pg_stat_statements_reset()")
            s1 = snapshot(admin, postmaster)
            _publish(ids)
            wait_for(lambda: monitor.succeeded() >= WARMUP + runs, workers, timeout=timeout, tag=tag, poll=0.2)
            polls = monitor.polls
        _gone(admin, "postgres")  # the workers stopped: their backends exited, statistics flushed
        drained = read_statements(admin)
        s2 = snapshot(admin, postmaster)
        mine = (monitor.pid, int(admin.execute("SELECT pg_backend_pid()").fetchone()[0]))  # type: ignore[index]
        producer = Phase.between(s0, s1, runs, produced, waldump(pg.bindir, pg.data, s0.lsn, s1.lsn), mine, 0)
        drain = Phase.between(s1, s2, runs, drained, waldump(pg.bindir, pg.data, s1.lsn, s2.lsn), mine, polls)
    finally:
        monitor.close()
    return Point(procs, runs, drain_rate(_finished(worker_url, ids)), producer, drain, checkpoint_between)


def start_server() -> tuple[Any, str, str]:
    """The private server, its bench database migrated, the producer's login; (server, worker URL, producer URL)."""
    from motir_celery.store.migrate import upgrade
    from tests.chaos.harness import PrivatePostgres

    pg = PrivatePostgres(settings=SERVER_SETTINGS)
    try:
        pg.init()
        with psycopg.connect(f"host=127.0.0.1 port={pg.port} user=postgres dbname=postgres", autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{DB}"')
            c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            c.execute(f'CREATE ROLE "{PRODUCER}" LOGIN SUPERUSER')
            c.execute(f'CREATE ROLE "{MONITOR}" LOGIN SUPERUSER')
        worker_url = pg.url(DB)
        with psycopg.connect(f"host=127.0.0.1 port={pg.port} user=postgres dbname={DB}", autocommit=True) as c:
            c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        upgrade(worker_url)
    except BaseException:
        pg.close()
        raise
    return pg, worker_url, worker_url.replace("//postgres@", f"//{PRODUCER}@", 1)


# --- the model ------------------------------------------------------------------------------------


@dataclass
class Assumptions:
    host_procs: int = 8
    vcpus: tuple[int, ...] = (16, 32, 96)
    cpu_util: float = 0.7
    wal_mbps: tuple[float, ...] = (100.0, 300.0)
    commits_per_vcpu: float = DBOS_WRITES_S / DBOS_VCPUS
    proc_rate: float | None = None  # runs/s of one worker process; None: the 1-process point's


@dataclass
class Model:
    cpu_ms: float
    wal_bytes: float
    commits: float
    writes: float
    per_proc: float

    @property
    def runs_per_vcpu(self) -> float:
        return 1000 / self.cpu_ms

    @property
    def runs_per_wal_mbps(self) -> float:
        return 1e6 / self.wal_bytes


def build_model(all_points: list[Point], proc_rate: float | None = None) -> Model:
    """Medians over the plain points (the backlog-across-a-checkpoint one is the WAL's worst case)."""
    med = statistics.median
    points = [p for p in all_points if not p.checkpoint_between] or all_points
    one = min(points, key=lambda p: p.procs)
    return Model(cpu_ms=med(p.per_run("cpu_ms") for p in points),
                 wal_bytes=med(p.wal_per_run("lsn_bytes") for p in points),
                 commits=med(p.per_run("commits") for p in points),
                 writes=med(p.per_run("xids") for p in points),
                 per_proc=proc_rate or one.rate / one.procs)


# --- the report -----------------------------------------------------------------------------------


def _n(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def _short(query: str, width: int = 90) -> str:
    q = " ".join(query.split()).replace("|", "\\|")
    return q if len(q) <= width else q[: width - 1] + "…"


def render(points: list[Point], a: Assumptions, *, command: str, started: str, machine: str,
           seconds: float) -> str:
    m = build_model(points, a.proc_rate)
    worst = next((p for p in points if p.checkpoint_between), None)
    lines = [
        f"Measured {started} on {machine}, with `{command}` ({seconds / 60:.1f} min). A private Postgres 15 "
        "(`fsync`, `full_page_writes`, `synchronous_commit` on; `pg_stat_statements` preloaded), "
        f"job `{JOB}` (an event-triggered job of 3 trivial steps), one `celery worker -P prefork -c N` "
        f"per point, {points[0].runs:,} runs per point after {WARMUP} warm-up runs, each point right after "
        "a `CHECKPOINT` on empty tables. Per run = the producer (one `send_event` per run, one transaction, "
        "messages held back) + the drain (the messages published, the warm worker drains them). The row "
        "*backlog across a `CHECKPOINT`* has one more `CHECKPOINT` between the two: the drain then updates "
        "pages last written before a checkpoint (a backlog older than the checkpoint interval), the WAL's "
        "worst case. Postgres CPU is utime + stime (`/proc/<pid>/stat`) of the private server: the "
        "postmaster, its live children at both ends (client backends, checkpointer, background writer, WAL "
        "writer, autovacuum) and the children it reaped in between (its cutime + cstime); the bench's own "
        "snapshot and polling backends are left out. WAL bytes are the `pg_current_wal_lsn()` delta.",
        "",
        "**Work per run** (Postgres side only; statements are top-level `pg_stat_statements` calls, "
        "transaction control included, then without it)",
        "",
        "| worker processes | runs/s (drain) | statements | without BEGIN/COMMIT | commits | of which wrote (XIDs) "
        "| WAL bytes | WAL records | full-page images | FPI share of WAL bytes | WAL flushes (`wal_sync`) | ms per flush "
        "| shared hit | read | dirtied | written | Postgres CPU ms | of which background |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        lines.append(
            f"| {p.label} | {_n(p.rate)} | {p.stmt_per_run():.2f} | {p.stmt_per_run(control=False):.2f} "
            f"| {p.per_run('commits'):.2f} | {p.per_run('xids'):.2f} | {_n(p.wal_per_run('lsn_bytes'))} "
            f"| {p.wal_per_run('records'):.1f} | {p.wal_per_run('fpi'):.2f} | {p.fpi_bytes_share():.0%} "
            f"| {p.wal_per_run('sync'):.2f} | {p.flush_ms():.2f} | {p.stmt_per_run('shared_blks_hit'):.1f} "
            f"| {p.stmt_per_run('shared_blks_read'):.2f} | {p.stmt_per_run('shared_blks_dirtied'):.2f} "
            f"| {p.stmt_per_run('shared_blks_written'):.2f} | {p.per_run('cpu_ms'):.2f} "
            f"| {p.per_run('background_cpu_ms'):.2f} |")
    big = max((p for p in points if not p.checkpoint_between), key=lambda p: p.procs)
    lines += [
        "",
        f"Split of the {big.procs}-process point: the producer (`send_event`) and the drain (claim, 3 step "
        "records, settle, sweeps), per run.",
        "",
        "| phase | statements | commits | of which wrote | WAL bytes | full-page images | Postgres CPU ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, ph in (("producer", big.producer), ("drain", big.drain)):
        calls = sum(s["calls"] for s in ph.statements) / ph.runs
        lines.append(f"| {name} | {calls:.2f} | {ph.commits / ph.runs:.2f} | {ph.xids / ph.runs:.2f} "
                     f"| {_n(ph.wal['lsn_bytes'] / ph.runs)} | {ph.wal['fpi'] / ph.runs:.2f} | {ph.cpu_ms / ph.runs:.2f} |")
    stmts: dict[tuple[str, str], dict[str, float]] = {}
    for ph in (big.producer, big.drain):
        for s in ph.statements:
            acc = stmts.setdefault((s["role"], s["query"]), dict.fromkeys(PGSS, 0.0))
            for k in PGSS:
                acc[k] += s[k]
    top = sorted(stmts.items(), key=lambda kv: (-kv[1]["calls"], -kv[1]["total_exec_time"]))[:8]
    lines += [
        "",
        f"Top statements of the {big.procs}-process point, by calls (then time): per run, and per call.",
        "",
        "| login | statement | calls / run | mean ms | WAL bytes / call | FPI / call | shared hit / call | read / call |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (role, query), s in top:
        who = "producer" if role == PRODUCER else "worker"
        c = s["calls"] or 1
        lines.append(f"| {who} | `{_short(query)}` | {s['calls'] / big.runs:.2f} | {s['total_exec_time'] / c:.3f} "
                     f"| {_n(s['wal_bytes'] / c)} | {s['wal_fpi'] / c:.2f} | {s['shared_blks_hit'] / c:.1f} "
                     f"| {s['shared_blks_read'] / c:.2f} |")
    kinds: dict[str, list[int]] = {}
    for ph in (big.producer, big.drain):
        for k, (n, rec, fpi) in ph.walstats.items():
            acc2 = kinds.setdefault(k, [0, 0, 0])
            acc2[0] += n
            acc2[1] += rec
            acc2[2] += fpi
    total = kinds.pop("Total", [0, 0, 0])
    if total[1] + total[2]:
        lines += [
            "",
            f"What the WAL of the {big.procs}-process point is made of (`pg_waldump --stats=record`), per run:",
            "",
            "| record type | records | record bytes | full-page image bytes | share of WAL bytes |",
            "|---|---|---|---|---|",
        ]
        for k, (n, rec, fpi) in sorted(kinds.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:8]:
            lines.append(f"| `{k}` | {n / big.runs:.2f} | {_n(rec / big.runs)} | {_n(fpi / big.runs)} "
                         f"| {(rec + fpi) / (total[1] + total[2]):.0%} |")
        lines.append(f"| all | {total[0] / big.runs:.2f} | {_n(total[1] / big.runs)} | {_n(total[2] / big.runs)} "
                     "| 100% |")
    # --- the model
    host = a.host_procs * m.per_proc
    lines += [
        "",
        "**The model** (medians of the points above): "
        f"{m.cpu_ms:.2f} Postgres CPU ms, {_n(m.wal_bytes)} WAL bytes, {m.commits:.2f} commits "
        f"({m.writes:.2f} that wrote) per run →",
        "",
        "| | value |",
        "|---|---|",
        f"| runs/s per fully busy Postgres vCPU (1000 / CPU ms per run) | **{_n(m.runs_per_vcpu)}** |",
        f"| runs/s per WAL MB/s (10⁶ / WAL bytes per run) | **{_n(m.runs_per_wal_mbps)}** |",
        *([f"| the same, backlog across a checkpoint ({_n(worst.wal_per_run('lsn_bytes'))} WAL bytes per run) "
           f"| {_n(1e6 / worst.wal_per_run('lsn_bytes'))} |"] if worst else []),
        f"| commits/s per 1,000 runs/s (of which wrote) | {_n(1000 * m.commits)} ({_n(1000 * m.writes)}) |",
        f"| a worker process ({'given' if a.proc_rate else 'measured here, the 1-process point'}) "
        f"| {_n(m.per_proc)} runs/s |",
        f"| a worker host (assumed: {a.host_procs} such processes) | {_n(host)} runs/s |",
        "",
        f"Worker hosts one primary carries. Assumptions (options of the bench): a host is {a.host_procs} "
        f"worker processes at the rate above; Postgres may use {a.cpu_util:.0%} of its vCPUs (the rest: "
        "dashboards, `motir purge`, spikes); a sustained WAL rate of "
        f"{' or '.join(_n(w) for w in a.wal_mbps)} MB/s (the disk and the standbys' replay); writing commits "
        f"at {_n(a.commits_per_vcpu)}/s per vCPU (DBOS's {_n(DBOS_WRITES_S)} single-row insert transactions/s "
        f"on {DBOS_VCPUS} vCPUs). Every bound is linear in its resource.",
        "",
        "| primary | CPU bound, runs/s | "
        + " | ".join(f"WAL bound at {_n(w)} MB/s" for w in a.wal_mbps)
        + " | commit bound, runs/s | binds first | runs/s | worker hosts |",
        "|---|---|" + "---|" * len(a.wal_mbps) + "---|---|---|---|",
    ]
    for v in a.vcpus:
        bounds = {"CPU": v * a.cpu_util * 1000 / m.cpu_ms}
        for w in a.wal_mbps:
            bounds[f"WAL {_n(w)} MB/s"] = w * 1e6 / m.wal_bytes
        bounds["commits"] = v * a.commits_per_vcpu / m.writes
        first = min(bounds, key=lambda k: bounds[k])
        wal_cells = " | ".join(_n(bounds[f"WAL {_n(w)} MB/s"]) for w in a.wal_mbps)
        lines.append(f"| {v} vCPUs | {_n(bounds['CPU'])} | {wal_cells} | {_n(bounds['commits'])} | {first} "
                     f"| {_n(bounds[first])} | **{bounds[first] / host:,.0f}** |")
    dbos_per_vcpu = DBOS_WORKFLOWS_S / DBOS_VCPUS
    lines += [
        "",
        "Compared:",
        "",
        "| system | published or measured | transactions per run / task | runs/s per database vCPU |",
        "|---|---|---|---|",
        f"| DBOS ([blog]({DBOS_URL})) | {_n(DBOS_WORKFLOWS_S)} workflows/s and {_n(DBOS_WRITES_S)} writes/s on "
        f"an RDS db.m7i.24xlarge, {DBOS_VCPUS} vCPUs | ≈ {DBOS_WRITES_S / DBOS_WORKFLOWS_S:.1f} writes per "
        f"workflow (their two figures' ratio) | ≈ {_n(dbos_per_vcpu)} (throughput ÷ vCPUs, at whatever "
        "utilisation they reached) |",
        f"| Hatchet ([Show HN, v1]({HATCHET_URL})) | \"at minimum {HATCHET_TX_PER_TASK} Postgres transactions\" "
        f"per task (5k tasks/s ≈ 25k transactions/s) | ≥ {HATCHET_TX_PER_TASK} | — |",
        f"| motir-celery (measured here, {JOB}) | {_n(max(p.rate for p in points))} runs/s at best on 2 shared "
        f"cores | {m.commits:.2f} commits, {m.writes:.2f} that wrote | {_n(m.runs_per_vcpu)} per fully busy "
        f"vCPU; {_n(m.runs_per_vcpu * a.cpu_util)} at {a.cpu_util:.0%} |",
    ]
    return "\n".join(lines)


def _machine(pg_version: str) -> str:
    import platform

    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    return (f"{platform.machine()}, {os.cpu_count()} cores shared with other work (load at start {load}), "
            f"Postgres {pg_version}, Python {platform.python_version()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pgcost", description=__doc__.split("\n\n")[0])
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
    parser.add_argument("--no-write", action="store_true", help="print the tables, leave docs/scaling.md")
    args = parser.parse_args(argv)
    if not os.environ.get("CELERY_BROKER_URL"):
        parser.error("CELERY_BROKER_URL must be set (Redis)")
    assumptions = Assumptions(args.host_procs, tuple(int(v) for v in args.vcpus.split(",")), args.cpu_util,
                              tuple(float(w) for w in args.wal_mbps.split(",")), args.commits_per_vcpu,
                              args.proc_rate)
    procs = [int(p) for p in args.procs.split(",")]
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine_load = _machine("?")
    command = " ".join(["python -m bench.pgcost", *(sys.argv[1:] if argv is None else argv)])
    t0 = time.monotonic()
    queue = f"bench-pgcost-{uuid.uuid4().hex[:8]}"
    pg, worker_url, producer_url = start_server()
    points: list[Point] = []
    try:
        for name in ("MOTIR_APP_DATABASE_URL", "MOTIR_ADMIN_DATABASE_URL", "MOTIR_MIGRATE_DATABASE_URL"):
            os.environ.pop(name, None)
        os.environ.update(MOTIR_DATABASE_URL=producer_url, MOTIR_QUEUE=queue, MOTIR_IMPORTS="bench.workload")
        from motir_celery.settings import reset_settings

        reset_settings()
        import bench.workload  # noqa: F401  (bench.three's subscribers in this process, for send_event)

        with psycopg.connect(f"host=127.0.0.1 port={pg.port} user=postgres dbname=postgres",
                             autocommit=True) as admin:
            version = admin.execute("SHOW server_version").fetchone()[0].split()[0]  # type: ignore[index]
            plan = [(n, False) for n in procs] + ([] if args.no_checkpoint_point else [(max(procs), True)])
            for n, between in plan:
                print(f"pgcost: {n} worker process(es), {args.runs} runs{' across a checkpoint' * between} ...",
                      file=sys.stderr)
                point = measure(pg, admin, worker_url, queue, n, args.runs, args.timeout,
                                checkpoint_between=between)
                print(f"pgcost: {n}: {point.rate:.0f} runs/s, {point.per_run('cpu_ms'):.2f} CPU ms/run, "
                      f"{point.wal_per_run('lsn_bytes'):.0f} WAL B/run, {point.per_run('commits'):.2f} commits/run",
                      file=sys.stderr)
                points.append(point)
    finally:
        from motir_celery.store.db import dispose_engines

        dispose_engines()
        pg.close()
        try:
            from motir_celery.adapter.celery_app import default_app

            purge(default_app(), queue)
        except Exception:  # noqa: BLE001 — the queue may not exist
            pass
    block = render(points, assumptions, command=command, started=started,
                   machine=machine_load.replace("Postgres ?", f"Postgres {version}"),
                   seconds=time.monotonic() - t0)
    print(block)
    if not args.no_write:
        write_block("bench.pgcost", block)
        print("pgcost: wrote docs/scaling.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
