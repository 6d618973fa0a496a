"""The benchmarks' one set-up: a benchmark is its measurement, written on top of this.

Services (a fresh, migrated database on the shared server, or a private Postgres and
Redis of the bench's own: ``private_stack``), worker processes and their logs, producing
(pre-queued runs, paced sends, a feeder), draining and timing, the CPU and RSS of process
trees, rounds in which the sides take turns so that a baseline is measured in the same
run, and the docs' generated blocks (``write_block``). bench/README.md shows a bench
written on it.

Only the standard library and psycopg are imported here at the top: the peers' drivers
(bench/peers) import this module in a virtualenv without motir_celery, Celery or redis.
The engine and the broker clients are imported where they are used, once the
environment names the database.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence, TypeVar
from urllib.parse import urlsplit

import psycopg

ROOT = Path(__file__).resolve().parent.parent
SCALING_DOC, PERFORMANCE_DOC = ROOT / "docs" / "scaling.md", ROOT / "docs" / "performance.md"
LOGS = Path(tempfile.gettempdir()) / "motir-bench"
MOTIR_QUEUE, PLAIN_QUEUE = "bench-motir", "bench-plain"
#: The modules of the benches' jobs: the trivial ``bench.three`` and the I/O-like ``bench.three_io``.
IMPORTS, IO_JOB = "bench.workload,bench.io_jobs", "bench.three_io"
TABLES = "job_run_dlq, job_step, job_run, job_queue, job_event"
TICKS = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")

# --- environment -------------------------------------------------------------------------


def child_cwd(engine: str | None = None) -> Path:
    """``python -m`` puts its working directory first on sys.path: a child that runs another
    checkout's engine (``engine``, else $BENCH_ENGINE_PATH) starts there."""
    return Path(engine or os.environ.get("BENCH_ENGINE_PATH") or ROOT)


def child_env(engine: str | None = None, **extra: str) -> dict[str, str]:
    """This process's environment for a child, with the engine at ``engine`` (another
    checkout: before/after runs) ahead of this checkout on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (engine or os.environ.get("BENCH_ENGINE_PATH"), str(ROOT)) if p)
    env.update(extra)
    return env


def engine_env(url: str, queue: str, imports: str, engine: str | None = None, **extra: str) -> dict[str, str]:
    """A child's environment whose engine uses database ``url`` alone (this process's app, admin
    and migrate URLs left out), ``queue`` and the jobs of ``imports``."""
    env = child_env(engine, MOTIR_DATABASE_URL=url, MOTIR_QUEUE=queue, MOTIR_IMPORTS=imports, **extra)
    for name in ("MOTIR_APP_DATABASE_URL", "MOTIR_ADMIN_DATABASE_URL", "MOTIR_MIGRATE_DATABASE_URL"):
        env.pop(name, None)
    return env


def need(*names: str) -> None:
    missing = [n for n in names if not os.environ.get(n)]
    if missing:
        sys.exit(f"set {' and '.join(missing)} (a Postgres server, a Redis broker); "
                 "`eval \"$(python -m motir_celery.dev.embedded env)\"` starts embedded ones")


def server_url() -> str:
    """The Postgres server the bench was pointed at (MOTIR_DATABASE_URL before a bench replaced it)."""
    return os.environ.get("BENCH_SERVER_URL") or os.environ["MOTIR_DATABASE_URL"]


def dsn(url: str) -> str:
    """A SQLAlchemy URL as libpq reads it."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def connect(url: str, **kw: Any) -> psycopg.Connection[Any]:
    """An autocommit connection; its application_name starts with ``bench`` (samplers leave those out)."""
    return psycopg.connect(dsn(url), **{"autocommit": True, "application_name": "bench", **kw})


def use_engine(url: str, queue: str, imports: str = "bench.workload", **extra: str) -> None:
    """Point this process's engine, and every child started after, at database ``url`` and ``queue``."""
    for name in ("MOTIR_APP_DATABASE_URL", "MOTIR_ADMIN_DATABASE_URL", "MOTIR_MIGRATE_DATABASE_URL"):
        os.environ.pop(name, None)
    os.environ.setdefault("BENCH_SERVER_URL", os.environ.get("MOTIR_DATABASE_URL", url))
    os.environ.update(MOTIR_DATABASE_URL=url, MOTIR_QUEUE=queue, MOTIR_IMPORTS=imports, **extra)
    import motir_celery  # noqa: F401  (names how the default engine is built)
    from motir_celery.core.current import make_current
    from motir_celery.settings import reset_settings
    from motir_celery.store.db import dispose_engines

    reset_settings()
    dispose_engines()
    make_current(None)  # the current engine: the default, built anew from this environment (its app's queue too)
    import_all(imports)


