"""Fixtures: a fresh migrated database per test session, real Celery workers.

The services come from the environment, exactly as the README's `make test`
provides them (the machine's, or embedded ones it started):

* ``MOTIR_DATABASE_URL`` — a Postgres server; the session creates its own
  database on it, migrates it from empty, and drops it at the end.
* ``CELERY_BROKER_URL`` — Redis (or RabbitMQ); each session uses a queue of
  its own so concurrent or leftover messages never reach its workers.
* ``MOTIR_TEST_AMQP_URL`` — RabbitMQ, for the tests that run the engine on it
  too. CI sets it and the tests fail without it there; on a laptop without
  RabbitMQ those tests are skipped with a reason.

A missing database or broker fails the session with a message; it never skips.
Under ``CI`` any skipped test fails the run (each skip's own reason is printed
first); elsewhere the skips are listed again at the end, with their reasons.

``make test`` runs several sessions at once (pytest-xdist, ``-n``): each worker
process is a session of its own (``SESSION``: its database, its queue, its
``tmp_path``). Only cluster-wide things are shared, so they are either named
per session (logins) or serialised (the migration, which creates the roles).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import psycopg
import pytest
from celery.utils.nodenames import default_nodename, host_format
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError

from motir_celery import settings as motir_settings
from motir_celery.dev.private import database_errors
from motir_celery.store.db import dispose_engines

if TYPE_CHECKING:
    from playwright.sync_api import Browser

ROOT = Path(__file__).resolve().parent.parent
#: One per process: under pytest-xdist every worker process imports this module and is its own session.
SESSION = uuid.uuid4().hex[:8]
#: Held (pg_advisory_lock on the server's own database) while a session migrates its new database:
#: the first migration on a server creates the cluster-wide roles, and two at once would both try.
_MIGRATE_LOCK = 0x6D6F746972  # "motir"
#: Celery's own integration suite and its runner: a command of their own (make celery-suite), never
#: collected here (the runner loads tests/celery_suite/plugin.py into Celery's pytest run instead).
collect_ignore = ["celery_suite"]


def _require(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.exit(
            f"{name} is not set. Run the suite with `make test` (it starts embedded Postgres and "
            f"Redis when the variables are unset), or export {name} yourself.",
            returncode=3,
        )
    return value


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    _require("MOTIR_DATABASE_URL")
    server = make_url(motir_settings.Settings.from_env().require_database_url())
    name = f"motir_test_{SESSION}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # noqa: BLE001
        pytest.exit(f"cannot create the test database on {server.render_as_string()}: {exc}", returncode=3)
    url = server.set(database=name).render_as_string(hide_password=False)
    os.environ["MOTIR_DATABASE_URL"] = url
    motir_settings.reset_settings()
    from motir_celery.store.migrate import upgrade

    # On the server itself: through a transaction pooler (make test-pgbouncer) a session lock is
    # no lock; the next client's statements may run in the session that holds it, and take it again.
    locker = create_engine(os.environ.get("MOTIR_DIRECT_DATABASE_URL") or server, isolation_level="AUTOCOMMIT")
    with locker.connect() as lock:
        lock.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _MIGRATE_LOCK})
        try:
            upgrade(url)
        finally:
            lock.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _MIGRATE_LOCK})
    locker.dispose()
    # The tests' own ledger of executed step bodies, in a schema Alembic does not compare.
    with create_engine(url).begin() as conn:
        conn.execute(text(
            "CREATE SCHEMA test; CREATE TABLE test.side_effect ("
            " id bigserial PRIMARY KEY, run_id text NOT NULL, step text NOT NULL,"
            " attempt int, pid int, at timestamptz NOT NULL DEFAULT now())"
        ))
    yield url
    dispose_engines()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(scope="session")
def engine(database_url: str) -> Engine:
    from motir_celery.store.db import get_engine

    return get_engine(motir_settings.Settings.from_env(), database_url)


@pytest.fixture(scope="session")
def broker_url() -> str:
    url = _require("CELERY_BROKER_URL")
    os.environ["MOTIR_QUEUE"] = f"motir-test-{SESSION}"
    motir_settings.reset_settings()
    return url


@pytest.fixture(scope="session")
def amqp_url() -> str:
    url = os.environ.get("MOTIR_TEST_AMQP_URL")
    if not url:
        if os.environ.get("CI"):
            pytest.fail("MOTIR_TEST_AMQP_URL is not set in CI: .ci/run must provide RabbitMQ")
        pytest.skip("RabbitMQ end-to-end tests need MOTIR_TEST_AMQP_URL (set by .ci/run; CI never skips them)")
    return url


@pytest.fixture(autouse=True)
def _current_engine_restored() -> Iterator[None]:
    """A test that attach()es an app of its own (or imports a module that does, as
    tests/fixtures/user_app.py) makes that app's engine current; the tests after it publish
    through the engine they would have had, not that one (its broker or queue may be another's)."""
    from motir_celery.core.current import make_current, peek

    before = peek()
    yield
    make_current(before)


@pytest.fixture(autouse=True)
def _clean_tables(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests that use the database start from empty tables, with the session's URL in the environment."""
    if "database_url" in request.fixturenames or "engine" in request.fixturenames:
        from motir_celery.store.db import get_engine

        url = request.getfixturevalue("database_url")
        if os.environ.get("MOTIR_DATABASE_URL") != url:
            # Another session fixture left its own database there (the motir_celery.testing plugin's
            # motir_database_url names its database for the rest of its session): this session's
            # tests, and the workers they start from os.environ, use this session's database.
            os.environ["MOTIR_DATABASE_URL"] = url
            motir_settings.reset_settings()
        for attempt in range(5):
            try:
                with get_engine(motir_settings.Settings.from_env(), url).begin() as conn:
                    conn.execute(text(
                        "TRUNCATE job_run_dlq, job_step, job_run, job_queue, job_event, job_stats_rollup, job_registry, job_quota, job_admission,"
                        " test.side_effect CASCADE;"
                        " UPDATE job_sweep SET swept_at = '-infinity', swept_by = NULL"  # the next sweep may run
                    ))
                break
            except OperationalError as exc:
                # A process of the test before (a worker finishing its warm shutdown) may still be
                # in a statement that locks job_queue, then job_run: TRUNCATE takes them the other
                # way round, and Postgres ends the deadlock by aborting one side. Ours: again.
                if not isinstance(exc.orig, psycopg.errors.DeadlockDetected) or attempt == 4:
                    raise
                time.sleep(0.2)
    yield


#: `make test-pgbouncer` sets MOTIR_TEST_SCAN_WORKER_LOGS=1: then a test whose worker (or beat)
#: logs under its tmp_path name a database error (motir_celery/dev/private.py, DATABASE_ERRORS) fails, even if its
#: assertions passed.
_scan_logs = os.environ.get("MOTIR_TEST_SCAN_WORKER_LOGS") == "1"
_tmp_path_key = pytest.StashKey[Path]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = yield
    if not _scan_logs:
        return report
    if call.when == "call" and isinstance(getattr(item, "funcargs", None), dict):
        if isinstance(tmp := item.funcargs.get("tmp_path"), Path):  # type: ignore[attr-defined]
            item.stash[_tmp_path_key] = tmp
    elif call.when == "teardown" and report.passed and _tmp_path_key in item.stash:
        # At teardown every worker fixture has stopped, so its log is complete.
        found = database_errors(item.stash[_tmp_path_key])
        if found:
            report.outcome = "failed"
            report.longrepr = ("worker logs hold database errors (MOTIR_TEST_SCAN_WORKER_LOGS=1):\n"
                               + "\n".join(found[:40]) + (f"\n... {len(found) - 40} more" if len(found) > 40 else ""))
    return report


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Skips are said again, loudly, at the very end; under CI they fail the run (pytest_sessionfinish)."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if r.when in ("setup", "call")]
    if not skipped:
        return
    reasons: dict[str, int] = {}
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reasons[reason] = reasons.get(reason, 0) + 1
    verdict = "CI fails on any skip" if os.environ.get("CI") else "not run on this machine"
    terminalreporter.section(f"{len(skipped)} test(s) SKIPPED: {verdict}", sep="!", yellow=True, bold=True)
    for reason, n in sorted(reasons.items()):
        terminalreporter.line(f"{n:4d} x {reason}", yellow=True)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput") or not os.environ.get("CI"):
        return  # the xdist controller (or a plain session) decides; off CI a skip is only reported
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = [r for r in (reporter.stats.get("skipped", []) if reporter else []) if r.when in ("setup", "call")]
    if skipped and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def count_effects(eng: Engine, run_id: object, step: str | None = None) -> int:
    """How many times a step body really ran (tests.fixtures.jobs records each execution)."""
    sql = "SELECT count(*) FROM test.side_effect WHERE run_id = :r" + (" AND step = :s" if step else "")
    with eng.connect() as conn:
        return int(conn.execute(text(sql), {"r": str(run_id), "s": step}).scalar_one())


class Worker:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path, nodename: str) -> None:
        # nodename: the worker's hostname in its events and the destination of control commands
        self.proc, self.log, self.nodename = proc, log, nodename

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group: the main process and its pool children."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def celery_worker(tmp_path: Path, *, broker: str, concurrency: int = 2, pool: str = "prefork",
                  env: dict[str, str] | None = None, name: str = "w", lease: float | None = None,
                  sweep_interval: float = 1.0, app: str = "motir_celery") -> Iterator[Worker]:
    """A real `celery -A <app> worker` process, ready to consume when yielded."""
    log = tmp_path / f"worker-{name}-{uuid.uuid4().hex[:6]}.log"
    child_env = dict(os.environ)
    child_env.update({
        "CELERY_BROKER_URL": broker,
        "MOTIR_IMPORTS": "tests.fixtures.jobs",
        "MOTIR_SWEEP_INTERVAL": str(sweep_interval),
        "MOTIR_REPUBLISH_AFTER": child_env.get("MOTIR_REPUBLISH_AFTER", "5"),
        "PYTHONPATH": str(ROOT),
    })
    if lease is not None:
        child_env["MOTIR_LEASE_SECONDS"] = str(lease)
    child_env.update(env or {})
    # Expanded as `celery worker -n` does, so tests can address the worker and match its events.
    nodename = host_format(default_nodename(f"{name}-{uuid.uuid4().hex[:6]}@%h"))
    cmd = [sys.executable, "-m", "celery", "-A", app, "worker", "-l", "INFO",
           "-c", str(concurrency), "-P", pool, "-n", nodename,
           "-Q", child_env.get("MOTIR_QUEUE", "celery"), "--without-gossip", "--without-mingle"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=child_env, cwd=ROOT,
                                start_new_session=True)
    worker = Worker(proc, log, nodename)
    try:
        deadline = time.monotonic() + 60
        while "ready." not in worker.output():
            if proc.poll() is not None:
                raise RuntimeError(f"celery worker exited with {proc.returncode}:\n{worker.output()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"celery worker not ready after 60s:\n{worker.output()[-4000:]}")
            time.sleep(0.1)
        yield worker
    finally:
        stop_group(proc)


def children(pid: int) -> list[int]:
    """The processes ``pid`` forked (a prefork worker's pool children)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def stop_group(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """Stop a process started with ``start_new_session=True`` and everything it forked: SIGTERM
    to its process group, SIGKILL if it is still there after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def run_state(eng: Engine, run_id: object) -> str | None:
    with eng.connect() as conn:
        return conn.execute(text("SELECT state FROM job_queue WHERE id = :id"), {"id": run_id}).scalar()


# --- the dashboard in a real browser (tests/fixtures/browser.py has the helpers) ----------


@pytest.fixture(scope="module")
def browser() -> Iterator["Browser"]:
    from playwright.sync_api import sync_playwright

    from tests.fixtures.browser import CHROMIUM, CHROMIUM_ARGS

    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.fail(
            f"Chromium not found at {CHROMIUM}. The browser tests use Debian's package: "
            "run `apt-get install -y chromium` (.ci/run installs it), or set MOTIR_CHROMIUM to its path.",
            pytrace=False,
        )
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def dashboard(database_url: str, broker_url: str) -> Iterator[str]:
    """The dashboard on 127.0.0.1:<free port>, publishing replays to the session's queue."""
    import threading

    import uvicorn

    from motir_celery.adapter.celery_app import default_engine
    from motir_celery.ops.dashboard import DashboardConfig, create_app
    from tests.fixtures.browser import free_port

    # An engine of the dashboard's own, its Celery app (the session's queue) built on its first replay.
    app = create_app(DashboardConfig(secret=uuid.uuid4().hex), engine=default_engine())
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, name="dashboard", daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=15, what="the dashboard to listen")
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
