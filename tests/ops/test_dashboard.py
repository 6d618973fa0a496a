"""The dashboard over HTTP: identity, workspace isolation by RLS, CSRF-protected actions, metrics."""

from __future__ import annotations

import re
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text
from starlette.testclient import TestClient

from motir_celery.ops.dashboard import AuthConfig, DashboardConfig, create_app
from motir_celery.ops.dashboard.auth import CsrfTokens, Identity
from motir_celery.ops.dashboard.passwords import hash_password
from motir_celery.store.sql import producer as producer_sql
from motir_celery.testing import Held
from tests.fixtures.engines import holding
from tests.fixtures.ops_helpers import dead_letter, emit, fix_switch, run_event

ALICE = {"X-Motir-User": "alice", "X-Motir-Workspace": "ws-a"}
BOB = {"X-Motir-User": "bob", "X-Motir-Workspace": "ws-b"}
OPS = {"X-Motir-User": "ops", "X-Motir-Admin": "true"}
PROXY = ("127.0.0.1", 50000)


@pytest.fixture
def published() -> Held:
    return Held()


@pytest.fixture
def client(database_url: str, published: Held) -> TestClient:
    # A loopback peer: header mode believes identity headers only from its trusted proxies (loopback by default).
    return TestClient(create_app(DashboardConfig(secret="test-secret"), engine=holding(published)),
                      follow_redirects=False,
                      client=PROXY)


def csrf(client: TestClient, headers: dict[str, str], page: str = "/dlq") -> str:
    body = client.get(page, headers=headers).text
    match = re.search(r'name="csrf" value="([^"]+)"', body)
    assert match, f"no form on {page}"
    return match.group(1)


def token_for(user: str) -> str:
    """A valid token of ``user``, as the dashboard mints it (same secret)."""
    return CsrfTokens("test-secret").issue(Identity(user, None, True))


def run_ids(html: str) -> set[str]:
    return set(re.findall(r'href="/runs/([0-9a-f-]{36})"', html))


# --- identity ---------------------------------------------------------------------


@pytest.mark.parametrize("method,path", [("GET", "/runs"), ("GET", "/dlq"), ("GET", "/health"),
                                         ("GET", f"/runs/{uuid.uuid4()}"), ("POST", f"/dlq/{uuid.uuid4()}/replay")],
                         ids=lambda v: re.sub(r"[0-9a-f-]{36}", "ID", v))  # the same ids in every xdist worker
def test_every_page_and_action_refuses_an_anonymous_caller(client: TestClient, method: str, path: str) -> None:
    response = client.request(method, path)
    assert response.status_code == 401
    assert "X-Motir-User" in response.text


def test_a_user_with_neither_a_workspace_nor_admin_sees_nothing(client: TestClient) -> None:
    response = client.get("/runs", headers={"X-Motir-User": "mallory"})
    assert response.status_code == 403 and "no workspace" in response.text


def test_identity_header_names_are_configurable(database_url: str) -> None:
    auth = AuthConfig(user_header="X-Forwarded-User", workspace_header="X-Forwarded-Tenant", admin_header="X-Ops")
    app = TestClient(create_app(DashboardConfig(auth=auth)), client=PROXY)
    assert app.get("/runs", headers=ALICE).status_code == 401
    page = app.get("/runs", headers={"X-Forwarded-User": "alice", "X-Forwarded-Tenant": "ws-a"})
    assert page.status_code == 200 and "alice · ws-a" in page.text


def test_basic_auth_reads_users_from_the_users_file_and_challenges_without_credentials(
        database_url: str, tmp_path: Path) -> None:
    users = tmp_path / "users"
    users.write_text(f"# user:hash:workspace\nalice:{hash_password('plain-pw')}:ws-a\n"
                     f"ops:{hash_password('s3cret:with:colons', scheme='scrypt')}:*\n")
    users.chmod(0o600)
    app = TestClient(create_app(DashboardConfig(auth=AuthConfig(mode="basic", users_file=str(users)))),
                     client=PROXY)
    challenge = app.get("/runs")
    assert challenge.status_code == 401 and challenge.headers["www-authenticate"].startswith("Basic realm=")
    assert app.get("/runs", auth=("alice", "wrong")).status_code == 401
    assert app.get("/runs", auth=("nobody", "plain-pw")).status_code == 401
    assert "alice · ws-a" in app.get("/runs", auth=("alice", "plain-pw")).text
    assert "ops · admin · all workspaces" in app.get("/runs", auth=("ops", "s3cret:with:colons")).text
    assert app.get("/runs", headers=OPS).status_code == 401  # headers mean nothing in basic mode