def import_all(modules: str | Iterable[str]) -> None:
    """Import job modules (comma-separated, as MOTIR_IMPORTS): the jobs a producer fans events out to."""
    for module in filter(None, (m.strip() for m in (modules.split(",") if isinstance(modules, str) else modules))):
        importlib.import_module(module)


def purge_queue(queue: str, broker: str | None = None) -> None:
    """Empty ``queue`` on the broker (a queue never declared has nothing to purge)."""
    from celery import Celery

    app = Celery("bench-purge", broker=broker or os.environ["CELERY_BROKER_URL"], set_as_current=False)
    with app.connection_for_write() as conn:
        try:
            conn.default_channel.queue_purge(queue)
        except Exception:  # noqa: BLE001 — never declared: nothing in it
            pass


# --- statistics --------------------------------------------------------------------------


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in [0, 100]."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def drain_rate(done_at: Iterable[float], lo: float = 0.05, hi: float = 0.95) -> float:
    """Completions per second between the ``lo`` and ``hi`` fractions of a drain: the backlog
    was queued before the workers started, and trimming 5 % at each end keeps their start-up
    and the last straggler out of the figure, identically for every side."""
    s = sorted(done_at)
    n = len(s)
    if n < 20:
        return (n - 1) / (s[-1] - s[0]) if n > 1 and s[-1] > s[0] else float("nan")
    i, j = int(n * lo), int(n * hi) - 1
    return (j - i) / (s[j] - s[i]) if s[j] > s[i] else float("nan")


# --- databases ---------------------------------------------------------------------------


