"""The chaos harness: real processes, injected faults, invariants read from the database.

Used by the shortened scenarios of the test suite (``tests/chaos/test_chaos_*.py``)
and by the full soak (``python -m tests.chaos.soak``, which also writes
``docs/reliability.md``). Nothing here trusts what a process *says* happened:
every number in a report is a query against Postgres at the end of the scenario,
and executions are counted from the ledger the step bodies write before they do
anything (``tests/chaos/jobs.py``).

Pieces (the private servers a scenario restarts, ``PrivatePostgres``, ``PrivateRedis``
and ``PrivateRabbit``, are ``motir_celery.dev.private``'s):

* ``Cluster`` — ``celery worker`` / ``celery beat`` subprocesses, each in its own
  process group: SIGKILL and SIGSTOP reach the pool children too, SIGTERM goes to
  the main process only (as an init system sends it, for a warm shutdown);
* ``Feeder`` — sends events at a rate with idempotency keys, retrying a send the
  database refused (Postgres down) with the same key;
* ``Injector`` — calls a fault at random intervals in a thread;
* ``check`` — the invariants, as SQL; ``Result`` — one row of the report.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine
from sqlalchemy.pool import NullPool

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("chaos")

#: The workspaces the workloads spread their events over (plus NULL: system rows).
WORKSPACES = ("ws-a", "ws-b", "ws-c")
TABLES = ("job_event", "job_queue", "job_step", "job_run", "job_run_dlq")
FINAL = ("succeeded", "failed", "cancelled")

LEDGER_DDL = (
    "CREATE SCHEMA IF NOT EXISTS test;"
    " CREATE TABLE IF NOT EXISTS test.side_effect ("
    " id bigserial PRIMARY KEY, run_id text NOT NULL, step text NOT NULL,"
    " attempt int, pid int, at timestamptz NOT NULL DEFAULT now())"
)


# --- databases ------------------------------------------------------------------------


def create_database(server_url: str, name: str) -> str:
    """A fresh, migrated database on ``server_url`` with the ledger table; returns its URL."""
    from sqlalchemy import make_url

    from motir_celery.store.migrate import upgrade

    server = make_url(server_url)
    admin = create_engine(server, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    url = server.set(database=name).render_as_string(hide_password=False)
    upgrade(url)
    prepare_ledger(url)
    return url


def drop_database(server_url: str, name: str) -> None:
    from sqlalchemy import make_url

    from motir_celery.store.db import dispose_engines

    dispose_engines()
    admin = create_engine(make_url(server_url), isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


def prepare_ledger(url: str) -> None:
    eng = create_engine(url, poolclass=NullPool)
    with eng.begin() as conn:
        conn.execute(text(LEDGER_DDL))
    eng.dispose()


def reset_tables(url: str) -> None:
    eng = create_engine(url, poolclass=NullPool)
    with eng.begin() as conn:
        conn.execute(text("TRUNCATE job_run_dlq, job_step, job_run, job_queue, job_event, test.side_effect CASCADE"))
    eng.dispose()


# --- the environment of one scenario -------------------------------------------------


@dataclass
class ChaosEnv:
    """Where a scenario's processes connect, and the engine knobs they run with.

    The lease, sweep period and republish delay are short so that recovery
    (reclaim of a dead worker's run, re-publish of a lost message) happens
    within seconds: the same code paths as in production, on a faster clock.
    """

    database_url: str
    broker_url: str
    workdir: Path
    queue: str = field(default_factory=lambda: f"chaos-{uuid.uuid4().hex[:8]}")
    lease: float = 3.0
    sweep_interval: float = 1.0
    republish_after: float = 4.0
    imports: str = "tests.chaos.jobs"
    extra_env: dict[str, str] = field(default_factory=dict)

    def child_env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "MOTIR_DATABASE_URL": self.database_url,
            "CELERY_BROKER_URL": self.broker_url,
            "MOTIR_QUEUE": self.queue,
            "MOTIR_IMPORTS": self.imports,
            "MOTIR_LEASE_SECONDS": str(self.lease),
            "MOTIR_SWEEP_INTERVAL": str(self.sweep_interval),
            "MOTIR_REPUBLISH_AFTER": str(self.republish_after),
            "PYTHONPATH": str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""),
            "PYTHONUNBUFFERED": "1",
        })
        env.pop("MOTIR_APP_DATABASE_URL", None)
        env.update(self.extra_env)
        env.update(extra)
        return env

    def settings(self) -> Any:
        """The settings of *this* process (the harness): the event jobs only. A cron
        job imported here would be ticked by any in-process scheduler of another test."""
        from motir_celery.settings import Settings

        return Settings.from_env(self.child_env(MOTIR_IMPORTS="tests.chaos.jobs"))

    def engine(self) -> Engine:
        from motir_celery.store.db import get_engine

        return get_engine(self.settings(), self.database_url)

    def publishing(self, copies: int = 1) -> Any:
        """A motir engine publishing through a Celery app of our own on the scenario's broker and
        queue; ``copies`` > 1 sends every message that many times."""
        from motir_celery.adapter.celery_app import create_app
        from motir_celery.adapter.messages import engine_of
        from motir_celery.core.engine import Engine as MotirEngine

        engine = engine_of(create_app(self.settings(), current=False))
        return engine if copies == 1 else MotirEngine(engine.settings, host=_Copies(engine.host, copies))


class _Copies:
    """A host that sends every message ``copies`` times through ``host``."""

    def __init__(self, host: Any, copies: int) -> None:
        self.host, self.copies, self.eager = host, copies, host.eager

    def publish(self, run_id: uuid.UUID, job_id: str, countdown: float = 0.0) -> None:
        for _ in range(self.copies):
            self.host.publish(run_id, job_id, countdown)

    def publish_many(self, runs: Sequence[tuple[uuid.UUID, str]]) -> None:
        for run_id, job_id in runs:
            self.publish(run_id, job_id)

    def routed(self, queue: str | None, priority: int | None) -> Callable[..., None]:
        return self.publish


# --- processes --------------------------------------------------------------------------


class Proc:
    def __init__(self, name: str, kind: str, popen: subprocess.Popen[bytes], log_path: Path) -> None:
        self.name, self.kind, self.popen, self.log = name, kind, popen, log_path
        #: The signals a fault sent it (a worker draining after SIGTERM is not picked again).
        self.signalled: list[int] = []

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def ready(self) -> bool:
        out = self.output()
        return ("ready." in out) if self.kind == "worker" else ("beat: Starting" in out)

    def signal(self, sig: int) -> None:
        """SIGKILL goes to the whole process group (the main process and its pool
        children die together, as in a machine or container loss); any other signal to
        the main process only, as an init system sends it: on SIGTERM Celery's main
        process lets its pool finish the runs in hand (warm shutdown)."""
        self.signalled.append(sig)
        try:
            if sig == signal.SIGKILL:
                os.killpg(self.popen.pid, sig)
            else:
                os.kill(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float) -> bool:
        try:
            self.popen.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False


class Cluster:
    """The scenario's ``celery worker`` and ``celery beat`` processes."""

    def __init__(self, env: ChaosEnv, **worker_defaults: Any) -> None:
        self.env = env
        #: How ``worker()`` starts a worker unless told otherwise (replacements too).
        self.worker_defaults: dict[str, Any] = {"concurrency": 2, "app": "motir_celery", "env": None}
        self.worker_defaults.update(worker_defaults)
        self.procs: list[Proc] = []
        self.lock = threading.Lock()
        self._n = 0

    def _spawn(self, kind: str, cmd: list[str], name: str, extra_env: dict[str, str] | None) -> Proc:
        self.env.workdir.mkdir(parents=True, exist_ok=True)
        log_path = self.env.workdir / f"{kind}-{name}.log"
        with open(log_path, "wb") as fh:
            popen = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=self.env.child_env(**(extra_env or {})),
                                     cwd=ROOT, start_new_session=True)
        proc = Proc(name, kind, popen, log_path)
        with self.lock:
            self.procs.append(proc)
        return proc

    def worker(self, *, concurrency: int | None = None, app: str | None = None, env: dict[str, str] | None = None,
               name: str | None = None, wait: bool = True) -> Proc:
        concurrency = concurrency or self.worker_defaults["concurrency"]
        app = app or self.worker_defaults["app"]
        env = env if env is not None else self.worker_defaults["env"]
        with self.lock:
            self._n += 1
            name = name or f"w{self._n}"
        cmd = [sys.executable, "-m", "celery", "-A", app, "worker", "-l", "INFO", "-c", str(concurrency),
               "-P", "prefork", "-n", f"{name}-{uuid.uuid4().hex[:4]}@%h", "-Q", self.env.queue,
               "--without-gossip", "--without-mingle", "--without-heartbeat"]
        proc = self._spawn("worker", cmd, name, env)
        if wait:
            self.wait_ready([proc])
        return proc

    def beat(self, *, env: dict[str, str] | None = None, name: str | None = None, wait: bool = True) -> Proc:
        with self.lock:
            self._n += 1
            name = name or f"b{self._n}"
        cmd = [sys.executable, "-m", "celery", "-A", "motir_celery", "beat", "-l", "INFO",
               "-s", str(self.env.workdir / f"beat-{name}.schedule")]
        proc = self._spawn("beat", cmd, name, env)
        if wait:
            self.wait_ready([proc])
        return proc

    def wait_ready(self, procs: Sequence[Proc], timeout: float = 90) -> None:
        for proc in procs:
            deadline = time.monotonic() + timeout
            while not proc.ready():
                if not proc.alive():
                    raise RuntimeError(f"{proc.kind} {proc.name} exited with {proc.popen.returncode}:\n"
                                       f"{proc.output()[-3000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{proc.kind} {proc.name} not ready after {timeout:.0f}s:\n"
                                       f"{proc.output()[-3000:]}")
                time.sleep(0.1)

    def alive(self, kind: str = "worker", ready: bool = True) -> list[Proc]:
        with self.lock:
            procs = list(self.procs)
        return [p for p in procs if p.kind == kind and p.alive() and (p.ready() or not ready)
                and (not p.signalled or not ready)]

    def stop(self, proc: Proc, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        proc.signal(sig)
        if not proc.wait(timeout):
            proc.signal(signal.SIGKILL)
            proc.wait(10)

    def close(self) -> None:
        with self.lock:
            procs = [p for p in self.procs if p.alive()]
        for proc in procs:
            proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in procs:
            if not proc.wait(max(deadline - time.monotonic(), 0.1)):
                proc.signal(signal.SIGKILL)
                proc.wait(10)
        # Orphaned pool children of a SIGKILLed main process are in its group too.
        for proc in self.procs:
            proc.signal(signal.SIGKILL)

    def supervise(self) -> list[str]:
        """What a process supervisor does: replace every worker that exited without
        being told to. Returns the last critical log line of each one replaced."""
        with self.lock:
            dead = [p for p in self.procs if p.kind == "worker" and not p.alive() and not p.signalled
                    and not getattr(p, "replaced", False)]
        reasons = []
        for proc in dead:
            proc.replaced = True  # type: ignore[attr-defined]
            lines = [ln for ln in proc.output().splitlines() if "CRITICAL" in ln or "Unrecoverable" in ln]
            reasons.append(f"{proc.name}: {lines[-1].split('] ', 1)[-1][:160] if lines else f'exit {proc.popen.returncode}'}")
            self.worker(wait=False)
        return reasons

    def logs(self, pattern: str) -> int:
        """How many log lines of every process ever started contain ``pattern``."""
        return sum(p.output().count(pattern) for p in self.procs)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- workload -------------------------------------------------------------------------


class Feeder(threading.Thread):
    """Sends ``count`` events at ``rate`` per second, each with an idempotency key.

    A send that raises is retried with the same key until the database answers:
    an error *before* the commit leaves nothing behind, so the retry creates the
    event; an error *after* it (the broker refused the publish) must not have
    lost anything either, and the retry, deduplicated, says so
    (``raised_after_commit``: events the caller was told failed, that exist).
    """

    def __init__(self, env: ChaosEnv, name: str, count: int, rate: float,
                 data: Callable[[int], dict[str, Any]] | None = None,
                 workspace: Callable[[int], str | None] | None = None,
                 copies: int = 1, key_prefix: str | None = None) -> None:
        super().__init__(daemon=True, name=f"feeder-{name}")
        self.env, self.event, self.count, self.rate = env, name, count, rate
        self.make_data = data or (lambda i: {"i": i})
        self.workspace = workspace or (lambda i: WORKSPACES[i % len(WORKSPACES)])
        self.copies = copies
        self.prefix = key_prefix or uuid.uuid4().hex[:8]
        self.accepted = 0
        self.send_errors = 0
        self.raised_after_commit = 0
        self.errors: list[str] = []
        self.runs_created = 0

    def run(self) -> None:
        engine = self.env.publishing(self.copies)
        start = time.monotonic()
        for i in range(self.count):
            due = start + i / self.rate if self.rate > 0 else 0
            if (pause := due - time.monotonic()) > 0:
                time.sleep(pause)
            key = f"{self.prefix}-{i}"
            failed_before = False
            while True:
                try:
                    result = engine.send_event(self.event, self.make_data(i), workspace_id=self.workspace(i),
                                               idempotency_key=key)
                except Exception as exc:  # noqa: BLE001 — Postgres or the broker is down: try again
                    self.send_errors += 1
                    if len(self.errors) < 5:
                        self.errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                    failed_before = True
                    time.sleep(0.3)
                    continue
                if result.deduplicated and failed_before:
                    self.raised_after_commit += 1
                self.runs_created += len(result.run_ids)
                self.accepted += 1
                break


class Injector(threading.Thread):
    """Calls ``fault()`` every ``every`` seconds (uniformly at random in the range) until stopped.
    ``fault`` returns a description when it did something, ``None`` when it could not."""

    def __init__(self, fault: Callable[[], str | None], every: tuple[float, float], name: str = "fault") -> None:
        super().__init__(daemon=True, name=f"injector-{name}")
        self.fault, self.every = fault, every
        self.done: list[str] = []
        self.errors: list[str] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(random.uniform(*self.every)):
            try:
                what = self.fault()
            except Exception as exc:  # noqa: BLE001
                self.errors.append(f"{type(exc).__name__}: {exc}")
                log.warning("fault %s failed: %s", self.name, exc, exc_info=True)
                continue
            if what:
                self.done.append(what)
                log.info("fault: %s", what)

    def stop(self) -> int:
        self._stop_event.set()
        self.join(timeout=120)
        return len(self.done)


def kill_and_replace(cluster: Cluster, sig: int = signal.SIGKILL, keep: int = 1) -> Callable[[], str | None]:
    """A fault: signal a random ready worker (its whole process group), then start a replacement.
    With SIGTERM the worker finishes what it runs first (warm shutdown); the replacement
    starts at once, so capacity is back while the old one drains."""

    def fault() -> str | None:
        candidates = cluster.alive("worker")
        if len(candidates) < keep:
            return None
        victim = random.choice(candidates)
        victim.signal(sig)
        if sig == signal.SIGKILL:
            victim.wait(10)
        cluster.worker(wait=False)
        return f"{signal.Signals(sig).name} {victim.name} (pid {victim.pid})"

    return fault


def freeze(cluster: Cluster, seconds: float) -> Callable[[], str | None]:
    """A fault: SIGSTOP a random worker's whole process group (a VM pause, a GC stall, a
    partition) for ``seconds`` — longer than the lease, so its runs are reclaimed and run
    elsewhere meanwhile — then SIGCONT. The thawed worker is a zombie: whatever it does
    next on those runs must be refused, and it must not start a step body already stored."""

    def fault() -> str | None:
        candidates = cluster.alive("worker")
        if not candidates:
            return None
        victim = random.choice(candidates)
        try:
            os.killpg(victim.pid, signal.SIGSTOP)
            time.sleep(seconds)
        finally:
            try:
                os.killpg(victim.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        return f"SIGSTOP {victim.name} for {seconds:.0f} s"

    return fault


# --- invariants ------------------------------------------------------------------------


def wait_settled(env: ChaosEnv, *, expected_runs: int | None, timeout: float, prefix: str = "chaos.") -> float:
    """Wait until every run is final (and at least ``expected_runs`` exist); returns seconds waited."""
    eng = env.engine()
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            with eng.connect() as conn:
                total, open_ = conn.execute(text(
                    "SELECT count(*), count(*) FILTER (WHERE state NOT IN ('succeeded', 'failed', 'cancelled')) "
                    "FROM job_queue WHERE job_id LIKE :p"), {"p": prefix + "%"}).one()
        except Exception:  # noqa: BLE001 — the database may be restarting
            time.sleep(0.5)
            continue
        if open_ == 0 and (expected_runs is None or total >= expected_runs):
            break
        time.sleep(0.25)
    return time.monotonic() - start


_CHECK = {
    "states": """
        SELECT state, count(*) FROM job_queue WHERE job_id LIKE :p GROUP BY state
    """,
    "failed_without_dlq": """
        SELECT count(*) FROM job_queue q WHERE q.job_id LIKE :p AND q.state = 'failed'
          AND NOT EXISTS (SELECT 1 FROM job_run_dlq d WHERE d.run_id = q.id)
    """,
    "dlq_without_failed": """
        SELECT count(*) FROM job_run_dlq d JOIN job_queue q ON q.id = d.run_id
        WHERE q.job_id LIKE :p AND q.state <> 'failed'
    """,
    # An attempt still 'running' in the ledger of a run that is final, or a
    # running run whose current attempt is not 'running': half a settle.
    "half_settled": """
        SELECT count(*) FROM job_run r JOIN job_queue q ON q.id = r.run_id
        WHERE q.job_id LIKE :p AND (
              (q.state IN ('succeeded', 'failed', 'cancelled') AND r.outcome = 'running')
           OR (q.state = 'running' AND r.attempt = q.attempts AND r.outcome <> 'running'))
    """,
    "attempts_without_ledger": """
        SELECT count(*) FROM job_queue q WHERE q.job_id LIKE :p AND q.attempts > 0
          AND (SELECT count(*) FROM job_run r WHERE r.run_id = q.id) <> q.attempts
    """,
    "stuck": """
        SELECT count(*) FROM job_queue WHERE job_id LIKE :p AND state = 'running'
          AND lease_expires_at < now() - make_interval(secs => :grace)
    """,
    # (event, job) and (cron job, slot): more than one run is a duplicate run.
    # Slots are compared to the second, so two beats binding slightly different
    # instants for one slot would show here although the constraint let them in.
    "dup_event_runs": """
        SELECT coalesce(sum(n - 1), 0) FROM (
          SELECT count(*) AS n FROM job_queue WHERE job_id LIKE :p AND event_id IS NOT NULL
          GROUP BY event_id, job_id HAVING count(*) > 1) d
    """,
    "dup_slot_runs": """
        SELECT coalesce(sum(n - 1), 0) FROM (
          SELECT count(*) AS n FROM job_queue WHERE job_id LIKE :p AND scheduled_for IS NOT NULL
          GROUP BY job_id, date_trunc('second', scheduled_for) HAVING count(*) > 1) d
    """,
    # Every event has one run per subscribing job: a missing one is a lost run.
    "fanout": """
        SELECT e.name, count(DISTINCT e.id) AS events, count(q.id) AS runs
        FROM job_event e LEFT JOIN job_queue q ON q.event_id = e.id
        WHERE e.name LIKE :p GROUP BY e.name
    """,
    # Step bodies: executions (ledger) against stored results (job_step). An
    # execution is allowed when its attempt was interrupted during the step (it
    # did not store it), plus the one execution whose attempt stored it. So per
    # (run, step): excess = executions - (interrupted attempts + 1). And no body
    # may *start* after its result was stored (the ledger's `at` and
    # completed_at are both the database's now()) in the attempt that stored it
    # or a later one: those saw the record. An earlier attempt's body may write
    # its ledger line late: frozen (SIGSTOP) between the call and that INSERT, it
    # thaws after its run was reclaimed and the step stored by the next attempt —
    # the body began before the store, and its own record is then refused.
    "dup_steps": """
        WITH per AS (
          SELECT x.run_id, x.step, count(*) AS execs,
                 count(DISTINCT x.attempt) FILTER (WHERE s.attempt IS DISTINCT FROM x.attempt) AS interrupted,
                 count(*) FILTER (WHERE s.completed_at IS NOT NULL AND x.at > s.completed_at
                                    AND x.attempt >= s.attempt) AS after_store
          FROM test.side_effect x
          JOIN job_queue q ON q.id::text = x.run_id
          LEFT JOIN job_step s ON s.run_id = q.id AND s.step_id = x.step
          WHERE q.job_id LIKE :p
          GROUP BY x.run_id, x.step
        )
        SELECT coalesce(sum(greatest(execs - interrupted - 1, 0)), 0),
               coalesce(sum(after_store), 0),
               coalesce(sum(execs), 0),
               count(*) FILTER (WHERE execs > 1)
        FROM per
    """,
}


@dataclass
class Check:
    runs: int = 0
    states: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    dup_steps: int = 0
    dup_runs: int = 0
    stuck: int = 0
    half_settled: int = 0
    cross_tenant: int = 0
    executions: int = 0
    reexecuted_steps: int = 0
    details: list[str] = field(default_factory=list)


def check(env: ChaosEnv, *, expected_runs: int | None = None, prefix: str = "chaos.",
          subscribers: dict[str, int] | None = None, tenancy: bool = True) -> Check:
    """Every invariant of the issue, read from the database."""
    eng = env.engine()
    p = {"p": prefix + "%"}
    c = Check()
    with eng.connect() as conn:
        def one(name: str, **extra: Any) -> Any:
            return conn.execute(text(_CHECK[name]), {**p, **extra}).scalar_one()

        c.states = {s: n for s, n in conn.execute(text(_CHECK["states"]), p).all()}
        c.runs = sum(c.states.values())
        not_final = sum(n for s, n in c.states.items() if s not in FINAL)
        failed_without_dlq = one("failed_without_dlq")
        dlq_without_failed = one("dlq_without_failed")
        missing = 0
        if subscribers:
            for name, events, runs in conn.execute(text(_CHECK["fanout"]), p).all():
                want = events * subscribers.get(name, 0)
                if runs < want:
                    missing += want - runs
                    c.details.append(f"{name}: {events} events but {runs} runs (want {want})")
        if expected_runs is not None and c.runs < expected_runs:
            missing = max(missing, expected_runs - c.runs)
            c.details.append(f"{c.runs} runs exist, {expected_runs} expected")
        c.lost = not_final + failed_without_dlq + missing
        if not_final:
            c.details.append(f"not final: {not_final} ({c.states})")
        if failed_without_dlq:
            c.details.append(f"failed without a DLQ row: {failed_without_dlq}")
        c.half_settled = one("half_settled") + dlq_without_failed + one("attempts_without_ledger")
        c.stuck = one("stuck", grace=env.sweep_interval + 1.0)
        c.dup_runs = int(one("dup_event_runs")) + int(one("dup_slot_runs"))
        excess, after_store, execs, reexecuted = conn.execute(text(_CHECK["dup_steps"]), p).one()
        c.dup_steps = int(excess) + int(after_store)
        c.executions, c.reexecuted_steps = int(execs), int(reexecuted)
        if c.dup_steps:
            c.details.append(f"duplicate step executions: {excess} beyond interruptions, {after_store} after the store")
    if tenancy:
        c.cross_tenant = cross_tenant_rows(env)
    return c


def cross_tenant_rows(env: ChaosEnv, workspaces: Sequence[str] = WORKSPACES) -> int:
    """Rows of another workspace (or system rows) that an app-role reader of each workspace sees."""
    from motir_celery.store.db import workspace_session

    settings = env.settings()
    seen = 0
    for ws in workspaces:
        with workspace_session(ws, settings=settings) as session:
            for table in TABLES:
                seen += session.execute(
                    text(f"SELECT count(*) FROM {table} WHERE workspace_id IS DISTINCT FROM :ws"), {"ws": ws}
                ).scalar_one()
    return seen


# --- results and the report ----------------------------------------------------------


@dataclass
class Result:
    number: str
    scenario: str
    runs: int
    succeeded: int
    dead_lettered: int
    faults: str
    lost: int
    dup_steps: int
    dup_runs: int
    stuck: int
    half_settled: int
    cross_tenant: int
    duration: float
    executions: int = 0
    reexecuted_steps: int = 0
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @classmethod
    def from_check(cls, number: str, scenario: str, c: Check, faults: str, duration: float,
                   notes: Sequence[str] = (), problems: Sequence[str] = ()) -> "Result":
        return cls(number, scenario, c.runs, c.states.get("succeeded", 0), c.states.get("failed", 0), faults,
                   c.lost, c.dup_steps, c.dup_runs, c.stuck, c.half_settled, c.cross_tenant, duration,
                   c.executions, c.reexecuted_steps, list(notes), list(c.details) + list(problems))

    @property
    def ok(self) -> bool:
        return not (self.lost or self.dup_steps or self.dup_runs or self.stuck or self.half_settled
                    or self.cross_tenant or self.problems)

    def summary(self) -> str:
        return (f"[{self.number}] {self.scenario}: runs={self.runs} ok={self.succeeded} dlq={self.dead_lettered} "
                f"faults=({self.faults}) lost={self.lost} dup_steps={self.dup_steps} dup_runs={self.dup_runs} "
                f"stuck={self.stuck} half_settled={self.half_settled} cross_tenant={self.cross_tenant} "
                f"executions={self.executions} re-executed={self.reexecuted_steps} {self.duration:.1f}s"
                + ("" if not self.notes else "\n    notes: " + "; ".join(self.notes))
                + ("" if not self.problems else "\n    PROBLEMS: " + "; ".join(self.problems)))

    def assert_ok(self) -> None:
        assert self.ok, self.summary()


def render_report(results: Sequence[Result], *, command: str, started: str, total: float, machine: str) -> str:
    """The soak's block of docs/reliability.md (its markers: soak.py)."""
    lines = [
        f"Generated by `{command}` on {started} ({machine}); total {total / 60:.1f} min. Regenerate with the same",
        "command. Every number below is a query against Postgres at the end of the scenario",
        "(`tests/chaos/harness.py`, `check`); step executions are counted from a ledger the step",
        "bodies write *before* doing anything (`tests/chaos/jobs.py`), so a body that started and",
        "was then killed still counts. The goal is 0 in every loss, duplicate and leak column.",
        "",
        "Every scenario starts its own broker (a private `redis-server`, or a private RabbitMQ node)",
        "and scenario 4 its own Postgres server, so no fault reaches another session's services.",
        "Engine knobs: `MOTIR_LEASE_SECONDS=3`, `MOTIR_SWEEP_INTERVAL=1`, `MOTIR_REPUBLISH_AFTER=4`",
        "(scenario 7: lease 2 s, sweep 0.5 s) — the production code paths on a faster clock",
        "(defaults 60 / 10 / 60 s). Workers: `celery -A motir_celery worker -P prefork -c 2`.",
        "",
        "| # | scenario | runs | succeeded / DLQ | faults injected | lost runs | duplicate step executions | duplicate runs | stuck runs | half-settled | cross-tenant rows | duration |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.number} | {r.scenario} | {r.runs} | {r.succeeded} / {r.dead_lettered} | {r.faults} | {r.lost} | "
            f"{r.dup_steps} | {r.dup_runs} | {r.stuck} | {r.half_settled} | {r.cross_tenant} | {r.duration:.0f} s |"
        )
    lines += [
        "",
        "Columns:",
        "",
        "* **lost runs** — runs not final at the end (after faults stop and one sweep period passes),",
        "  failed runs without their DLQ row, and (event, job) pairs or cron slots with no run at all.",
        "* **duplicate step executions** — per (run, step): executions beyond (attempts interrupted during",
        "  that step + 1), plus any execution that *started* after the step's result was stored.",
        "  Re-executions of an interrupted step are allowed by the contract (bodies are at-least-once)",
        "  and are listed in the notes, not here.",
        "* **duplicate runs** — more than one run for one (event, job) or one (cron job, slot).",
        "* **stuck runs** — `running` with a lease that expired more than a sweep period ago.",
        "* **half-settled** — a final run with an attempt still `running`, a DLQ row without a failed run,",
        "  or attempts charged without their ledger row.",
        "* **cross-tenant rows** — rows of another workspace (or system rows) seen by an app-role reader",
        "  (`workspace_session`, RLS enforced) of each workspace, checked at the end of every scenario;",
        "  scenario 10 also polls continuously while the other tenant's runs churn.",
        "",
    ]
    lines += ["### Notes per scenario", ""]
    for r in results:
        lines.append(f"**{r.number}. {r.scenario}** — {r.executions} step executions, "
                     f"{r.reexecuted_steps} steps re-executed after an interruption (allowed).")
        for note in r.notes:
            lines.append(f"  - {note}")
        for problem in r.problems:
            lines.append(f"  - PROBLEM: {problem}")
        lines.append("")
    return "\n".join(lines) + "\n"


@contextmanager
def timer() -> Iterator[Callable[[], float]]:
    start = time.monotonic()
    yield lambda: time.monotonic() - start
