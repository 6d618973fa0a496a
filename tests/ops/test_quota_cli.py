"""`motir quota`: an operator turns admission on and changes a workspace's weight and cap, live."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import text
from sqlalchemy.engine import Engine

from motir_celery.ops.cli import main
from motir_celery.settings import reset_settings


def motir(*args: str, ok: bool = True) -> Result:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, f"motir {' '.join(args)} exited {result.exit_code}:\n{result.output}"
    return result


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, database_url: str):  # type: ignore[no-untyped-def]
    reset_settings()
    yield monkeypatch
    reset_settings()


def test_quota_set_and_show_and_admission_on_and_off(env: pytest.MonkeyPatch, engine: Engine) -> None:
    assert "admission: off" in motir("quota", "show").output
    assert "at most 16" in motir("quota", "admission", "--in-flight", "16", "--actor", "ops").output
    out = motir("quota", "set", "ws-a", "--weight", "3", "--max-running", "5", "--actor", "alice").output
    assert "ws-a: weight 3, at most 5 in flight (by alice)" in out
    # a value not given is kept; --no-cap removes the cap
    assert "weight 3, no cap" in motir("quota", "set", "ws-a", "--no-cap", "--actor", "bob").output
    motir("quota", "set", "--system", "--weight", "2", "--actor", "alice")
    shown = json.loads(motir("quota", "show", "--json").output)
    assert shown["fleet"]["fleet_limit"] == 16
    assert [(w["workspace_id"], w["weight"], w["max_running"], w["updated_by"]) for w in shown["workspaces"]] == [
        (None, 2, None, "alice"), ("ws-a", 3, None, "bob")]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT updated_by FROM job_admission WHERE name = 'fleet'")).scalar() == "ops"
    assert "admission off" in motir("quota", "admission", "--off", "--actor", "ops").output
    assert "admission: off" in motir("quota", "show").output


def test_quota_refuses_what_it_cannot_mean(env: pytest.MonkeyPatch, engine: Engine) -> None:
    assert motir("quota", "set", "ws-a", "--actor", "x", ok=False).exit_code == 2
    assert motir("quota", "set", "ws-a", "--weight", "0", "--actor", "x", ok=False).exit_code == 2
    assert motir("quota", "set", "ws-a", "--no-cap", "--max-running", "2", "--actor", "x", ok=False).exit_code == 2
    assert motir("quota", "admission", "--actor", "x", ok=False).exit_code == 2


def test_quota_show_of_one_workspace(env: pytest.MonkeyPatch, engine: Engine) -> None:
    motir("quota", "set", "ws-a", "--weight", "3", "--actor", "x")
    motir("quota", "set", "--system", "--weight", "2", "--actor", "x")
    one = json.loads(motir("quota", "show", "--system", "--json").output)
    assert [w["workspace_id"] for w in one["workspaces"]] == [None]
    one = json.loads(motir("quota", "show", "--workspace", "ws-a", "--json").output)
    assert [w["weight"] for w in one["workspaces"]] == [3]
    assert motir("quota", "set", "ws-a", "--system", "--weight", "2", "--actor", "x", ok=False).exit_code == 2