class Database:
    """A bench database. ``create`` makes it fresh and migrated; ``drop`` (or leaving a
    ``with``) removes it. Counting goes through one kept connection (``monitor_pid``), which
    CPU readings leave out."""

    def __init__(self, url: str, server: str | None = None, *, monitor_url: str | None = None) -> None:
        self.url, self.server = url, server
        self.name = urlsplit(url).path.lstrip("/")
        self._monitor_url = monitor_url or url
        self._monitor: psycopg.Connection[Any] | None = None
        self.polls = 0

    @classmethod
    def create(cls, name: str, server: str | None = None, *, migrate: bool = True) -> "Database":
        server = server or server_url()
        drop_database(name, server)
        with connect(server) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        db = cls(urlsplit(server)._replace(path=f"/{name}").geturl(), server)
        if migrate:
            from motir_celery.store.migrate import upgrade

            upgrade(db.url)
        return db

    def drop(self) -> None:
        self.close()
        if self.server:
            drop_database(self.name, self.server)

    def close(self) -> None:
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None

    def __enter__(self) -> "Database":
        return self

    def __exit__(self, *exc: object) -> None:
        self.drop()

    def rows(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        with connect(self.url) as conn:
            cur = conn.execute(sql, params)  # type: ignore[arg-type]
            return cur.fetchall() if cur.description else []

    def value(self, sql: str, params: Any = None) -> Any:
        return self.rows(sql, params)[0][0]

    def truncate(self, *extra: str) -> None:
        self.rows(f"TRUNCATE {', '.join((TABLES, *extra))} CASCADE")

    @property
    def monitor(self) -> psycopg.Connection[Any]:
        if self._monitor is None or self._monitor.closed:
            self._monitor = connect(self._monitor_url, application_name="bench-monitor")
        return self._monitor

    @property
    def monitor_pid(self) -> int:
        return int(self.monitor.info.backend_pid)

    def succeeded(self, job: str | None = None) -> int:
        self.polls += 1
        sql = "SELECT count(*) FROM job_queue WHERE state = 'succeeded'" + (" AND job_id = %s" if job else "")
        row = self.monitor.execute(sql, (job,) if job else None).fetchone()
        return int(row[0]) if row else 0

    def finished(self, ids: Sequence[Any] | None = None) -> dict[str, float]:
        """Run id -> the settle's ``finished_at`` (epoch s); every run (of ``ids``) must have succeeded."""
        where = " WHERE id = ANY(%s)" if ids is not None else ""
        got = self.rows(f"SELECT id::text, state, extract(epoch FROM finished_at)::float8 FROM job_queue{where}",
                        ([str(i) for i in ids],) if ids is not None else None)
        bad = [r for r in got if r[1] != "succeeded"]
        if bad or (ids is not None and len(got) != len(ids)):
            raise RuntimeError(f"{len(bad)} runs did not succeed, {len(ids or got) - len(got)} missing")
        return {r[0]: float(r[2]) for r in got}

    def backends(self) -> list[int]:
        """Postgres backends serving this database on this host (but the monitor's)."""
        mine = self.monitor_pid
        return [pid for pid, cmd in processes() if cmd.startswith("postgres: ") and f" {self.name} " in f"{cmd} "
                and pid != mine]


def drop_database(name: str, server: str | None = None) -> None:
    with connect(server or server_url()) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def private_postgres(*settings: str) -> Iterator[Any]:
    """A Postgres server of the bench's own (``motir_celery.dev.private.PrivatePostgres``) on a
    free port, with ``settings``; stopped and deleted afterwards, on error too."""
    from motir_celery.dev.private import PrivatePostgres

    exit_on_sigterm()
    pg = PrivatePostgres(settings=settings)
    try:
        pg.init()
        yield pg
    finally:
        pg.close()


def exit_on_sigterm() -> None:
    """A SIGTERM (``kill``, ``timeout``) unwinds this process as an exception would, so that the
    ``finally`` blocks stop its private servers and workers; Python's default ends it where it
    stands and leaves them running. Only from the main thread, and only over the default handler."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


# --- processes ---------------------------------------------------------------------------


class Procs:
    """The processes of one measurement, each logging to ``<logs>/<tag>-<i>.log``; stopped on
    exit: SIGTERM, then SIGKILL of its session."""

    def __init__(self, tag: str, logs: Path | None = None) -> None:
        self.tag, self.logs = tag, logs or LOGS
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.paths: list[Path] = []

    def start(self, cmd: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None) -> None:
        path = self.logs / f"{self.tag}-{len(self.procs)}.log"
        with open(path, "wb") as log:
            self.procs.append(subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=dict(env or child_env()),
                                               cwd=cwd or child_cwd(), start_new_session=True))
        self.paths.append(path)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def log(self, i: int, tail: int = 3000) -> str:
        return self.paths[i].read_text(errors="replace")[-tail:]

    def check(self) -> None:
        for i, p in enumerate(self.procs):
            if p.poll() is not None:
                raise RuntimeError(f"{self.tag} process {i} exited ({p.returncode}):\n{self.log(i)}")

    def wait(self, done: Callable[[], bool], timeout: float, poll: float = 0.1) -> None:
        """Until ``done()``; fails when one of the processes exits, or after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not done():
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.tag}: not done after {timeout:.0f}s")
            time.sleep(poll)

    def wait_logged(self, marker: str, timeout: float = 120) -> None:
        self.wait(lambda: all(marker in p.read_text(errors="replace") for p in self.paths), timeout, poll=0.2)

    def stop(self, timeout: float = 60) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)

    def __enter__(self) -> "Procs":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def workers(app: str, queue: str, n: int = 1, concurrency: int = 2, *, env: Mapping[str, str] | None = None,
            cwd: Path | None = None, tag: str = "w", pool: str = "prefork", hosts: Sequence[str] = (),
            loglevel: str = "WARNING", logs: Path | None = None, ready: bool = False) -> Procs:
    """``n`` ``celery -A app worker`` processes of ``concurrency`` each on ``queue`` (prefetch and
    acks as the app sets them; gossip and mingle off). ``hosts``: each worker's node host name,
    also in its $BENCH_HOST. ``ready``: wait until each logged that it is (``loglevel`` INFO)."""
    procs = Procs(tag, logs)
    try:
        for i in range(n):
            host = hosts[i] if hosts else "%h"
            procs.start([sys.executable, "-m", "celery", "-A", app, "worker", "-l", loglevel, "-c", str(concurrency),
                         "-P", pool, "-Q", queue, "-n", f"{tag}{i}@{host}", "--without-gossip", "--without-mingle"],
                        {**(env or child_env()), **({"BENCH_HOST": host} if hosts else {})}, cwd)
        if ready:
            procs.wait_logged("ready.")
    except BaseException:
        procs.stop()
        raise
    return procs


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def processes() -> Iterator[tuple[int, str]]:
    """(pid, command line) of every process of this host."""
    return ((int(e), cmdline(int(e))) for e in os.listdir("/proc") if e.isdigit())


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: [1] ppid, [11] utime, [12] stime, [13] cutime, [14] cstime."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


@dataclass
class Reading:
    """CPU ticks of processes at one instant: each live one's own (utime + stime), its parent,
    and what the roots reaped (their cutime + cstime: children that exited are not lost)."""

    ticks: dict[int, int]
    parents: dict[int, int]
    roots: tuple[int, ...] = ()
    reaped: int = 0


def read_cpu(roots: Iterable[int], *, tree: bool = True, exclude: Iterable[int] = ()) -> Reading:
    """``roots`` and (``tree``) all their descendants, but ``exclude``."""
    roots, skip = tuple(roots), set(exclude)
    stats = {pid: s for pid in roots if (s := _stat(pid)) is not None}
    if tree:
        everything = {int(e): s for e in os.listdir("/proc") if e.isdigit() and (s := _stat(int(e))) is not None}
        frontier = list(stats)
        while frontier:
            parent = frontier.pop()
            kids = [pid for pid, s in everything.items() if int(s[1]) == parent and pid not in stats]
            stats.update({pid: everything[pid] for pid in kids})
            frontier += kids
    live = {pid: s for pid, s in stats.items() if pid not in skip}
    reaped = sum(int(s[13]) + int(s[14]) for pid, s in stats.items() if pid in roots) if tree else 0
    return Reading({pid: int(s[11]) + int(s[12]) for pid, s in live.items()},
                   {pid: int(s[1]) for pid, s in live.items()}, roots, reaped)