# --- workspace isolation ----------------------------------------------------------------


def test_a_workspace_user_sees_only_their_workspace_and_gets_404_for_another_workspaces_run(
        client: TestClient, engine: Any) -> None:
    (a_run,) = run_event("test.three", {"workspace_id": "ws-a"}).values()
    (b_run,) = run_event("test.three", {"workspace_id": "ws-b"}).values()

    assert run_ids(client.get("/runs", headers=ALICE).text) == {str(a_run)}
    assert run_ids(client.get("/runs", headers=BOB).text) == {str(b_run)}
    stolen = client.get(f"/runs/{a_run}", headers=BOB)
    assert stolen.status_code == 404 and "test.three-steps" not in stolen.text
    # The workspace filter is an admin's tool; a user cannot widen their view with it.
    assert run_ids(client.get("/runs?workspace=ws-a", headers=BOB).text) == {str(b_run)}
    assert run_ids(client.get("/runs", headers=OPS).text) == {str(a_run), str(b_run)}
    assert run_ids(client.get("/runs?workspace=ws-b", headers=OPS).text) == {str(b_run)}


def test_system_runs_are_visible_to_admins_only(client: TestClient, engine: Any) -> None:
    with holding().pool().begin() as conn:
        cron_run = producer_sql.enqueue_scheduled(conn, "test.some-cron", datetime(2024, 1, 1, tzinfo=timezone.utc),
                                           max_attempts=1, policy="none")
    assert str(cron_run.run_id) in run_ids(client.get("/runs", headers=OPS).text)  # type: ignore[union-attr]
    assert run_ids(client.get("/runs", headers=ALICE).text) == set()
    assert client.get(f"/runs/{cron_run.run_id}", headers=ALICE).status_code == 404  # type: ignore[union-attr]
    page = client.get(f"/runs/{cron_run.run_id}", headers=OPS).text  # type: ignore[union-attr]
    assert "Cron slot" in page and "system" in page


def test_the_dlq_and_health_pages_count_only_the_callers_workspace(client: TestClient, engine: Any) -> None:
    _, a_dlq = dead_letter(engine, "ws-a")
    assert str(a_dlq) in client.get("/dlq", headers=ALICE).text
    assert str(a_dlq) not in client.get("/dlq", headers=BOB).text
    assert 'data-testid="queued">0<' in client.get("/health", headers=BOB).text
    assert "test.mixed-fail" not in client.get("/health", headers=BOB).text
    assert "test.mixed-fail" in client.get("/health", headers=ALICE).text


# --- run page -----------------------------------------------------------------------


def test_a_run_page_shows_the_step_timeline_attempts_errors_and_workers(client: TestClient, engine: Any) -> None:
    (run_id,) = run_event("test.flaky", {"workspace_id": "ws-a", "note": "<script>alert(1)</script>"}).values()
    page = client.get(f"/runs/{run_id}", headers=ALICE).text
    assert page.count('class="bar bar-step') == 3 and page.count('class="bar bar-attempt') == 2
    assert "RuntimeError</strong>: first attempt fails after step b" in page
    assert "ops-test@host/1" in page and "Traceback (most recent call last)" in page
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;" in page  # autoescaped


# --- replay -----------------------------------------------------------------------


