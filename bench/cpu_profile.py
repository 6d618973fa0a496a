"""Where a run's CPU goes (issue 28): every process of a drain, measured, then attributed.

    python -m bench.cpu_profile                      # 3 rounds of 3,000 runs + profiles; rewrites its block of docs/performance.md
    python -m bench.cpu_profile --runs 1000 --rounds 1 --no-write
    python -m bench.cpu_profile --baseline /path/to/checkout   # that checkout's engine as one more side (before/after)
    python -m bench.cpu_profile --no-peers --no-profile        # the CPU table alone

Needs CELERY_BROKER_URL only to be set to something (it is replaced): the bench runs on a
Postgres and a Redis of its own (``motir_celery.dev.private``: a private server with fsync,
full_page_writes and synchronous_commit on, pg_stat_statements preloaded, planning
tracked; a private redis-server), so every process that works for a run is one we can
count, and nobody else's work is counted.

**CPU per run.** The sides (this engine's ``bench.three``, three trivial steps; plain Celery
running the same three functions in one task, ``bench/plain_app.py``; Procrastinate 3.10
running them as one task, from ``bench/.peers-venv``; with ``--baseline``, another
checkout's engine) take turns, ``--rounds`` times (``harness.interleave``). A turn queues
``--warmup`` + ``--runs`` runs, then starts one worker (prefork ``-c 2``; Procrastinate: one
``procrastinate worker -c 2``) and reads, from ``/proc`` (utime + stime), the CPU of the
worker's main process, its pool children, its lease renewer (a child process too), every
process of the Postgres server (client backends apart from the rest: WAL writer,
checkpointer, autovacuum, reaped children) and the Redis server, once ``--warmup`` runs have
settled and again when all have: the difference over the runs settled in between. The
poller's own backend is left out. pg_stat_statements does not track during these turns
(``track = none``): what it costs is not counted. The workers run with
``MOTIR_REPUBLISH_AFTER=3600``: a backlog queued before the workers start is not "lost
messages" for the sweeper to send again.

**Attribution.** After the rounds, one more drain of each Celery side runs under py-spy
(``record --subprocesses --gil --nonblocking``: the samples in which a process holds the
GIL, i.e. runs Python), with pg_stat_statements tracking top-level statements. Each
sample is charged to its innermost frame's package (``category``); a process's measured CPU
(the median of the rounds) is shared out in proportion to its samples. So time a process
spends outside the GIL (system calls, libpq, the kernel's side of sockets) is spread over
the categories like the rest, and the figures are shares, not exact costs. Postgres's
client-backend CPU is split into each statement's executor and planner time
(pg_stat_statements, per run) and the rest (protocol, transaction start and commit, the
commits' WAL flushes). Last, ``EXPLAIN (ANALYZE, BUFFERS, WAL)`` of each hot statement on one
fresh run shows what each writes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from bench import harness as h

DOC = h.ROOT / "docs" / "performance.md"
MODULE = "bench.cpu_profile"
DB, PEER_DB = "motir_bench_cpu", "motir_bench_cpu_procrastinate"
QUEUE = "bench-cpu"
SERVER_SETTINGS = ("fsync=on", "full_page_writes=on", "synchronous_commit=on",
                   "shared_preload_libraries=pg_stat_statements", "pg_stat_statements.track_planning=on",
                   "pg_stat_statements.track=none", "checkpoint_timeout=30min", "max_wal_size=4GB")
#: The bench's own statements (its pollers, pg_stat_statements' reset), left out of the statements' table.
POLLS = ("SELECT count(*) FROM job_queue WHERE state", "SELECT count(*) FROM procrastinate_jobs WHERE status",
         "pg_stat_statements_reset")
WORKER_ENV = {"MOTIR_REPUBLISH_AFTER": "3600"}
#: Postgres processes that are not a client's backend (their titles, PostgreSQL 13-17).
BACKGROUND = ("postgres: walwriter", "postgres: checkpointer", "postgres: background writer", "postgres: autovacuum",
              "postgres: logical replication", "postgres: stats", "postgres: archiver", "postgres: walsummarizer")
SIDE_NAMES = {"motir": "motir-celery (3 durable steps)", "baseline": "motir-celery, baseline engine (--baseline)",
              "plain": "plain Celery (the same 3 functions, no durability)",
              "procrastinate": "Procrastinate 3.10 (1 task, no steps)"}
PROCESS_NAMES = {"main": "worker main process", "children": "pool children", "renewer": "lease renewer"}


# --- where a sample goes -----------------------------------------------------------------

CELERY = ("celery", "kombu", "billiard", "vine", "amqp", "click")


def category(file: str) -> str:
    """The bucket of a py-spy frame's (shortened) file name."""
    top = file.split("/", 1)[0]
    if file == "kombu/utils/json.py" or top == "json":
        return "JSON (encode, decode)"
    if file == "motir_celery/adapter/guard.py":
        return "the malformed-message guard (adapter/guard.py)"
    if top == "motir_celery":
        return "motir-celery (runner, steps, leases, driver, task body)"
    if top == "bench":
        return "the job's three step bodies"
    if top in CELERY:
        return "Celery, kombu, billiard (consumer, tracer, pool IPC)"
    if top == "redis":
        return "redis-py"
    if top == "sqlalchemy":
        return "SQLAlchemy (connection checkout, transactions)"
    if top == "psycopg" or top.startswith("psycopg_"):
        return "psycopg (query, parameters, results)"
    if top == "logging":
        return "logging"
    return "other Python (standard library)"


_FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


@dataclass
class Profile:
    """py-spy samples by process kind (main, children, renewer) and category; our code by module."""

    samples: dict[str, collections.Counter[str]] = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    ours: dict[str, collections.Counter[str]] = field(default_factory=lambda: collections.defaultdict(collections.Counter))

    @classmethod
    def read(cls, path: Path) -> "Profile":
        """py-spy's raw (collapsed) output: ``process A;process B;frame;frame... count``."""
        out = cls()
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            parts = stack.split(";")
            depth = sum(1 for p in parts if p.startswith("process "))
            frames = [m for p in parts if not p.startswith("process ") and (m := _FRAME.match(p))]
            if not frames:
                continue
            files = [m["file"] for m in frames]
            kind = "main" if depth <= 1 else ("renewer" if any("adapter/renewer.py" in f for f in files) else "children")
            out.samples[kind][category(files[-1])] += int(count)
            if files[-1].startswith("motir_celery/"):
                out.ours[kind][files[-1].removeprefix("motir_celery/")] += int(count)
        return out

    def share(self, kind: str) -> dict[str, float]:
        total = sum(self.samples[kind].values())
        return {c: n / total for c, n in self.samples[kind].items()} if total else {}


# --- sides -------------------------------------------------------------------------------


@dataclass
class Procrastinate:
    """Procrastinate running the three functions as one task, from the peers' virtualenv."""

    server: str
    queue: str = "bench"

    def __post_init__(self) -> None:
        from bench import peersenv

        self.python = str(peersenv.ensure(quiet=True))
        self.db = h.Database.create(PEER_DB, self.server, migrate=False)
        self.env = {**h.child_env(), "BENCH_PEER_DSN": h.dsn(self.db.url), "PYTHONPATH": str(h.ROOT)}
        self._peer("from bench.peers.procrastinate_app import app\n"
                   "with app.open(): app.schema_manager.apply_schema()")

    def _peer(self, code: str) -> None:
        done = subprocess.run([self.python, "-c", code], env=self.env, cwd=h.ROOT, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"procrastinate: {done.stderr[-3000:]}")

    def reset(self) -> None:
        self.db.rows("TRUNCATE procrastinate_jobs CASCADE")

    def prequeue(self, n: int, offset: int = 0) -> None:
        self._peer("from bench.peers.procrastinate_app import app, three\n"
                   f"with app.open():\n"
                   f"    for i in range({offset}, {offset + n}, 1000):\n"
                   f"        three.batch_defer(*({{'n': k}} for k in range(i, min({offset + n}, i + 1000))))")

    def settled(self) -> int:
        self.db.polls += 1
        row = self.db.monitor.execute("SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'").fetchone()
        return int(row[0]) if row else 0

    def workers(self, n: int, concurrency: int, tag: str = "procrastinate") -> h.Procs:
        procs = h.Procs(tag)
        for i in range(n):
            procs.start([self.python, "-m", "procrastinate", "--app", "bench.peers.procrastinate_app.app",
                         "--log-level", "warning", "worker", "-q", self.queue, "-c", str(concurrency), "-n", f"{tag}-{i}"],
                        self.env, h.ROOT)
        return procs