def cpu_ms(a: Reading, b: Reading, only: Iterable[int] | None = None) -> float:
    """CPU ms between two readings (``only``: of those processes alone). A child of a root
    that exited in between is in the root's reaped ticks whole: its share before ``a`` is
    taken off. A process that started in between counts whole."""
    if only is not None:
        keep = set(only)
        return sum(t - a.ticks.get(pid, 0) for pid, t in b.ticks.items() if pid in keep) * 1000 / TICKS
    gone = sum(t for pid, t in a.ticks.items() if pid not in b.ticks and a.parents.get(pid) in a.roots)
    live = sum(t - a.ticks.get(pid, 0) for pid, t in b.ticks.items())
    return (live + b.reaped - a.reaped - gone) * 1000 / TICKS


def redis_pid(url: str | None = None) -> int | None:
    """The broker's redis-server process, when it runs on this host."""
    import redis

    try:
        pid = int(redis.Redis.from_url(url or os.environ["CELERY_BROKER_URL"]).info("server")["process_id"])
        return pid if "redis" in Path(f"/proc/{pid}/comm").read_text() else None
    except Exception:  # noqa: BLE001 — not Redis, or not on this host
        return None


class Meter:
    """CPU of a drain's processes: the workers' main processes and their pool children, the
    Postgres backends of the side's database (``backends``) and the Redis server."""

    def __init__(self, procs: Procs, backends: Callable[[], list[int]]) -> None:
        self.procs, self.backends, self.redis = procs, backends, redis_pid()

    def read(self) -> tuple[Reading, Reading, Reading]:
        return (read_cpu(self.procs.pids), read_cpu(self.backends(), tree=False),
                read_cpu([self.redis] if self.redis else [], tree=False))

    def ms(self, a: tuple[Reading, Reading, Reading], b: tuple[Reading, Reading, Reading]) -> dict[str, float]:
        """main, children, postgres, total (these three) and redis (the shared server: apart)."""
        main = cpu_ms(a[0], b[0], only=self.procs.pids)
        out = {"main_ms": main, "children_ms": cpu_ms(a[0], b[0]) - main, "postgres_ms": cpu_ms(a[1], b[1])}
        out["total_ms"] = sum(out.values())
        out["redis_ms"] = cpu_ms(a[2], b[2])
        return out


def rss_tree(pid: int) -> list[tuple[int, int, int]]:
    """(pid, VmRSS kB, VmHWM kB) of ``pid`` and its descendants, ``pid`` first."""
    out = []
    for p in sorted(read_cpu([pid]).ticks, key=lambda x: x != pid):
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{p}/status").read_text().splitlines() if ":" in line)
        except OSError:
            continue
        out.append((p, int(fields.get("VmRSS", "0 kB").split()[0]), int(fields.get("VmHWM", "0 kB").split()[0])))
    return out