def test_replay_records_the_user_from_the_identity_and_shows_the_new_run(
        client: TestClient, engine: Any, published: Held) -> None:
    switch = uuid.uuid4().hex
    run_id, dlq_id = dead_letter(engine, "ws-a", switch)
    fix_switch(engine, switch)

    response = client.post(f"/dlq/{dlq_id}/replay", data={"csrf": csrf(client, ALICE)}, headers=ALICE)

    assert response.status_code == 303
    new_run = response.headers["location"].split("?")[0].rsplit("/", 1)[1]
    with engine.connect() as conn:
        row = conn.execute(text("SELECT replayed_by, replay_run_id FROM job_run_dlq WHERE id = :d"), {"d": dlq_id}).one()
    assert row.replayed_by == "alice" and str(row.replay_run_id) == new_run
    assert published == [(row.replay_run_id, "test.mixed-fail", 0.0)]  # published after commit, that job only
    page = client.get(response.headers["location"], headers=ALICE).text
    assert "replayed: this is the new run" in page and "Replay of" in page
    assert '<meta http-equiv="refresh"' in page  # a queued run's page follows it
    original = client.get(f"/runs/{run_id}", headers=ALICE).text
    assert "Replayed by <strong>alice</strong>" in original and 'data-testid="replay"' not in original


def test_replay_without_a_csrf_token_or_with_someone_elses_is_refused(client: TestClient, engine: Any) -> None:
    _, dlq_id = dead_letter(engine, "ws-a")
    no_token = client.post(f"/dlq/{dlq_id}/replay", data={}, headers=ALICE)
    forged = client.post(f"/dlq/{dlq_id}/replay", data={"csrf": "alice.forged.token"}, headers=ALICE)
    other_users = client.post(f"/dlq/{dlq_id}/replay", data={"csrf": token_for("eve")}, headers=ALICE)
    for response in (no_token, forged, other_users):
        assert response.status_code == 403 and "reload the page" in response.text
    with engine.connect() as conn:
        assert conn.execute(text("SELECT replayed_at FROM job_run_dlq WHERE id = :d"), {"d": dlq_id}).scalar() is None


def test_replay_posted_from_another_site_is_refused_even_with_a_token(client: TestClient, engine: Any) -> None:
    _, dlq_id = dead_letter(engine, "ws-a")
    token = csrf(client, ALICE)
    cross = client.post(f"/dlq/{dlq_id}/replay", data={"csrf": token},
                        headers={**ALICE, "Origin": "https://evil.example"})
    fetch_meta = client.post(f"/dlq/{dlq_id}/replay", data={"csrf": token},
                             headers={**ALICE, "Sec-Fetch-Site": "cross-site"})
    assert cross.status_code == 403 and fetch_meta.status_code == 403
    same = client.post(f"/dlq/{dlq_id}/replay", data={"csrf": token}, headers={**ALICE, "Origin": "http://testserver"})
    assert same.status_code == 303


def test_a_user_cannot_replay_an_entry_of_another_workspace(client: TestClient, engine: Any, published: Held) -> None:
    _, a_dlq = dead_letter(engine, "ws-a")
    response = client.post(f"/dlq/{a_dlq}/replay", data={"csrf": token_for("bob")}, headers=BOB)
    assert response.status_code == 404
    with engine.connect() as conn:
        assert conn.execute(text("SELECT replayed_at FROM job_run_dlq WHERE id = :d"), {"d": a_dlq}).scalar() is None
    assert published == []


def test_dismiss_and_cancel_are_audited_actions_too(client: TestClient, engine: Any) -> None:
    _, dlq_id = dead_letter(engine, "ws-a")
    token = csrf(client, ALICE)
    assert client.post(f"/dlq/{dlq_id}/dismiss", data={"csrf": token}, headers=ALICE).status_code == 303
    with engine.connect() as conn:
        assert conn.execute(text("SELECT dismissed_by FROM job_run_dlq WHERE id = :d"), {"d": dlq_id}).scalar() == "alice"
    (queued,) = emit("test.three", {"workspace_id": "ws-a"}).values()
    assert client.post(f"/runs/{queued}/cancel", data={"csrf": token}, headers=BOB).status_code == 403  # alice's token
    assert client.post(f"/runs/{queued}/cancel", data={"csrf": token_for("bob")}, headers=BOB).status_code == 404
    done = client.post(f"/runs/{queued}/cancel", data={"csrf": token}, headers=ALICE)
    assert done.status_code == 303 and done.headers["location"].endswith("?notice=cancelled")
    assert "cancelled (a running run" in client.get(done.headers["location"], headers=ALICE).text
    with engine.connect() as conn:
        assert conn.execute(text("SELECT state FROM job_queue WHERE id = :r"), {"r": queued}).scalar() == "cancelled"


# --- safety -------------------------------------------------------------------------


