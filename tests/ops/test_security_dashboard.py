"""The dashboard as an attacker meets it: a real `motir dashboard` process, real HTTP.

Each check here was an attack that worked against 37a0e59 (issue 17): identity
headers from a peer that is not the proxy, a duplicated identity header, an
admin header spelled ``TRUE`` or ``1``, a header-mode dashboard on 0.0.0.0, a
clear-text or unsalted users file, and inputs that crashed a page (500) instead
of being refused (400). The peer address matters, so requests go over TCP: a
request "from another machine" comes from 127.0.0.2 (every 127/8 address is
loopback on Linux) to a dashboard that trusts only 127.0.0.1 as its proxy.
"""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator
from urllib.parse import quote

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

from motir_celery.ops.dashboard.passwords import hash_password

ROOT = Path(__file__).resolve().parents[2]
PROXY, STRANGER = "127.0.0.1", "127.0.0.2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _motir_dashboard(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    child = {k: v for k, v in os.environ.items() if not k.startswith("MOTIR_DASHBOARD_")}
    child.update({"PYTHONPATH": str(ROOT), **env})
    return subprocess.Popen([sys.executable, "-m", "motir_celery.ops.cli", "dashboard", *args], env=child,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _refused_to_start(env: dict[str, str], *args: str) -> str:
    proc = _motir_dashboard(env, *args)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, out
    assert "Traceback" not in out and "Uvicorn running" not in out, out
    return out


def request(port: int, path: str, headers: list[tuple[str, str]] | None = None, *,
            source: str = PROXY) -> tuple[int, str]:
    """One GET over TCP from ``source``; headers as a list, so one may be sent twice."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=(source, 0))
    try:
        conn.putrequest("GET", path)
        for name, value in headers or []:
            conn.putheader(name, value)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.read().decode("utf-8", "replace")
    finally:
        conn.close()


@pytest.fixture(scope="module")
def dashboard(database_url: str) -> Iterator[int]:
    """`motir dashboard` on loopback, header mode, believing identity headers from 127.0.0.1 only."""
    port = _free_port()
    proc = _motir_dashboard({"MOTIR_DATABASE_URL": database_url, "MOTIR_DASHBOARD_TRUSTED_PROXIES": f"{PROXY}/32",
                             "MOTIR_DASHBOARD_SECRET": "s"}, "--port", str(port), "--log-level", "warning")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if request(port, "/healthz")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the dashboard did not come up"
            time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture
def two_workspaces(engine: Engine) -> dict[str | None, str]:
    runs = {}
    with engine.begin() as conn:
        for ws in ("ws-a", "ws-b", None):
            runs[ws] = str(conn.execute(text(
                "INSERT INTO job_queue (job_id, event_name, workspace_id, max_attempts, retry_policy) "
                "VALUES ('test.sec', 'test.sec', :ws, 1, 'none') RETURNING id"), {"ws": ws}).scalar_one())
    return runs


ADMIN = [("X-Motir-User", "ops"), ("X-Motir-Admin", "true")]
ALICE = [("X-Motir-User", "alice"), ("X-Motir-Workspace", "ws-a")]


def test_identity_headers_from_a_peer_that_is_not_the_proxy_are_refused(
        dashboard: int, two_workspaces: dict[str | None, str]) -> None:
    status, body = request(dashboard, "/runs", ADMIN, source=STRANGER)
    assert status == 403 and "not a trusted proxy" in body
    assert not any(run in body for run in two_workspaces.values())
    # Control: the same headers from the proxy's address are believed.
    status, body = request(dashboard, "/runs", ADMIN, source=PROXY)
    assert status == 200 and all(run in body for run in two_workspaces.values())


@pytest.mark.parametrize("spelling", ["TRUE", "True", "yes", "On", "1", "true, true"])
def test_admin_needs_exactly_true(dashboard: int, spelling: str, two_workspaces: dict[str | None, str]) -> None:
    status, body = request(dashboard, "/runs", [("X-Motir-User", "ops"), ("X-Motir-Admin", spelling)])
    assert status == 400 and two_workspaces["ws-b"] not in body


@pytest.mark.parametrize("header", ["X-Motir-User", "X-Motir-Workspace", "X-Motir-Admin"])
def test_an_identity_header_sent_twice_is_refused(dashboard: int, header: str,
                                                   two_workspaces: dict[str | None, str]) -> None:
    # A proxy that appends the authenticated value after the client's own would let the client's win.
    values = {"X-Motir-User": ("mallory", "alice"), "X-Motir-Workspace": ("ws-b", "ws-a"),
              "X-Motir-Admin": ("true", "false")}[header]
    headers = [h for h in ALICE if h[0] != header] + [(header, v) for v in values]
    status, body = request(dashboard, "/runs", headers)
    assert status == 400 and "sent 2 times" in body and two_workspaces["ws-b"] not in body


BAD_INPUTS = [
    "/runs?since=99999999999d",
    "/runs?since=" + "9" * 400 + "d",
    "/runs?since=2024-01-01%00",
    "/runs?job=test.sec%00",
    "/runs?workspace=ws-a%00",
    "/runs?job=" + "j" * 5000,
    "/runs?limit=abc",
    "/runs?limit=100000",
    "/runs?state=exploded",
    "/runs?job=a&job=b",
    "/dlq?job=x%00",
    "/dlq?all=yes",
]


@pytest.mark.parametrize("path", BAD_INPUTS)
def test_inputs_that_once_crashed_a_page_are_refused_with_400_naming_the_parameter(dashboard: int, path: str) -> None:
    status, body = request(dashboard, path, ADMIN)
    assert status == 400, (status, body[:300])
    name = path.split("?")[1].split("=")[0]
    assert f"bad parameter &#39;{name}&#39;" in body or f"bad parameter '{name}'" in body, body[:500]


def test_banners_show_only_the_dashboards_own_messages(dashboard: int) -> None:
    lure = "Your session expired: sign in again at evil.example"
    status, body = request(dashboard, f"/runs?notice={quote(lure)}&error={quote(lure)}", ALICE)
    assert status == 200 and "evil.example" not in body
    status, body = request(dashboard, "/runs?notice=cancelled", ALICE)
    assert status == 200 and "cancelled (a running run stops at its next step boundary)" in body


def test_header_mode_on_a_public_address_without_trusted_proxies_does_not_start(database_url: str) -> None:
    out = _refused_to_start({"MOTIR_DATABASE_URL": database_url}, "--host", "0.0.0.0", "--port", str(_free_port()))
    assert "MOTIR_DASHBOARD_TRUSTED_PROXIES" in out


def test_development_mode_on_a_public_address_does_not_start_even_with_a_named_proxy(database_url: str) -> None:
    out = _refused_to_start({"MOTIR_DATABASE_URL": database_url, "MOTIR_DASHBOARD_TRUSTED_PROXIES": "10.0.0.0/8"},
                            "--host", "0.0.0.0", "--port", str(_free_port()))
    assert "development mode" in out


@pytest.mark.parametrize("line,mode,said", [
    ("alice:plain-password:ws-a", 0o600, "clear-text password"),
    ("alice:sha256:5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8:ws-a", 0o600, "unsalted"),
    (f"alice:{hash_password('pw', scheme='scrypt')}:ws-a", 0o666, "writable by group or others"),
], ids=["clear-text", "unsalted", "group-writable"])  # not the random salt: every xdist worker collects the same ids
def test_a_users_file_with_clear_text_unsalted_hashes_or_open_to_writers_is_refused(
        database_url: str, tmp_path: Path, line: str, mode: int, said: str) -> None:
    users = tmp_path / f"users-{uuid.uuid4().hex[:6]}"
    users.write_text(line + "\n")
    users.chmod(mode)
    out = _refused_to_start({"MOTIR_DATABASE_URL": database_url, "MOTIR_DASHBOARD_AUTH": "basic",
                             "MOTIR_DASHBOARD_USERS_FILE": str(users)}, "--port", str(_free_port()))
    assert said in out