def pss_kb(pid: int) -> int:
    """Proportional set size of ``pid`` (kB; 0 once it is gone): its RSS with each page shared by n
    processes counted 1/n (``/proc/<pid>/smaps_rollup``)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in text.splitlines() if line.startswith("Pss:")), 0)


# --- a private stack: a Postgres and a Redis that only the bench's processes use ------------

#: A private server durable as production runs it (every commit flushed unless a statement
#: says otherwise), and no checkpoint in the middle of a drain.
PRIVATE_SETTINGS = ("fsync=on", "full_page_writes=on", "synchronous_commit=on", "checkpoint_timeout=30min",
                    "max_wal_size=4GB")
#: Workers draining a backlog queued before they started: not "lost messages" for the sweeper.
WORKER_ENV = {"MOTIR_REPUBLISH_AFTER": "3600"}
#: Postgres processes that are not a client's backend (their titles, PostgreSQL 13-17).
BACKGROUND = ("postgres: walwriter", "postgres: checkpointer", "postgres: background writer", "postgres: autovacuum",
              "postgres: logical replication", "postgres: stats", "postgres: archiver", "postgres: walsummarizer")


@dataclass
class Stack:
    """The bench's private Postgres (``pg``) and Redis, its database, and the readings of their processes."""

    pg: Any
    redis: Any
    db: Database

    def pg_reading(self, side: Any = None) -> Reading:
        """Every process of the server, but the pollers' backends (ours and the side's)."""
        pollers = {self.db.monitor_pid}
        if isinstance(getattr(side, "db", None), Database):
            pollers.add(side.db.monitor_pid)
        return read_cpu([self.pg.postmaster], exclude=pollers)

    def split(self, a: Reading, b: Reading) -> tuple[float, float]:
        """The server's CPU ms between two ``pg_reading``s: (client backends, the rest: WAL writer,
        checkpointer, autovacuum, the postmaster and the children it reaped in between)."""
        background = [pid for pid in b.ticks if cmdline(pid).startswith(BACKGROUND) or pid == self.pg.postmaster]
        rest = cpu_ms(a, b, only=background) + (b.reaped - a.reaped) * 1000 / TICKS
        return cpu_ms(a, b) - rest, rest

    def redis_reading(self) -> Reading:
        return read_cpu([self.redis.proc.pid], tree=False)

    def cpu_per_run(self, side: Any, runs: int, warmup: int, *, tag: str, timeout: float = 1200) -> dict[str, float]:
        """``warmup`` + ``runs`` runs queued, one worker x 2 started; CPU ms a run of every process
        (the worker's main process and children, the server's client backends and the rest, Redis)
        over the runs settled after the first ``warmup``."""
        side.reset()
        side.prequeue(warmup + runs)
        with side.workers(1, 2, tag) as procs:
            procs.wait(lambda: side.settled() >= warmup, timeout, poll=0.05)
            n0 = side.settled()
            w0, p0, r0 = read_cpu(procs.pids), self.pg_reading(side), self.redis_reading()
            procs.wait(lambda: side.settled() >= warmup + runs, timeout, poll=0.05)
            n = max(1, side.settled() - n0)
            w1, p1, r1 = read_cpu(procs.pids), self.pg_reading(side), self.redis_reading()
        main = cpu_ms(w0, w1, only=procs.pids)
        pg_clients, pg_background = self.split(p0, p1)
        out = {"main": main / n, "children": (cpu_ms(w0, w1) - main) / n, "pg_clients": pg_clients / n,
               "pg_background": pg_background / n, "redis": cpu_ms(r0, r1) / n}
        out["total"] = sum(out.values())
        return out


@contextmanager
def private_stack(db_name: str, settings: Sequence[str] = PRIVATE_SETTINGS) -> Iterator[Stack]:
    """A private Postgres (``settings``) with a fresh, migrated database ``db_name``, and a
    private Redis that CELERY_BROKER_URL names meanwhile: every process that works for a run is
    one the bench can count, and nobody else's work is counted. Stopped afterwards, on error too."""
    from motir_celery.dev.private import PrivateRedis

    exit_on_sigterm()  # (before the first server: a kill stops them all)
    work = Path(tempfile.mkdtemp(prefix="motir-bench-redis-"))
    redis = PrivateRedis(work).start()
    broker = os.environ.get("CELERY_BROKER_URL")
    os.environ["CELERY_BROKER_URL"] = redis.url
    try:
        with private_postgres(*settings) as pg:
            db = Database.create(db_name, pg.url("postgres"))
            try:
                yield Stack(pg, redis, db)
            finally:
                db.close()
    finally:
        redis.close()
        shutil.rmtree(work, ignore_errors=True)
        if broker is not None:
            os.environ["CELERY_BROKER_URL"] = broker


# --- sides: what is queued, run and settled ----------------------------------------------


class Side(Protocol):
    def reset(self) -> None: ...
    def prequeue(self, n: int, offset: int = 0) -> None: ...
    def send(self, i: int) -> str: ...
    def settled(self) -> int: ...
    def finished(self) -> dict[str, float]: ...
    def workers(self, n: int, concurrency: int, tag: str) -> Procs: ...
    def backends(self) -> list[int]: ...


PREQUEUE = """
    WITH ev AS (
      INSERT INTO job_event (name, data)
      SELECT %(job)s, jsonb_build_object('n', g) FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) g
      RETURNING id, name
    )
    INSERT INTO job_queue (event_id, job_id, event_name, max_attempts, retry_policy)
    SELECT id, %(job)s, name, %(max_attempts)s, %(policy)s FROM ev
    RETURNING id
"""


def publish_runs(ids: Iterable[Any], job: str) -> None:
    """One message per run, through the current engine (``motir_celery.current_engine()``)."""
    from motir_celery import current_engine

    engine = current_engine()
    for run_id in ids:
        engine.publish(run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id)), job)


def held() -> Any:
    """An engine on this process's environment whose messages are held, not sent (``Held``)."""
    from motir_celery import Engine
    from motir_celery.testing import Held

    return Engine(host=Held())


def send(n: int, job: str = "bench.three", *, offset: int = 0,
         data: Callable[[int], dict[str, Any]] = lambda n: {"n": n}) -> list[uuid.UUID]:
    """``n`` events, one ``send_event`` (one transaction) each, as an application sends them, their
    messages held back (``publish_runs`` sends them)."""
    engine = held()
    return [i for k in range(offset, offset + n) for i in engine.send_event(job, data(k)).run_ids]


