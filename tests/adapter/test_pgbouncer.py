"""Every surface through PgBouncer in transaction pooling, on ONE server connection (issue 19).

A private PgBouncer (``motir_celery/dev/private.py``) with ``default_pool_size = 1`` fronts this
session's database: every client connection of the test shares one server session,
so anything the engine left in it — a prepared statement, a ``SET`` without
``LOCAL``, a role, an advisory lock, a ``LISTEN``, a temporary table, a held cursor —
would be seen by the next client, and is looked for at the end. Through it, with no setting
(each engine finds the pooler, store/pooler.py): ``send_event`` (alone and in the caller's
transaction), a run's claim, steps and settle, the sweeper, beat's slot enqueue and
a scheduler pass, the CLI's reads and the dashboard's pages.

The first test shows the pooler is real: with prepared statements on, two clients
collide on the one server session exactly as issue 19 found in the workers.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import psycopg
import pytest
from click.testing import CliRunner
from sqlalchemy import make_url
from sqlalchemy.orm import Session
from starlette.testclient import TestClient

import tests.fixtures.jobs  # noqa: F401  (the event jobs, for send_event's fan-out)
from motir_celery.dev.private import PgBouncer, pgbouncer_binary
from motir_celery.settings import Settings, reset_settings
from motir_celery.store.db import dispose_engines


@pytest.fixture(scope="module")
def bouncer(database_url: str) -> Iterator[PgBouncer]:
    if pgbouncer_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("pgbouncer is not installed in CI (.ci/system-packages installs it)")
        pytest.skip("pgbouncer is not installed (apt-get install pgbouncer)")
    # In `make test-pgbouncer` the session's URL is already a PgBouncer: front the server itself.
    server = os.environ.get("MOTIR_DIRECT_DATABASE_URL") or database_url
    with PgBouncer(server, pool_size=1) as b:
        yield b


@pytest.fixture
def through(bouncer: PgBouncer, database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """This process's engine settings point at the bouncer (no setting: the engines find it)."""
    url = bouncer.url(make_url(database_url).database)
    monkeypatch.setenv("MOTIR_DATABASE_URL", url)
    monkeypatch.delenv("MOTIR_APP_DATABASE_URL", raising=False)
    monkeypatch.delenv("MOTIR_ADMIN_DATABASE_URL", raising=False)
    dispose_engines()
    reset_settings()
    yield url
    dispose_engines()
    monkeypatch.undo()
    reset_settings()


def _dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def test_prepared_statements_collide_through_transaction_pooling(through: str) -> None:
    """The failure of issue 19, on purpose: the pooler hands client 2 the session client 1 prepared in."""
    one = psycopg.connect(_dsn(through), autocommit=True)
    two = psycopg.connect(_dsn(through), autocommit=True)
    try:
        one.execute("SELECT 1", prepare=True)
        with pytest.raises(psycopg.errors.DuplicatePreparedStatement):
            two.execute("SELECT 2", prepare=True)
    finally:
        one.close()
        two.close()
    with psycopg.connect(_dsn(through), autocommit=True) as conn:
        conn.execute("DEALLOCATE ALL")  # leave the one server session clean for what follows


