"""``step.audit``: what ran a job (seed 003's providerKey / modelVersion, issue 47 S3-9), set by its
body and written by the run's success settle — the same statement, no other — then shown where a
run's detail is read (``get_run``, ``motir runs show``, the run's dashboard page).

In process against real Postgres with the test kit: the real claim, settle and reads.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import text
from sqlalchemy.engine import Engine
from starlette.testclient import TestClient

from motir_celery import RetryPolicy, define_job
from motir_celery.core.jobs import CallStep
from motir_celery.core.shapes import AUDIT_MAX
from motir_celery.core.worker.steps import Step
from motir_celery.errors import AuditValueError
from motir_celery.ops import reads
from motir_celery.ops.cli import main
from motir_celery.ops.dashboard import DashboardConfig, create_app
from motir_celery.testing import Motir

WS = "ws-audit"
PROXY = ("127.0.0.1", 50000)   # a loopback peer: the dashboard believes identity headers from it
AGAIN = RetryPolicy(max_attempts=2, backoff=0.0, factor=1.0, jitter=0.0)

#: What the jobs below saw at the call (a test reads it).
seen: dict[str, Any] = {}


@define_job("audit.summarise", retry_policy=AGAIN)
def summarise(step: Any, provider: str | None, model: str | None, fail_first: bool) -> str:
    step.audit(provider_key="draft-provider")          # replaced below: the last value given counts
    step.audit(provider_key=provider, model_version=model)
    out: str = step.run("call", lambda: f"summary by {provider}/{model}")
    if fail_first and step.attempt == 1:
        raise RuntimeError("the provider timed out after answering")
    return out


@define_job("audit.unset", retry_policy="none")
def unset(step: Any) -> int:
    return step.run("work", lambda: 1)  # type: ignore[no-any-return]


@define_job("audit.too-long", retry_policy="none")
def too_long(step: Any) -> str:
    step.run("kept", lambda: "stored before the bad call")
    try:
        step.audit(provider_key="openai", model_version="m" * (AUDIT_MAX + 1))
    except AuditValueError as exc:
        seen["error"] = str(exc)
    return "done"


@define_job("audit.fails", retry_policy="none")
def fails(step: Any) -> None:
    step.audit(provider_key="anthropic", model_version="claude-x")
    raise RuntimeError("the job failed after naming its provider")


def _audit_of(engine: Engine, run_id: Any) -> tuple[Any, Any]:
    with engine.connect() as conn:
        row = conn.execute(text("SELECT provider_key, model_version FROM job_queue WHERE id = :r"),
                           {"r": run_id}).one()
    return row.provider_key, row.model_version


def _detail(kit: Motir, run_id: Any) -> reads.RunDetail:
    with kit.engine.session(None, admin=True) as session:
        detail = reads.get_run(session, run_id)
    assert detail is not None
    return detail


def test_set_values_are_stored_by_the_success_settle_and_shown_with_the_run(kit: Motir) -> None:
    handle = kit.apply_async(summarise, ("openai", "gpt-4o-2024-08-06", False), workspace_id=WS)
    kit.drain()
    assert handle.get() == "summary by openai/gpt-4o-2024-08-06"
    assert _audit_of(kit.sql, handle.id) == ("openai", "gpt-4o-2024-08-06")
    detail = _detail(kit, handle.id)
    assert (detail.provider_key, detail.model_version) == ("openai", "gpt-4o-2024-08-06")
    shown = CliRunner().invoke(main, ["runs", "show", str(handle.id)], catch_exceptions=False)
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert any(line.split() == ["provider", "openai"] for line in lines), shown.output
    assert any(line.split() == ["model", "gpt-4o-2024-08-06"] for line in lines), shown.output
    dashboard = TestClient(create_app(DashboardConfig(secret="test-secret"), engine=kit.engine), client=PROXY)
    page = dashboard.get(f"/runs/{handle.id}", headers={"X-Motir-User": "alice", "X-Motir-Workspace": WS}).text
    assert '<dd class="mono" data-testid="provider">openai</dd>' in page
    assert '<dd class="mono" data-testid="model">gpt-4o-2024-08-06</dd>' in page


def test_nothing_is_written_until_the_run_succeeds_and_the_succeeding_attempt_writes_its_own(kit: Motir) -> None:
    """A value held by an attempt that failed is not written; the retry sets it again and its settle writes it."""
    handle = kit.apply_async(summarise, ("mistral", "large-2", True), workspace_id=WS)
    kit.drain()
    assert handle.get() == "summary by mistral/large-2" and kit.attempts(handle) == 2
    assert _audit_of(kit.sql, handle.id) == ("mistral", "large-2")


def test_a_run_that_sets_none_stores_null_and_shows_none(kit: Motir) -> None:
    handle = kit.apply_async(unset, (), workspace_id=WS)
    kit.drain()
    assert handle.get() == 1
    assert _audit_of(kit.sql, handle.id) == (None, None)
    detail = _detail(kit, handle.id)
    assert (detail.provider_key, detail.model_version) == (None, None)
    shown = CliRunner().invoke(main, ["runs", "show", str(handle.id)], catch_exceptions=False)
    assert shown.exit_code == 0 and "provider" not in shown.output and "model " not in shown.output
    dashboard = TestClient(create_app(DashboardConfig(secret="test-secret"), engine=kit.engine), client=PROXY)
    page = dashboard.get(f"/runs/{handle.id}", headers={"X-Motir-User": "alice", "X-Motir-Workspace": WS}).text
    assert str(handle.id) in page   # the run's page, without the two facts
    assert 'data-testid="provider"' not in page and 'data-testid="model"' not in page


def test_a_value_too_long_is_refused_at_the_call_and_nothing_of_the_run_is_lost(kit: Motir) -> None:
    handle = kit.apply_async(too_long, (), workspace_id=WS)
    kit.drain()
    assert "model_version is 201 characters; it is 1 to 200" in seen.pop("error")
    assert handle.get() == "done"
    # the refused call kept nothing, not even its valid half; the stored step and the result stay
    assert _audit_of(kit.sql, handle.id) == (None, None)
    assert [s.step_id for s in _detail(kit, handle.id).steps] == ["kept"]


def test_a_run_that_fails_keeps_nothing_it_set(kit: Motir) -> None:
    """Documented (docs/jobs.md): the audit is of what completed the job; a failure's story is the ledger's."""
    handle = kit.apply_async(fails, (), workspace_id=WS)
    kit.drain()
    assert kit.state(handle) == "failed"
    assert _audit_of(kit.sql, handle.id) == (None, None)


@pytest.mark.parametrize("value", ["", "x" * (AUDIT_MAX + 1), "nul\x00", "line\nbreak", 42])
def test_each_bad_value_is_an_audit_value_error_naming_its_column(value: Any) -> None:
    step = Step.__new__(Step)   # the check needs no claim: it is all before anything is kept
    step.audited = {}
    with pytest.raises(AuditValueError, match="provider_key"):
        step.audit(provider_key=value)
    assert step.audited == {}
    with pytest.raises(AuditValueError, match="model_version"):
        CallStep().audit(model_version=value)   # a direct call checks the same, then keeps nothing


def test_a_direct_call_runs_the_body_and_keeps_nothing() -> None:
    assert summarise("openai", "gpt-4o", False) == "summary by openai/gpt-4o"


def test_the_column_itself_refuses_more_than_the_bound(kit: Motir) -> None:
    """Postgres's own bound, for a writer that is not step.audit."""
    handle = kit.apply_async(unset, (), workspace_id=WS)
    with pytest.raises(Exception, match="too long"), kit.sql.begin() as conn:
        conn.execute(text("UPDATE job_queue SET provider_key = :v WHERE id = :r"),
                     {"v": "p" * (AUDIT_MAX + 1), "r": uuid.UUID(str(handle.id))})