@dataclass
class Motir:
    """The durable side: runs of ``job`` (defined in ``imports``) in ``db``; its workers run ``app``
    with ``env`` on the engine at ``engine`` (another checkout; None: this one). Points this
    process's engine, the sender, at ``queue`` and at ``sender_url`` (default: ``db``'s)."""

    db: Database
    job: str = "bench.three"
    imports: str = "bench.workload"
    app: str = "motir_celery"
    env: dict[str, str] = field(default_factory=dict)
    engine: str | None = None
    queue: str = MOTIR_QUEUE
    sender_url: str | None = None

    def __post_init__(self) -> None:
        url = self.sender_url or self.db.url
        if os.environ.get("MOTIR_DATABASE_URL") != url or os.environ.get("MOTIR_QUEUE") != self.queue:
            use_engine(url, self.queue, self.imports)
        else:  # a child given the environment already (ablation, --baseline's sender)
            import_all(self.imports)

    def reset(self) -> None:
        self.db.truncate()
        purge_queue(self.queue)

    def prequeue(self, n: int, offset: int = 0) -> None:
        """The rows send_event would write for ``n`` events (one statement, untimed), then a message each."""
        from motir_celery.core.jobs import get_job

        policy = get_job(self.job).retry_policy
        ids = [r[0] for r in self.db.rows(PREQUEUE, {"job": self.job, "lo": offset + 1, "hi": offset + n,
                                                     "max_attempts": policy.max_attempts, "policy": policy.name})]
        publish_runs(ids, self.job)

    def send(self, i: int) -> str:
        import motir_celery

        return str(motir_celery.send_event(self.job, {"n": i}).run_ids[0])

    def settled(self) -> int:
        return self.db.succeeded()

    def finished(self) -> dict[str, float]:
        return self.db.finished()

    def workers(self, n: int, concurrency: int, tag: str = "motir") -> Procs:
        env = child_env(self.engine, MOTIR_DATABASE_URL=self.db.url, MOTIR_QUEUE=self.queue,
                        MOTIR_IMPORTS=self.imports, **self.env)
        return workers(self.app, self.queue, n, concurrency, env=env, cwd=child_cwd(self.engine), tag=tag)

    def backends(self) -> list[int]:
        return self.db.backends()


@dataclass
class Plain:
    """Plain Celery running the same three functions in one task (``bench.plain_app``), no
    durability: each task writes its completion instant into a Redis hash."""

    env: dict[str, str] = field(default_factory=dict)
    queue: str = PLAIN_QUEUE
    key: str = field(default_factory=lambda: f"bench-plain-{uuid.uuid4().hex}")

    def _redis(self) -> Any:
        import redis

        return redis.Redis.from_url(os.environ.get("BENCH_COUNTER_URL", os.environ["CELERY_BROKER_URL"]))

    def reset(self) -> None:
        self._redis().delete(self.key)
        purge_queue(self.queue)

    def prequeue(self, n: int, offset: int = 0) -> None:
        for i in range(offset, offset + n):
            self.send(i)

    def send(self, i: int) -> str:
        from bench.plain_app import app

        app.send_task("bench.plain", args=[i, self.key], queue=self.queue)
        return str(i)

    def settled(self) -> int:
        return int(self._redis().hlen(self.key))

    def finished(self) -> dict[str, float]:
        return {k.decode(): float(v) for k, v in self._redis().hgetall(self.key).items()}

    def workers(self, n: int, concurrency: int, tag: str = "plain") -> Procs:
        return workers("bench.plain_app", self.queue, n, concurrency, env=child_env(**self.env), tag=tag)

    def backends(self) -> list[int]:
        return []


@dataclass
class PlainIO(Plain):
    """Plain Celery running the I/O-like workload (``bench/plain_io_app.py``)."""

    def send(self, i: int) -> str:
        from bench.plain_io_app import app

        app.send_task("bench.plain_io", args=[i, self.key], queue=self.queue)
        return str(i)

    def workers(self, n: int, concurrency: int, tag: str = "plain-io") -> Procs:
        return workers("bench.plain_io_app", self.queue, n, concurrency, env=child_env(**self.env), tag=tag)


# --- draining and timing -----------------------------------------------------------------


def settle(side: Side, procs: Procs, total: int, *, meter: Meter | None = None, timeout: float = 900,
           poll: float = 0.25, cpu_from: float = 0.1) -> dict[str, float]:
    """Wait until ``total`` runs of ``side`` settled. With ``meter``: CPU ms per run from
    ``cpu_from`` of them (past the workers' start-up) to the end."""
    mark: dict[str, Any] = {}

    def done() -> bool:
        n = side.settled()
        if meter is not None and not mark and n >= total * cpu_from:
            mark.update(n=n, at=meter.read())
        return n >= total

    procs.wait(done, timeout, poll)
    if meter is None:
        return {}
    return {k: v / max(1, total - mark["n"]) for k, v in meter.ms(mark["at"], meter.read()).items()}


