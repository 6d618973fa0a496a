"""A run's progress and streams where operators look: ``motir runs show``, the run page and its live events.

The runs are executed in this process (tests/fixtures/ops_helpers.py: ``Engine.execute``, what a worker
calls); the page in a real browser, following a run a real worker runs, is tests/ops/test_browser_live.py.
"""

from __future__ import annotations

import html
import json
import uuid
from typing import Any

import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

import tests.fixtures.stream_jobs as sj
from motir_celery.ops.cli import main
from motir_celery.ops.dashboard import DashboardConfig, create_app
from motir_celery.settings import reset_settings
from tests.fixtures.engines import holding
from tests.fixtures.ops_helpers import settle

ALICE = {"X-Motir-User": "alice", "X-Motir-Workspace": "ws-a"}
BOB = {"X-Motir-User": "bob", "X-Motir-Workspace": "ws-b"}


def watched_run(n: int = 3, workspace: str = "ws-a") -> uuid.UUID:
    handle = holding().apply_async(sj.watched, (n, 0.0), {}, {"workspace_id": workspace})
    assert handle.id is not None
    assert settle(handle.id, sj.watched.id).state == "succeeded"
    return handle.id


@pytest.fixture
def client(database_url: str) -> TestClient:
    return TestClient(create_app(DashboardConfig(secret="test-secret"), engine=holding()),
                      follow_redirects=False, client=("127.0.0.1", 50000))


def events(body: str) -> list[tuple[str, Any]]:
    found = []
    for block in body.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "event" in lines:
            found.append((lines["event"], json.loads(lines["data"])))
    return found


def test_runs_show_prints_the_progress_and_the_streams(database_url: str, broker_url: str) -> None:
    run_id = watched_run(3)
    reset_settings()
    out = CliRunner().invoke(main, ["runs", "show", str(run_id)], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    line = next(x for x in out.stdout.splitlines() if x.startswith("progress  "))
    assert line.startswith("progress  PROGRESS {") and '"done": 3' in line and "(attempt 1, " in line
    assert line.endswith("its last)")
    assert "streams (1)" in out.stdout and '"line 3"' in out.stdout
    detail = json.loads(CliRunner().invoke(main, ["runs", "show", str(run_id), "--json"]).stdout)
    assert detail["progress"]["meta"] == {"done": 3, "of": 3} and detail["streams"][0]["items"] == 3


def test_the_run_page_shows_progress_and_streams_and_its_live_events_end_with_the_run(client: TestClient) -> None:
    run_id = watched_run(3)
    page = client.get(f"/runs/{run_id}", headers=ALICE)
    assert page.status_code == 200
    shown = html.unescape(page.text)
    assert 'data-testid="progress-state">PROGRESS<' in shown and '"done":3' in shown
    assert shown.count('<li data-position="') == 3 and '"line 3"' in shown
    assert "script-src" not in page.headers["content-security-policy"]      # finished: no script at all
    assert "<script" not in page.text
    live = client.get(f"/runs/{run_id}/live", headers=ALICE)
    assert live.headers["content-type"].startswith("text/event-stream")
    got = events(live.text)
    kinds = [k for k, _ in got]
    assert kinds[0] == "hello" and kinds[-1] == "end" and kinds.count("item") == 3
    assert ("progress", {"state": "PROGRESS", "meta": {"done": 3, "of": 3}, "attempt": 1, "current": False}) in got
    assert [d["value"] for k, d in got if k == "item"] == ["line 1", "line 2", "line 3"]
    # another workspace: neither the page nor its events
    assert client.get(f"/runs/{run_id}", headers=BOB).status_code == 404
    other = client.get(f"/runs/{run_id}/live", headers=BOB)
    assert other.status_code == 404 and "line 1" not in other.text


def test_a_running_runs_page_carries_the_live_script_and_refreshes_itself_without_it(client: TestClient) -> None:
    handle = holding().apply_async(sj.watched, (3, 0.0), {}, {"workspace_id": "ws-a"})   # queued
    page = client.get(f"/runs/{handle.id}", headers=ALICE)
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "'unsafe-inline'" not in csp
    assert '<script src="/static/live.js" defer></script>' in page.text
    assert '<noscript><meta http-equiv="refresh" content="2"></noscript>' in page.text
    assert f'data-live="/runs/{handle.id}/live"' in page.text
    script = client.get("/static/live.js")
    assert script.status_code == 200 and "EventSource" in script.text