def test_pages_carry_a_strict_csp_deny_framing_and_show_no_secrets(client: TestClient, engine: Any,
                                                                   database_url: str) -> None:
    run_event("test.three", {"workspace_id": "ws-a"})
    for path in ("/runs", "/dlq", "/health"):
        response = client.get(path, headers=OPS)
        assert "script-src" not in response.headers["content-security-policy"]  # default-src 'none': no scripts
        assert "default-src 'none'" in response.headers["content-security-policy"]
        assert response.headers["x-frame-options"] == "DENY" and response.headers["cache-control"] == "no-store"
        assert "postgresql" not in response.text and "redis://" not in response.text and "<script" not in response.text


# --- metrics ------------------------------------------------------------------------


def _samples(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body = client.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def test_metrics_expose_depth_oldest_due_run_attempts_durations_and_dlq_without_identity(
        client: TestClient, engine: Any) -> None:
    run_event("test.flaky", {"workspace_id": "ws-a"})
    _, dlq_id = dead_letter(engine, "ws-b")
    (queued,) = emit("test.slow", {"workspace_id": "ws-a"}).values()
    with engine.begin() as conn:
        conn.execute(text("UPDATE job_queue SET run_at = now() - interval '90 seconds' WHERE id = :r"), {"r": queued})

    m = _samples(client)

    assert m[("motir_up", ())] == 1
    assert m[("motir_runs", (("job", "test.slow"), ("state", "queued")))] == 1
    assert m[("motir_runs", (("job", "test.slow"), ("state", "failed")))] == 0  # zeros present: alerts need them
    assert 89 < m[("motir_oldest_due_run_age_seconds", (("job", "test.slow"),))] < 200
    assert m[("motir_dlq_open", (("job", "test.mixed-fail"),))] == 1
    assert m[("motir_attempts_recent", (("job", "test.fail-after-two"), ("outcome", "retrying")))] == 1
    assert ("motir_run_duration_recent_seconds", (("job", "test.fail-after-two"), ("quantile", "0.95"), ("state", "succeeded"))) in m
    assert ("motir_step_duration_seconds", (("job", "test.fail-after-two"), ("quantile", "0.5"))) in m
    assert not any("ws-a" in str(labels) or "workspace" in str(labels) for _, labels in m)  # no tenant ids

    holding().replay_dlq(dlq_id, actor="ops")
    m = _samples(client)
    assert m[("motir_dlq_open", (("job", "test.mixed-fail"),))] == 0
    assert m[("motir_dlq_replays_recent", (("job", "test.mixed-fail"),))] == 1


def test_metrics_answer_with_motir_up_0_when_the_database_is_down(database_url: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from motir_celery.settings import Settings

    down = Settings(database_url="postgresql+psycopg://nobody@127.0.0.1:1/nothing")
    app = TestClient(create_app(DashboardConfig(), settings=down))
    response = app.get("/metrics")
    assert response.status_code == 200 and "motir_up 0.0" in response.text
    assert app.get("/healthz").text == "ok"


def test_a_workspaces_health_page_says_where_it_stands_in_admission(client: TestClient, engine: Any) -> None:
    """Its own quota and load, read under RLS: ws-a's cap and its held runs, never ws-b's."""
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO job_quota (workspace_id, weight, max_running) VALUES ('ws-a', 3, 10), "
                          "('ws-b', 7, 99)"))
        conn.execute(text(
            "INSERT INTO job_queue (job_id, event_name, workspace_id, max_attempts, retry_policy, dispatched_at) "
            "SELECT 'job.a', 'e', 'ws-a', 3, 'transient', 'infinity' FROM generate_series(1, 312)"))
    page = client.get("/health", headers=ALICE).text
    assert "0 of 10 in flight (0 running)" in page and "312 queued, waiting for their turn; weight 3" in page
    bob = client.get("/health", headers=BOB).text
    assert "0 of 99 in flight" in bob and "0 queued, waiting" in bob and "weight 7" in bob

# --- offboarding (issue 47) -----------------------------------------------------------------------