@dataclass
class Drain:
    rate: float  # runs/s over the 5%..95% span of the drain
    seconds: float
    cpu: dict[str, float]  # ms per run by process group (Meter.ms), when measured


def drain(side: Side, runs: int, workers: int = 1, concurrency: int = 2, *, cpu: bool = False,
          timeout: float = 900, tag: str = "drain") -> Drain:
    """``runs`` queued first, then the workers started and the backlog drained."""
    side.reset()
    side.prequeue(runs)
    t0 = time.monotonic()
    with side.workers(workers, concurrency, tag) as procs:
        per_run = settle(side, procs, runs, meter=Meter(procs, side.backends) if cpu else None,
                         timeout=timeout, poll=0.1 if cpu else 0.25)
    return Drain(drain_rate(side.finished().values()), time.monotonic() - t0, per_run)


def send_paced(side: Side, procs: Procs, events: int, interval: float, *, before: int = 0,
               warm: bool = True, calls: dict[str, float] | None = None) -> dict[str, float]:
    """One send every ``interval`` s (after a first one that shows the workers are up, unless
    ``warm`` is off), then wait until all settled (``before``: runs settled already). Returns
    key -> the instant just before its send; ``calls``, when given, gets key -> the send's seconds."""
    if warm:
        side.send(-1)
        before += 1
        procs.wait(lambda: side.settled() >= before, 120)
    sent: dict[str, float] = {}
    start = time.perf_counter()
    for i in range(events):
        t = time.time()
        key = side.send(i)
        sent[key] = t
        if calls is not None:
            calls[key] = time.time() - t
        time.sleep(max(0.0, start + (i + 1) * interval - time.perf_counter()))
    procs.wait(lambda: side.settled() >= before + events, 120)
    return sent


def latencies(done: Mapping[str, float], sent: Mapping[str, float]) -> dict[str, float]:
    """p50, p99 (seconds) and count of completion instant (``done``) minus send instant."""
    lat = [done[k] - t for k, t in sent.items()]
    return {"p50": percentile(lat, 50), "p99": percentile(lat, 99), "n": len(lat)}


def latency(side: Side, events: int, interval: float = 0.02, concurrency: int = 2) -> dict[str, float]:
    """Enqueue -> completion at low load: one worker up, one send every ``interval`` s; the
    completion instant minus the instant just before the send (one host clock)."""
    side.reset()
    with side.workers(1, concurrency, "latency") as procs:
        sent = send_paced(side, procs, events, interval)
    return latencies(side.finished(), sent)


def timed(fn: Callable[[int], Any], calls: int) -> list[float]:
    """Seconds of each of ``calls`` calls ``fn(i)``."""
    out = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


# --- rounds and ratios -------------------------------------------------------------------


def interleave(turns: Mapping[str, Callable[[], T]], rounds: int, log: Callable[[str], None] | None = None,
               show: Callable[[T], str] = str) -> dict[str, list[T]]:
    """Each side's measurement once a round, the sides taking turns: the drift of a shared
    machine falls on all of them, and a ratio of two medians compares like with like."""
    out: dict[str, list[T]] = {name: [] for name in turns}
    for r in range(rounds):
        for name, measure in turns.items():
            t0 = time.monotonic()
            out[name].append(measure())
            if log:
                log(f"round {r + 1}: {name:<13} {show(out[name][-1])}  ({time.monotonic() - t0:.0f}s)")
    return out


def report(values: Mapping[str, Sequence[float]], baseline: str, unit: str, scale: float = 1.0,
           digits: int = 1) -> None:
    """One line a side: its median (x ``scale``), its rounds, its ratio to ``baseline``'s median."""
    base = median(values[baseline])
    width = max(map(len, values))
    for name, xs in values.items():
        rounds = ", ".join(f"{x * scale:.{digits}f}" for x in xs)
        print(f"  {name:<{width}}  {median(xs) * scale:10.{digits}f} {unit}  ({rounds})  x{median(xs) / base:.2f} of {baseline}")


# --- reports -----------------------------------------------------------------------------


def parser(prog: str, doc: str | None, *, write: str | None = "docs/scaling.md") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=(doc or "").split("\n\n")[0])
    if write:
        p.add_argument("--no-write", action="store_true", help=f"print the block, leave {write} as it is")
    return p


def logger(prog: str) -> Callable[[str], None]:
    """``log(message)``: ``[HH:MM:SS] prog: message`` on stderr."""
    return lambda msg: print(f"[{datetime.now():%H:%M:%S}] {prog}: {msg}", file=sys.stderr, flush=True)


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def command(prog: str, argv: Sequence[str] | None = None) -> str:
    return " ".join([f"python -m {prog}", *(sys.argv[1:] if argv is None else argv)])


