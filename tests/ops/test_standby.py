"""Reads from a hot standby: the dashboard and the CLI read there under RLS, write to the primary.

A private primary and a streaming hot standby of it, started for this module
(``tests/fixtures/replication.py``); the machine's shared server is not touched. Every login is
a real one of the role it stands for: the engine a member of ``motir_engine`` on the
primary, the app and admin logins members of ``motir_app`` / ``motir_admin`` reading the
standby. Outcomes are asserted on the primary, as its owner.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import InternalError
from starlette.testclient import TestClient

from motir_celery.dev.private import PrivatePostgres
from motir_celery.ops.cli import main
from motir_celery.ops.dashboard import DashboardConfig, create_app
from motir_celery.ops.dashboard.auth import CsrfTokens, Identity
from motir_celery.settings import Settings, reset_settings
from motir_celery.store.db import dispose_engines
from tests.chaos.harness import create_database
from tests.fixtures.engines import holding
from tests.fixtures.ops_helpers import dead_letter, emit
from tests.fixtures.replication import PrivateStandby, primary_lsn, wait_replayed

ALICE = {"X-Motir-User": "alice", "X-Motir-Workspace": "ws-a"}
BOB = {"X-Motir-User": "bob", "X-Motir-Workspace": "ws-b"}
OPS = {"X-Motir-User": "ops", "X-Motir-Admin": "true"}
PROXY = ("127.0.0.1", 50000)


@dataclass
class Cluster:
    primary: PrivatePostgres
    standby: PrivateStandby
    #: The owner of the database on the primary (asserts) and on the standby (pausing replay).
    owner_url: str
    standby_owner_url: str
    owner: Engine

    def caught_up(self) -> None:
        wait_replayed(self.standby_owner_url, primary_lsn(self.owner_url))

    def on_standby(self, sql: str) -> Any:
        eng = create_engine(self.standby_owner_url)
        try:
            with eng.connect() as conn:
                return conn.execute(text(sql)).scalar()
        finally:
            eng.dispose()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    primary = PrivatePostgres().init()
    standby: PrivateStandby | None = None
    owner: Engine | None = None
    try:
        url = create_database(primary.url(), "motir")  # migrated to head, with the tests' ledger table
        owner = create_engine(url)
        with owner.begin() as conn:
            conn.execute(text("CREATE ROLE t_engine LOGIN IN ROLE motir_engine; "
                              "CREATE ROLE t_app LOGIN IN ROLE motir_app; "
                              "CREATE ROLE t_admin LOGIN IN ROLE motir_admin; "
                              # the test jobs' ledger of executed step bodies (not the product's schema)
                              "GRANT USAGE ON SCHEMA test TO t_engine; "
                              "GRANT SELECT, INSERT ON test.side_effect TO t_engine; "
                              "GRANT USAGE ON SEQUENCE test.side_effect_id_seq TO t_engine"))
        standby = PrivateStandby(primary).init()
        standby_url = make_url(url).set(port=standby.port).render_as_string(hide_password=False)
        wait_replayed(standby_url, primary_lsn(url))
        yield Cluster(primary, standby, url, standby_url, owner)
    finally:
        dispose_engines()
        if owner is not None:
            owner.dispose()
        if standby is not None:
            standby.close()
        primary.close()


@pytest.fixture(scope="module")
def logins(cluster: Cluster) -> Iterator[Settings]:
    """The environment every motir process reads: the engine on the primary, the readers on the standby."""
    def as_login(url: str, user: str) -> str:
        return make_url(url).set(username=user).render_as_string(hide_password=False)

    with pytest.MonkeyPatch.context() as env:
        env.setenv("MOTIR_DATABASE_URL", as_login(cluster.owner_url, "t_engine"))
        env.setenv("MOTIR_APP_DATABASE_URL", as_login(cluster.standby_owner_url, "t_app"))
        env.setenv("MOTIR_ADMIN_DATABASE_URL", as_login(cluster.standby_owner_url, "t_admin"))
        dispose_engines()
        reset_settings()
        yield Settings.from_env()
        dispose_engines()
        reset_settings()


@pytest.fixture
def primary(cluster: Cluster, logins: Settings) -> Engine:
    """The primary as its owner, with empty tables replayed on the standby."""
    with cluster.owner.begin() as conn:
        conn.execute(text("TRUNCATE job_run_dlq, job_step, job_run, job_queue, job_event, test.side_effect CASCADE"))
    cluster.caught_up()
    return cluster.owner


@pytest.fixture
def dashboard(logins: Settings) -> TestClient:
    app = create_app(DashboardConfig(secret="standby-test"), engine=holding(settings=logins))
    return TestClient(app, follow_redirects=False, client=PROXY)


def csrf(client: TestClient, headers: dict[str, str]) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', client.get("/dlq", headers=headers).text)
    assert match, "no form on /dlq"
    return match.group(1)


def run_ids(html: str) -> set[str]:
    return set(re.findall(r'href="/runs/([0-9a-f-]{36})"', html))


def motir(*args: str, ok: bool = True) -> Result:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, f"motir {' '.join(args)} exited {result.exit_code}:\n{result.output}"
    return result


def dlq_row(owner: Engine, dlq_id: uuid.UUID) -> Any:
    with owner.connect() as conn:
        return conn.execute(text("SELECT * FROM job_run_dlq WHERE id = :id"), {"id": dlq_id}).one()


def run_state(owner: Engine, run_id: uuid.UUID) -> str:
    with owner.connect() as conn:
        return str(conn.execute(text("SELECT state FROM job_queue WHERE id = :id"), {"id": run_id}).scalar_one())


@contextmanager
def replay_paused(cluster: Cluster) -> Iterator[None]:
    """Replay paused on the standby (it keeps receiving WAL); resumed and caught up afterwards."""
    cluster.on_standby("SELECT pg_wal_replay_pause()")
    deadline = time.monotonic() + 10
    while cluster.on_standby("SELECT pg_get_wal_replay_pause_state()") != "paused":
        assert time.monotonic() < deadline, "the standby did not pause its replay"
        time.sleep(0.02)
    try:
        yield
    finally:
        cluster.on_standby("SELECT pg_wal_replay_resume()")
        cluster.caught_up()


def received(cluster: Cluster) -> None:
    """Until the standby has received (not replayed) everything the primary has written."""
    target = primary_lsn(cluster.owner_url)
    deadline = time.monotonic() + 10
    while not cluster.on_standby(f"SELECT pg_last_wal_receive_lsn() >= '{target}'::pg_lsn"):
        assert time.monotonic() < deadline, "the standby did not receive the primary's WAL"
        time.sleep(0.02)


# --- the readers really are on a read-only standby ---------------------------------------


def test_the_reading_logins_are_on_a_standby_where_a_write_is_refused(primary: Engine, logins: Settings) -> None:
    with holding(settings=logins).session("ws-a") as s:
        assert s.execute(text("SELECT pg_is_in_recovery(), current_user")).one() == (True, "t_app")
    with pytest.raises(InternalError, match="read-only transaction"):
        with holding(settings=logins).session("ws-a") as s:
            s.execute(text("INSERT INTO job_event (id, name, data, workspace_id) "
                           "VALUES (gen_random_uuid(), 'x', '{}', 'ws-a')"))


# --- the dashboard --------------------------------------------------------------------


def test_the_dashboard_on_a_standby_shows_a_workspace_its_own_runs_and_dead_letters_only(
        primary: Engine, cluster: Cluster, dashboard: TestClient) -> None:
    a_run, a_dlq = dead_letter(primary, "ws-a")
    b_run, b_dlq = dead_letter(primary, "ws-b")
    cluster.caught_up()

    runs = dashboard.get("/runs", headers=ALICE)
    assert runs.status_code == 200
    assert str(a_run) in run_ids(runs.text) and str(b_run) not in run_ids(runs.text)
    assert 'data-testid="standby"' in runs.text and "caught up" in runs.text
    assert 'data-testid="standby-lag"' not in runs.text
    dlq = dashboard.get("/dlq", headers=ALICE).text
    assert f'data-dlq="{a_dlq}"' in dlq and f'data-dlq="{b_dlq}"' not in dlq
    assert dashboard.get(f"/runs/{b_run}", headers=ALICE).status_code == 404
    for page in ("/events", "/health", f"/runs/{a_run}"):
        response = dashboard.get(page, headers=ALICE)
        assert response.status_code == 200 and 'data-testid="standby"' in response.text, page

    # An admin reads the standby through the admin login: every workspace.
    admin = dashboard.get("/runs", headers=OPS).text
    assert {str(a_run), str(b_run)} <= run_ids(admin)
    assert "motir_up 1.0" in dashboard.get("/metrics").text


def test_replay_resume_dismiss_and_cancel_from_a_dashboard_on_a_standby_change_the_primary(
        primary: Engine, cluster: Cluster, dashboard: TestClient) -> None:
    _, to_replay = dead_letter(primary, "ws-a")
    failed_run, to_resume = dead_letter(primary, "ws-a")
    _, to_dismiss = dead_letter(primary, "ws-a")
    queued = emit("test.three", {"workspace_id": "ws-a"})["test.three-steps"]
    cluster.caught_up()
    token = csrf(dashboard, ALICE)

    replay = dashboard.post(f"/dlq/{to_replay}/replay", data={"csrf": token}, headers=ALICE)
    assert replay.status_code == 303 and "notice=replayed" in replay.headers["location"]
    assert "stale" not in replay.headers["location"]  # the redirect waited for the standby to replay it
    row = dlq_row(primary, to_replay)
    assert row.replayed_by == "alice" and row.replay_run_id is not None
    assert replay.headers["location"].startswith(f"/runs/{row.replay_run_id}")
    # Read-your-writes: the new run, made on the primary, is on the page read from the standby.
    assert dashboard.get(replay.headers["location"], headers=ALICE).status_code == 200

    resume = dashboard.post(f"/dlq/{to_resume}/resume", data={"csrf": token}, headers=ALICE)
    assert resume.status_code == 303 and "notice=resumed" in resume.headers["location"]
    assert dlq_row(primary, to_resume).resumed_by == "alice" and run_state(primary, failed_run) == "queued"

    dismiss = dashboard.post(f"/dlq/{to_dismiss}/dismiss", data={"csrf": token}, headers=ALICE)
    assert dismiss.status_code == 303 and "notice=dismissed" in dismiss.headers["location"]
    assert dlq_row(primary, to_dismiss).dismissed_by == "alice"
    assert f'data-dlq="{to_dismiss}"' not in dashboard.get("/dlq", headers=ALICE).text

    cancel = dashboard.post(f"/runs/{queued}/cancel", data={"csrf": token}, headers=ALICE)
    assert cancel.status_code == 303 and "notice=cancelled" in cancel.headers["location"]
    assert run_state(primary, queued) == "cancelled"


def test_another_workspace_cannot_act_through_the_standby_visibility_check(
        primary: Engine, cluster: Cluster, dashboard: TestClient) -> None:
    run_id, dlq_id = dead_letter(primary, "ws-a")
    cluster.caught_up()
    token = CsrfTokens("standby-test").issue(Identity("bob", "ws-b", False))  # bob's page has no form to take it from
    assert dashboard.post(f"/dlq/{dlq_id}/replay", data={"csrf": token}, headers=BOB).status_code == 404
    assert dashboard.post(f"/dlq/{dlq_id}/dismiss", data={"csrf": token}, headers=BOB).status_code == 404
    row = dlq_row(primary, dlq_id)
    assert row.replayed_at is None and row.dismissed_at is None and run_state(primary, run_id) == "failed"


def test_a_standby_with_replay_paused_is_shown_behind_and_caught_up_again_once_it_replays(
        primary: Engine, cluster: Cluster, dashboard: TestClient) -> None:
    _, dlq_id = dead_letter(primary, "ws-a")
    cluster.caught_up()
    token = csrf(dashboard, ALICE)
    with replay_paused(cluster):
        new_run = emit("test.three", {"workspace_id": "ws-a"})["test.three-steps"]
        received(cluster)
        page = dashboard.get("/runs", headers=ALICE).text
        assert 'data-testid="standby-lag"' in page and "received and not replayed yet" in page
        assert str(new_run) not in run_ids(page)  # the standby has not replayed it
        missing = dashboard.get(f"/runs/{new_run}", headers=ALICE)
        assert missing.status_code == 404 and "standby that is behind" in missing.text

        # A write still goes to the primary; the redirect, having waited in vain, says the page may lag.
        dismiss = dashboard.post(f"/dlq/{dlq_id}/dismiss", data={"csrf": token}, headers=ALICE)
        assert dismiss.status_code == 303 and "stale=1" in dismiss.headers["location"]
        assert dlq_row(primary, dlq_id).dismissed_by == "alice"
        after = dashboard.get(dismiss.headers["location"], headers=ALICE).text
        assert 'data-testid="stale"' in after and f'data-dlq="{dlq_id}"' in after  # the old state, said so

    page = dashboard.get("/runs", headers=ALICE).text
    assert 'data-testid="standby-lag"' not in page and "caught up" in page
    assert str(new_run) in run_ids(page)
    assert f'data-dlq="{dlq_id}"' not in dashboard.get("/dlq", headers=ALICE).text


# --- the CLI --------------------------------------------------------------------------


def test_the_cli_reads_the_standby_as_admin_and_its_writes_go_to_the_primary(
        primary: Engine, cluster: Cluster) -> None:
    a_run, a_dlq = dead_letter(primary, "ws-a")
    b_run, b_dlq = dead_letter(primary, "ws-b")
    queued = emit("test.three", {"workspace_id": "ws-b"})["test.three-steps"]
    cluster.caught_up()

    runs = motir("runs", "list", "--json")
    assert {str(a_run), str(b_run), str(queued)} <= {r["id"] for r in json.loads(runs.stdout)}
    assert runs.stderr == ""  # caught up: no note
    assert json.loads(motir("runs", "show", str(a_run), "--json").stdout)["run"]["state"] == "failed"
    listed = {e["id"] for e in json.loads(motir("dlq", "list", "--json").stdout)}
    assert listed == {str(a_dlq), str(b_dlq)}

    motir("dlq", "dismiss", str(a_dlq), "--actor", "ops")
    assert dlq_row(primary, a_dlq).dismissed_by == "ops"
    bulk = motir("dlq", "dismiss", "--workspace", "ws-b", "--actor", "ops", "--rate", "1000")
    assert "dismissed 1" in bulk.stdout and dlq_row(primary, b_dlq).dismissed_by == "ops"
    motir("cancel", str(queued))
    assert run_state(primary, queued) == "cancelled"


def test_the_cli_notes_on_stderr_when_its_standby_is_behind(primary: Engine, cluster: Cluster) -> None:
    with replay_paused(cluster):
        new_run = emit("test.three", {"workspace_id": "ws-a"})["test.three-steps"]
        received(cluster)
        runs = motir("runs", "list", "--json")
        assert json.loads(runs.stdout) == []  # stdout stays JSON: the note is on stderr
        assert "note: read from a standby" in runs.stderr and "of WAL behind the primary" in runs.stderr
        # Cancelled on the primary, although the standby does not show the run yet.
        motir("cancel", str(new_run))
        assert run_state(primary, new_run) == "cancelled"