# --- one measured drain ------------------------------------------------------------------


@dataclass
class Server:
    """The bench's private Postgres and Redis, and the readings of their processes."""

    pg: Any
    redis: Any
    db: h.Database

    @property
    def postmaster(self) -> int:
        return h.postmaster(self.pg)

    def pg_reading(self, side: Any) -> h.Reading:
        """Every process of the server, but the pollers' backends (ours and the side's)."""
        pollers = {self.db.monitor_pid}
        if isinstance(getattr(side, "db", None), h.Database):
            pollers.add(side.db.monitor_pid)
        return h.read_cpu([self.postmaster], exclude=pollers)

    def split(self, a: h.Reading, b: h.Reading) -> tuple[float, float]:
        """The server's CPU ms between two ``pg_reading``s: (client backends, the rest: WAL writer,
        checkpointer, autovacuum, the postmaster and the children it reaped in between)."""
        background = [pid for pid, t in titles(b.ticks).items() if t.startswith(BACKGROUND) or pid == self.postmaster]
        rest = h.cpu_ms(a, b, only=background) + (b.reaped - a.reaped) * 1000 / h.TICKS
        return h.cpu_ms(a, b) - rest, rest

    def redis_reading(self) -> h.Reading:
        assert self.redis.proc is not None
        return h.read_cpu([self.redis.proc.pid], tree=False)

    def track(self) -> None:
        """From now on pg_stat_statements tracks top-level statements: the server restarts with it
        (a backend already connected would run its next statement untracked after a reload)."""
        self.db.close()
        self.pg.settings = tuple(s for s in self.pg.settings if not s.startswith("pg_stat_statements.track="))
        self.pg.settings += ("pg_stat_statements.track=top",)
        self.pg.restart(down_for=0.5)

    def reset_statements(self) -> None:
        self.db.monitor.execute("SELECT pg_stat_statements_reset()")

    def statements(self) -> list[dict[str, Any]]:
        cols = ("calls", "plans", "total_plan_time", "total_exec_time", "wal_records", "wal_fpi", "wal_bytes",
                "shared_blks_hit", "shared_blks_dirtied")
        got = self.db.monitor.execute(
            f"SELECT query, {', '.join(cols)} FROM pg_stat_statements WHERE toplevel"
            " AND dbid = (SELECT oid FROM pg_database WHERE datname = current_database())").fetchall()
        return [{"query": r[0], **{c: float(v) for c, v in zip(cols, r[1:])}} for r in got
                if not r[0].startswith(POLLS)]


def titles(pids: Iterable[int]) -> dict[int, str]:
    """Each process's command line (a Postgres process's title), by pid."""
    out = {}
    for pid in pids:
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            out[pid] = ""
    return out