def test_every_surface_works_through_pgbouncer_and_leaves_no_session_state(through: str, bouncer: PgBouncer,
                                                                           engine: Any, tmp_path: Path) -> None:
    from celery import Celery

    from motir_celery.adapter.beat import MotirScheduler, enqueue_slot
    from motir_celery.adapter.messages import host
    from motir_celery.core.engine import Engine
    from motir_celery.core.schedule import latest_slot
    from motir_celery.ops.cli import main
    from motir_celery.ops.dashboard import DashboardConfig
    from motir_celery.ops.dashboard import create_app as dashboard_app
    from motir_celery.store import pooler
    from motir_celery.testing import Held
    from tests.fixtures import beat_jobs
    from tests.fixtures.ops_helpers import dead_letter, run_event

    settings = Settings.from_env()
    assert str(bouncer.port) in (settings.database_url or "")
    quiet = Engine(settings, host=Held())  # an engine through the bouncer whose messages are held

    # send_event on its own connection, and in the caller's transaction (published only on commit)
    sent = quiet.send_event("test.three", {"workspace_id": "ws-a"})
    with Session(quiet.sql_engine()) as session, session.begin():
        in_tx = quiet.send_event("test.three", {"workspace_id": "ws-b"}, session=session)
    assert pooler.mode(quiet.pool()) == "unprepared (a transaction pooler was found)"
    # a run's claim, step records and settle (Engine.execute: what the worker's task calls), 3 runs
    for _ in range(3):
        run_event("test.three", {"workspace_id": "ws-a"})
    dead_run, _ = dead_letter(engine, "ws-a")
    # the sweeper, and beat: one slot enqueued, then a scheduler pass over every cron job
    assert quiet.sweep() is not None
    slot = latest_slot("* * * * * */2", "UTC", datetime.now(timezone.utc))
    assert slot is not None
    assert type(enqueue_slot(quiet, beat_jobs.EVERY_2S, slot)).__name__ == "Queued"
    beat_app = Celery("beat-test", set_as_current=False)
    host(beat_app, quiet)  # the beat's app hosts the engine whose messages are held
    scheduler = MotirScheduler(app=beat_app, schedule_filename=str(tmp_path / "schedule"), lazy=True)
    assert scheduler._motir_pass() >= 0

    # the CLI's reads (development mode: the engine's login, SET LOCAL ROLE to the readers)
    cli = CliRunner()
    for args in (["runs", "list"], ["runs", "show", str(sent.run_ids[0])], ["dlq", "list"], ["jobs"]):
        result = cli.invoke(main, args, catch_exceptions=False)
        assert result.exit_code == 0, f"motir {' '.join(args)}: {result.output}"
    # the dashboard's reads, as an admin and as one workspace
    client = TestClient(dashboard_app(DashboardConfig(secret="s"), engine=quiet),
                        follow_redirects=False, client=("127.0.0.1", 50000))
    ops = {"X-Motir-User": "ops", "X-Motir-Admin": "true"}
    alice = {"X-Motir-User": "alice", "X-Motir-Workspace": "ws-a"}
    for path, headers in (("/runs", ops), (f"/runs/{sent.run_ids[0]}", ops), ("/dlq", ops), ("/runs", alice),
                          ("/health", ops), ("/metrics", ops)):
        response = client.get(path, headers=headers)
        assert response.status_code == 200, f"GET {path}: {response.status_code} {response.text[:300]}"
    assert str(dead_run) in client.get("/dlq", headers=alice).text
    assert str(in_tx.run_ids[0]) not in client.get("/runs", headers=alice).text  # ws-b's run: RLS still holds

    # The one server session everything above went through holds nothing of theirs.
    dispose_engines()
    with psycopg.connect(_dsn(through), autocommit=True) as conn:
        state = conn.execute(
            "SELECT (SELECT count(*) FROM pg_prepared_statements) AS prepared,"
            " (SELECT count(*) FROM pg_listening_channels()) AS listening,"
            " (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()) AS advisory,"
            " (SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema()) AS temp_tables,"
            " (SELECT count(*) FROM pg_cursors) AS cursors,"
            " current_user = session_user AS own_role,"
            " coalesce(current_setting('motir.workspace_id', true), '') AS workspace,"
            " coalesce(current_setting('motir.system_admin', true), '') AS system_admin,"
            # PgBouncer itself SETs the parameters it tracks per client (application_name,
            # client_encoding, DateStyle, TimeZone, IntervalStyle, standard_conforming_strings).
            " (SELECT array_agg(name ORDER BY name) FROM pg_settings WHERE source = 'session' AND name NOT IN"
            "  ('application_name', 'client_encoding', 'DateStyle', 'TimeZone', 'IntervalStyle',"
            "   'standard_conforming_strings')) AS session_settings",
            prepare=False).fetchone()
    assert state == (0, 0, 0, 0, 0, True, "", "", None), state
    pools = [p for p in bouncer.show("POOLS") if p["database"] == make_url(through).database]
    assert pools and all(int(p["sv_active"]) + int(p["sv_idle"]) + int(p["sv_used"]) <= 1 for p in pools), pools


def test_a_migrated_database_needs_no_session_state_to_check_through_pgbouncer(through: str) -> None:
    """`motir migrate --check` reads through the pooler too; migrations themselves go direct
    (docs/operations.md, "Behind PgBouncer")."""
    from motir_celery.ops.cli import main

    result = CliRunner().invoke(main, ["migrate", "--check"], catch_exceptions=False,
                                env={"MOTIR_MIGRATE_DATABASE_URL": through})
    assert result.exit_code == 0 and "no drift" in result.stdout, result.output


@pytest.mark.parametrize("setting, status", [({}, "OK"), ({"detect_pooler": False}, "WARN")],
                         ids=["no setting", "detect_pooler=False"])
def test_doctor_sees_the_pooler_and_says_whether_statements_are_prepared_without_probing(
        through: str, setting: dict[str, bool], status: str) -> None:
    from dataclasses import replace

    from motir_celery.ops import doctor

    settings = replace(Settings.from_env(), **setting)
    (check,) = [c for c in doctor.run_checks(settings, timeout=1.0) if c.name == "pooler"]
    assert check.status == status, check
    assert "a pooler or proxy sits in between" in check.detail
    if status == "WARN":
        assert "detect_pooler" in check.fix


def test_the_log_scan_finds_database_errors_and_not_runs_that_failed_on_purpose(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """What `make test-pgbouncer` fails a test on (tests/conftest.py, MOTIR_TEST_SCAN_WORKER_LOGS=1).
    Not in this test's tmp_path, which that scan reads."""
    from motir_celery.dev.private import database_errors

    tmp_path = tmp_path_factory.mktemp("log-scan")

    (tmp_path / "scenario").mkdir()
    (tmp_path / "scenario" / "worker-w1.log").write_text(
        "[INFO/MainProcess] Task motir.test.three[1] succeeded\n"
        "[ERROR/ForkPoolWorker-1] Task motir.test.doomed[2] raised unexpected: RunFailed('run 2 failed for good')\n"
        "psycopg.errors.DuplicatePreparedStatement: prepared statement \"_pg3_0\" already exists\n"
        "[WARNING/MainProcess] sweep failed\n")
    (tmp_path / "notes.txt").write_text("psycopg.errors.Whatever in a file that is not a log\n")
    found = database_errors(tmp_path)
    assert [line.split(": ", 1)[0] for line in found] == ["scenario/worker-w1.log"] * 2
    assert "DuplicatePreparedStatement" in found[0] and "sweep failed" in found[1]