def test_an_operator_cancels_a_workspaces_work_from_the_runs_page_and_a_tenant_cannot(
        client: TestClient, engine: Any) -> None:
    for n in range(3):
        emit("test.slow", {"n": n, "workspace_id": "ws-a"})
    emit("test.slow", {"n": 9, "workspace_id": "ws-b"})

    def states(ws: str) -> dict[str, int]:
        with engine.connect() as conn:
            return dict(conn.execute(text("SELECT coalesce(cancelled_by, state), count(*) FROM job_queue "
                                          "WHERE workspace_id = :ws GROUP BY 1"), {"ws": ws}).all())

    assert 'data-testid="offboard"' in client.get("/runs?workspace=ws-a", headers=OPS).text
    assert 'data-testid="offboard"' not in client.get("/runs", headers=ALICE).text
    form = {"workspace": "ws-a", "reason": "contract ended", "confirm": "1"}
    tenant = client.post("/workspaces/cancel", data={**form, "csrf": token_for("alice")}, headers=ALICE)
    assert tenant.status_code == 403 and "for operators" in tenant.text and states("ws-a") == {"queued": 3}
    token = csrf(client, OPS, "/runs?workspace=ws-a")
    unticked = client.post("/workspaces/cancel", data={**form, "confirm": "", "csrf": token}, headers=OPS)
    assert unticked.status_code == 400 and states("ws-a") == {"queued": 3}
    no_token = client.post("/workspaces/cancel", data=form, headers=OPS)
    assert no_token.status_code == 403 and states("ws-a") == {"queued": 3}
    done = client.post("/workspaces/cancel", data={**form, "csrf": token}, headers=OPS)
    assert done.status_code == 303 and "workspace=ws-a" in done.headers["location"]
    assert "notice=workspace-cancelled" in done.headers["location"]
    assert states("ws-a") == {"ops": 3} and states("ws-b") == {"queued": 1}   # the operator's name on each
    with engine.connect() as conn:
        assert conn.execute(text("SELECT DISTINCT cancel_reason FROM job_queue WHERE workspace_id = 'ws-a'")
                            ).scalar_one() == "contract ended"


# --- admission: the operator's view (issue 46) ----------------------------------------------------


def test_an_operator_sees_the_fleets_admission_and_every_workspaces_quota_and_a_tenant_is_refused(
        client: TestClient, engine: Any) -> None:
    """/quotas: the fleet's limit, in flight and held, and per workspace its weight, cap, in flight and
    held, as ``motir quota show`` reads them; the nav links it for operators only."""
    off = client.get("/quotas", headers=OPS)
    assert off.status_code == 200 and 'data-testid="fleet-limit">off<' in off.text
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO job_admission (name, max_in_flight, updated_by) VALUES ('fleet', 64, 'ops')"))
        conn.execute(text("INSERT INTO job_quota (workspace_id, weight, max_running, updated_by) "
                          "VALUES ('ws-a', 3, 10, 'ops'), ('ws-b', 7, NULL, 'ops')"))
        insert = ("INSERT INTO job_queue (job_id, event_name, workspace_id, max_attempts, retry_policy, state, "
                  "dispatched_at) SELECT 'job.a', 'e', :ws, 3, 'transient', :state, :at FROM generate_series(1, :n)")
        for ws, state, at, n in (("ws-a", "running", "-infinity", 8), ("ws-a", "queued", "infinity", 312),
                                 ("ws-b", "queued", "-infinity", 2), ("ws-c", "queued", "infinity", 5)):
            conn.execute(text(insert), {"ws": ws, "state": state, "at": at, "n": n})
    page = client.get("/quotas", headers=OPS)
    assert page.status_code == 200
    html = page.text
    assert 'data-testid="fleet-limit">64<' in html
    assert 'data-testid="fleet-in-flight">10<' in html and 'data-testid="fleet-held">317<' in html
    assert "ws-a: 8 of 10 in flight, 312 held" in html
    assert "ws-b: 2 in flight, 0 held" in html            # no cap: no "of"
    assert "without a quota row (weight 1, no cap): 0 in flight, 5 held" in html   # ws-c
    assert 'data-testid="nav-quotas"' in html
    tenant = client.get("/quotas", headers=ALICE)
    assert tenant.status_code == 403 and "for operators" in tenant.text and "312" not in tenant.text
    assert 'data-testid="nav-quotas"' not in client.get("/health", headers=ALICE).text