def measure(side: Any, server: Server, runs: int, warmup: int, *, tag: str, spy: Path | None = None,
            statements: bool = False, timeout: float = 1200) -> dict[str, Any]:
    """One drain: CPU ms per run by process group (and py-spy samples / statements when asked)."""
    side.reset()
    side.prequeue(warmup + runs)
    with side.workers(1, 2, tag) as procs:
        procs.wait(lambda: side.settled() >= warmup, timeout, poll=0.05)
        spying = None
        if spy is not None:
            spying = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(procs.pids[0]),
                                       "--subprocesses", "--gil", "--nonblocking", "-r", "250", "-f", "raw",
                                       "-o", str(spy)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(1.0)  # attached to every process before the window opens
        if statements:
            server.reset_statements()
        n0 = side.settled()
        w0, p0, r0 = h.read_cpu(procs.pids), server.pg_reading(side), server.redis_reading()
        procs.wait(lambda: side.settled() >= warmup + runs, timeout, poll=0.05)
        n1 = side.settled()
        w1, p1, r1 = h.read_cpu(procs.pids), server.pg_reading(side), server.redis_reading()
        if spying is not None:
            spying.send_signal(2)
            _, err = spying.communicate(timeout=60)
            if spying.returncode not in (0, -2) or not spy.exists():  # type: ignore[union-attr]
                raise RuntimeError(f"py-spy failed ({spying.returncode}): {err.decode(errors='replace')[-2000:]}")
        found = server.statements() if statements else []
    n = max(1, n1 - n0)
    renewer = [pid for pid, t in titles(w1.ticks).items() if "motir_celery.adapter.renewer" in t]
    main = h.cpu_ms(w0, w1, only=procs.pids)
    ren = h.cpu_ms(w0, w1, only=renewer) if renewer else 0.0
    pg_clients, pg_bg = server.split(p0, p1)
    out = {"main": main / n, "children": (h.cpu_ms(w0, w1) - main - ren) / n, "renewer": ren / n,
           "pg_clients": pg_clients / n, "pg_background": pg_bg / n, "redis": h.cpu_ms(r0, r1) / n}
    out["total"] = sum(out.values())
    out["runs"] = n
    if found:
        out["statements"] = [{**s, "per_run": s["calls"] / n} for s in found]
    return out


# --- EXPLAIN of the hot statements ---------------------------------------------------------


def explain(url: str, runs: int = 3) -> list[dict[str, Any]]:
    """EXPLAIN (ANALYZE, BUFFERS, WAL) of the claim, the three step records and the settle of a
    fresh run, each committed as the runner commits it; of the last of ``runs`` such runs (the
    first pays for the catalogue caches)."""
    import uuid

    from sqlalchemy import create_engine

    from motir_celery.store.driver import plan
    from motir_celery.store.sql import worker as worker_sql

    db = h.Database(url)
    engine = create_engine(url)
    out: list[dict[str, Any]] = []
    try:
        for k in range(runs):
            run_id = db.rows(h.PREQUEUE, {"job": "bench.three", "lo": 10**9 + k, "hi": 10**9 + k, "max_attempts": 3,
                                          "policy": "transient"})[0][0]
            token = uuid.uuid4()
            out = []
            for label, statement, params in [
                ("claim", worker_sql.CLAIM, {"run_id": run_id, "job_id": "bench.three", "worker": "explain/1",
                                             "lease": 60.0, "limit": None, "async_commit": True, "token": token}),
                *[(f"store_step ({s})", worker_sql.STORE_STEP, {"run_id": run_id, "token": token, "step_id": s,
                                                                "output": '{"reserved": 1}', "elapsed": 0.0001})
                  for s in ("reserve", "charge", "notify")],
                ("settle_succeeded", worker_sql.SETTLE_SUCCEEDED, {"run_id": run_id, "token": token,
                                                                   "result": '{"notified": 3}',
                                                                   "async_commit": True}),
            ]:
                with engine.begin() as conn:  # its own committed transaction, as the runner's autocommit
                    found = plan(conn, statement, params, analyze=True)[0]
                top = found["Plan"]
                out.append({"statement": label, "exec_ms": found["Execution Time"], "plan_ms": found["Planning Time"],
                            "hit": top.get("Shared Hit Blocks", 0), "dirtied": top.get("Shared Dirtied Blocks", 0),
                            "wal_records": top.get("WAL Records", 0), "wal_fpi": top.get("WAL FPI", 0),
                            "wal_bytes": top.get("WAL Bytes", 0),
                            "triggers": sum(t.get("Time", 0.0) for t in found.get("Triggers", []))})
    finally:
        engine.dispose()
        db.close()
    return out


# --- the run -----------------------------------------------------------------------------


def _short(query: str) -> str:
    """A statement's first words, for the table (the CTE names say what it is)."""
    q = " ".join(re.sub(r"--[^\n]*", "", query).split())
    return q[:70] + ("..." if len(q) > 70 else "")


def _flat(sql: str) -> str:
    return " ".join(re.sub(r"--[^\n]*", "", sql).split())


_CONSTANT = re.compile(r"%\(\w+\)s|\$\d+|'[^']*'|\b\d+(?:\.\d+)?\b|\b(?:true|false|NULL)\b", re.I)