def machine(url: str | None = None, *, load: bool = False, **versions: str) -> str:
    """This host in a line: cores, (load), Postgres at ``url``, ``versions``, Python."""
    parts = [platform.machine(), f"{os.cpu_count()} cores shared with other work"
             + (f" (load at start {' '.join(f'{x:.2f}' for x in os.getloadavg())})" if load else "")]
    if url:
        try:
            with connect(url) as conn:
                parts.append("Postgres " + str(conn.execute("SHOW server_version").fetchone()[0]).split()[0])  # type: ignore[index]
        except psycopg.Error:
            parts.append("Postgres ?")
    parts += [f"{k} {v}" for k, v in versions.items()]
    return ", ".join([*parts, f"Python {platform.python_version()}"])


def write_between(doc: Path, begin: str, end: str, block: str) -> None:
    """Replace the text between ``begin`` and ``end`` in ``doc`` (markers kept; at its end the first time)."""
    text = doc.read_text() if doc.exists() else ""
    if begin not in text:
        text += f"\n{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    doc.write_text(f"{head}{begin}\n\n{block.strip()}\n\n{end}{rest.split(end, 1)[1]}")


def write_block(module: str, block: str, doc: Path = SCALING_DOC, *, write: bool = True) -> None:
    """Print the block ``python -m <module>`` regenerates, and (``write``) put it in ``doc``, between its
    markers (at the doc's end the first time)."""
    print(block)
    if write:
        write_between(doc, f"<!-- {module}: begin (generated by python -m {module}; edits here are lost) -->",
                      f"<!-- {module}: end -->", block)
        print(f"{module}: wrote {doc}", file=sys.stderr)


def describe(checkout: Path | str = ROOT) -> str:
    """The commit a checkout is at (``git describe --always --dirty``), "?" when git cannot say."""
    try:
        return subprocess.run(["git", "-C", str(checkout), "describe", "--always", "--dirty"], capture_output=True,
                              text=True, timeout=30).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def beat(url: str, job: str, slots: int, start_at: float, out: Any) -> None:
    """A beat process (``multiprocessing``'s target): ``slots`` cron slots of ``job`` enqueued one
    transaction each on a pool of its own, from ``start_at`` (epoch s); puts (Queued count, seconds)."""
    from sqlalchemy import create_engine, text

    from motir_celery.store import records
    from motir_celery.store.sql import producer

    engine, base = create_engine(url, pool_size=1), datetime(2030, 1, 1, tzinfo=timezone.utc)
    with engine.connect() as conn:  # connected before the start line
        conn.execute(text("SELECT 1"))
    time.sleep(max(0.0, start_at - time.time()))
    queued, t0 = 0, time.perf_counter()
    for i in range(slots):
        with engine.begin() as conn:
            r = producer.enqueue_scheduled(conn, job, base + timedelta(minutes=i), max_attempts=3, policy="transient")
        queued += isinstance(r, records.Queued)
    out.put((queued, time.perf_counter() - t0))
    engine.dispose()


class Feeder(threading.Thread):
    """Events of ``job`` sent with ``send_events`` (one statement a batch, published after
    commit) in a thread: ``rate`` a second, a batch every 0.1 s, until ``stop``; or with
    ``rate=None``, ``total`` of them as fast as they go, ``batch`` at a time."""

    def __init__(self, settings: Any, job: str, *, rate: float | None = None, total: int = 0, batch: int = 250,
                 data: Callable[[int], dict[str, Any]] = lambda n: {"n": n, "workspace_id": f"ws-{n % 8}"}) -> None:
        super().__init__(name=f"feeder-{job}", daemon=True)
        self.settings, self.job, self.rate, self.total, self.batch, self.data = settings, job, rate, total, batch, data
        self.sent = 0
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        from motir_celery.adapter.celery_app import create_app
        from motir_celery.adapter.messages import engine_of

        try:
            import_all(self.settings.imports)
            engine = engine_of(create_app(self.settings, current=False))  # this thread's own, not the process's
            t0 = time.monotonic()
            while not self.halt.is_set() and (self.rate is not None or self.sent < self.total):
                due = (int((time.monotonic() - t0) * self.rate) if self.rate is not None else self.total) - self.sent
                if due > 0:
                    items = [(self.job, self.data(self.sent + k)) for k in range(min(due, self.batch))]
                    engine.send_events(items)
                    self.sent += len(items)
                if self.rate is not None:
                    self.halt.wait(0.1)
        except BaseException as exc:  # noqa: BLE001 — stop() raises it in the main thread
            self.error = exc
            print(f"feeder failed: {exc!r}", file=sys.stderr, flush=True)

    def stop(self) -> int:
        """Stop sending; the number sent (raises what failed the feeder)."""
        self.halt.set()
        self.join(timeout=30)
        if self.error is not None:
            raise RuntimeError(f"feeder failed: {self.error!r}") from self.error
        return self.sent