def _shape(sql: str) -> str:
    """A statement with its parameters and constants as ``?``: pg_stat_statements' text of a
    statement and our SQL of it look the same so."""
    return _CONSTANT.sub("?", _flat(sql))


def _catalogue() -> list[tuple[str, str]]:
    """(shape, name) of the worker's and the sweeper's statements (store/sql/): how a
    pg_stat_statements text is named."""
    from motir_celery.store.driver import Statement
    from motir_celery.store.sql import maintenance, worker

    return [(_shape(value.sql), value.name) for module in (worker, maintenance)
            for value in vars(module).values() if isinstance(value, Statement)]


def _statement_name(query: str, catalogue: list[tuple[str, str]]) -> str:
    shape = _shape(query)
    return next((name for sql, name in catalogue if sql == shape), _short(query))


def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    from motir_celery.dev.private import PrivateRedis

    work = Path(tempfile.mkdtemp(prefix="motir-bench-cpu-"))
    h.exit_on_sigterm()  # (before the first private server: a kill stops them all)
    redis = PrivateRedis(work / "redis").start()
    os.environ["CELERY_BROKER_URL"] = redis.url
    try:
        with h.private_postgres(*SERVER_SETTINGS) as pg:
            server_url = pg.url("postgres")
            db = h.Database.create(DB, server_url)
            db.monitor.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            server = Server(pg, redis, db)
            sides: dict[str, Any] = {"motir": h.Motir(db, queue=QUEUE, env=dict(WORKER_ENV))}
            if args.baseline:
                sides["baseline"] = h.Motir(db, queue=QUEUE, env=dict(WORKER_ENV), engine=args.baseline)
            sides["plain"] = h.Plain()
            if args.peers:
                sides["procrastinate"] = Procrastinate(server_url)
            rounds = h.interleave({name: (lambda s=s, name=name: measure(s, server, args.runs, args.warmup,
                                                                         tag=f"cpu-{name}"))
                                   for name, s in sides.items()}, args.rounds,
                                  log=lambda m: log("  " + m.split(" {", 1)[0]))
            for name, rs in rounds.items():
                log(f"  {name}: " + ", ".join(f"{r['total']:.2f}" for r in rs) + " ms/run")
            profiles: dict[str, Profile] = {}
            statements: list[dict[str, Any]] = []
            if args.profile:
                server.track()
                for name in [n for n in sides if n != "procrastinate"]:
                    path = work / f"{name}.spy"
                    log(f"  profiling {name} ...")
                    got = measure(sides[name], server, args.runs, args.warmup, tag=f"cpu-spy-{name}", spy=path,
                                  statements=name == "motir")
                    profiles[name] = Profile.read(path)
                    if name == "motir":
                        statements = got["statements"]
            plans = explain(db.url) if args.profile else []
            db.close()
            if args.peers:
                sides["procrastinate"].db.close()
    finally:
        redis.close()
    return {"rounds": rounds, "profiles": profiles, "statements": statements, "plans": plans}


# --- the report --------------------------------------------------------------------------

GROUPS = ("main", "children", "renewer", "pg_clients", "pg_background", "redis")
GROUP_NAMES = {"main": "worker main process", "children": "pool children", "renewer": "lease renewer",
               "pg_clients": "Postgres client backends", "pg_background": "Postgres background",
               "redis": "Redis server"}


def _med(rs: list[dict[str, Any]], key: str) -> float:
    return h.median(r[key] for r in rs)


def render(result: dict[str, Any], args: argparse.Namespace, command: str, started: str, elapsed: float) -> str:
    rounds: dict[str, list[dict[str, Any]]] = result["rounds"]
    md = ["## Where a run's CPU goes (generated)", "",
          f"Generated by `{command}` ({started}, {elapsed / 60:.0f} min; {h.machine(load=True)}; "
          f"commit {_describe()}). Method: `bench/cpu_profile.py`'s docstring. Each side drains "
          f"{args.runs:,} queued runs (after {args.warmup} warm-up runs) with one worker of 2 processes, "
          f"{args.rounds} rounds, the sides taking turns; CPU is user + system time from `/proc`, "
          "in ms per run (median of the rounds; each round's total in parentheses).", "",
          "| side | " + " | ".join(GROUP_NAMES[g] for g in GROUPS) + " | **total** | what durability adds (- plain Celery) |",
          "|---|" + "---:|" * (len(GROUPS) + 2)]
    plain = rounds.get("plain")
    for name, rs in rounds.items():
        cells = [f"{_med(rs, g):.2f}" for g in GROUPS]
        total = ", ".join(f"{r['total']:.2f}" for r in rs)
        adds = ""
        if plain and name != "plain":
            per_round = [a["total"] - b["total"] for a, b in zip(rs, plain)]
            adds = f"**{h.median(per_round):+.2f}** ({', '.join(f'{x:+.2f}' for x in per_round)})"
        md.append(f"| {SIDE_NAMES[name]} | " + " | ".join(cells) + f" | **{_med(rs, 'total'):.2f}** ({total}) | {adds} |")
    profiles: dict[str, Profile] = result["profiles"]
    if profiles:
        md += ["", "Where it goes: each process's CPU above (median) shared out over the packages its py-spy samples "
               "were in (samples holding the GIL; one more drain per side); Postgres's client-backend CPU over the "
               "statements' executor and planner time (pg_stat_statements, same drain) and the rest. ms per run.", ""]
        names = list(profiles)
        md += ["| where | process | " + " | ".join(SIDE_NAMES[n] for n in names) + " |",
               "|---|---|" + "---:|" * len(names)]
        for kind in ("main", "children", "renewer"):
            cats: collections.Counter[str] = collections.Counter()
            for n in names:
                for c, share in profiles[n].share(kind).items():
                    cats[c] += share * _med(rounds[n], kind)
            for c, _ in cats.most_common():
                cells = [f"{profiles[n].share(kind).get(c, 0.0) * _med(rounds[n], kind):.2f}" for n in names]
                if all(x == "0.00" for x in cells):
                    continue
                md.append(f"| {c} | {GROUP_NAMES[kind]} | " + " | ".join(cells) + " |")
        statements = result["statements"]
        if statements and "motir" in names:
            catalogue = _catalogue()
            hot: dict[str, float] = collections.defaultdict(float)
            for s in statements:
                if not s["calls"]:
                    continue
                hot[_statement_name(s["query"], catalogue)] += (s["total_exec_time"] + s["total_plan_time"]) / s["calls"] * s["per_run"]
            clients = _med(rounds["motir"], "pg_clients")
            idx = names.index("motir")
            shown = 0.0
            for name_, ms in sorted(hot.items(), key=lambda kv: -kv[1]):
                if ms < 0.005:
                    continue
                shown += ms
                md.append(f"| Postgres: `{name_}`, executor + planner | Postgres client backends | "
                          + " | ".join(f"{ms:.2f}" if i == idx else "" for i in range(len(names))) + " |")
            md.append("| Postgres: protocol, transaction start and commit, WAL flushes (the rest) | Postgres client backends | "
                      + " | ".join(f"{clients - shown:.2f}" if i == idx else "" for i in range(len(names))) + " |")
        for group in ("pg_background", "redis"):
            md.append(f"| {GROUP_NAMES[group]} | {GROUP_NAMES[group]} | "
                      + " | ".join(f"{_med(rounds[n], group):.2f}" for n in names) + " |")
        md.append("| **total** | | " + " | ".join(f"**{_med(rounds[n], 'total'):.2f}**" for n in names) + " |")
        ours = profiles.get("motir")
        if ours is not None:
            parts = []
            for kind in ("children", "main"):
                total = sum(ours.samples[kind].values())
                if not total:
                    continue
                top = ", ".join(f"{f} {n / total * _med(rounds['motir'], kind):.2f}"
                                for f, n in ours.ours[kind].most_common(8))
                parts.append(f"{GROUP_NAMES[kind]}: {top}")
            md += ["", "Our own code by module (ms per run, the largest): " + "; ".join(parts) + "."]
    if result["statements"]:
        md += ["", "Statements during the profiled drain (pg_stat_statements, top level, per call unless said):", "",
               "| statement | calls per run | executor us | planner us (plans) | WAL records | WAL bytes | full-page images |",
               "|---|---:|---:|---:|---:|---:|---:|"]
        for s in sorted(result["statements"], key=lambda s: -s["total_exec_time"] * (s["per_run"] > 0.01)):
            if s["per_run"] < 0.01 or not s["calls"]:
                continue
            c = s["calls"]
            md.append(f"| `{_statement_name(s['query'], _catalogue())}` | {s['per_run']:.2f} | {s['total_exec_time'] / c * 1e3:.0f} | "
                      f"{s['total_plan_time'] / c * 1e3:.0f} ({s['plans']:.0f}) | {s['wal_records'] / c:.1f} | "
                      f"{s['wal_bytes'] / c:.0f} | {s['wal_fpi'] / c:.2f} |")
    if result["plans"]:
        md += ["", "`EXPLAIN (ANALYZE, BUFFERS, WAL)` of one fresh run's statements, each its own committed "
               "transaction as the runner sends them (not prepared: planning time included):", "",
               "| statement | executor ms | planner ms | of which FK triggers ms | buffers hit | dirtied | WAL records | WAL bytes | FPI |",
               "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for p in result["plans"]:
            md.append(f"| `{p['statement']}` | {p['exec_ms']:.3f} | {p['plan_ms']:.3f} | {p['triggers']:.3f} | {p['hit']} | "
                      f"{p['dirtied']} | {p['wal_records']} | {p['wal_bytes']} | {p['wal_fpi']} |")
    return "\n".join(md) + "\n"


def _describe() -> str:
    try:
        return subprocess.run(["git", "-C", str(h.ROOT), "describe", "--always", "--dirty"], capture_output=True,
                              text=True, timeout=30).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def write(block: str, doc: Path = DOC) -> None:
    """The block between its markers in docs/performance.md, below the notes marker (``python -m
    bench`` rewrites what is above it and keeps this)."""
    h.write_between(doc, f"<!-- {MODULE}: begin (generated by python -m {MODULE}; edits here are lost) -->",
                    f"<!-- {MODULE}: end -->", block, anchor=h.NOTES_MARKER)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3000, help="runs per drain, after the warm-up (default 3000)")
    p.add_argument("--warmup", type=int, default=200, help="runs drained before the window opens (default 200)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", help="another checkout whose motir_celery runs as one more side")
    p.add_argument("--no-peers", dest="peers", action="store_false", help="leave Procrastinate out")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="the CPU table only")
    p.add_argument("--no-write", action="store_true", help="print the block; leave docs/performance.md alone")
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--from-json", help="render (and write) the results a --json run saved, measuring nothing")
    args = p.parse_args(argv)
    if args.baseline:
        args.baseline = str(Path(args.baseline).resolve())
        if not (Path(args.baseline) / "motir_celery").is_dir():
            p.error(f"--baseline {args.baseline}: no motir_celery package there")
    started, t0 = h.now(), time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.0f}s] {msg}", file=sys.stderr, flush=True)

    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        profiles = {}
        for name, p_ in saved["profiles"].items():
            prof = Profile()
            for kind, counts in p_["samples"].items():
                prof.samples[kind].update(counts)
            for kind, counts in p_["ours"].items():
                prof.ours[kind].update(counts)
            profiles[name] = prof
        result = {**saved, "profiles": profiles}
        args.runs, args.warmup, args.rounds = saved["args"]["runs"], saved["args"]["warmup"], saved["args"]["rounds"]
        command, started = saved["command"], saved["started"]
    else:
        result = run(args, log)
        result["args"] = {"runs": args.runs, "warmup": args.warmup, "rounds": args.rounds}
        command, started = h.command(MODULE, argv), started
        result["command"], result["started"], result["elapsed"] = command, started, time.monotonic() - t0
    if args.json:
        Path(args.json).write_text(json.dumps(
            {**result, "profiles": {k: {"samples": v.samples, "ours": v.ours} for k, v in result["profiles"].items()}},
            indent=1, default=str))
    block = render(result, args, command, started, result.get("elapsed", time.monotonic() - t0))
    print(block)
    if not args.no_write:
        write(block)
        print(f"{MODULE}: wrote {DOC.relative_to(h.ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
