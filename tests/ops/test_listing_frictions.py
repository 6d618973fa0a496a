"""Issue 26, item 4: what `motir jobs`, `motir runs show` and the dashboard's run page list.

* `motir jobs` lists a direct job with the trigger "direct" and its Celery task name (it said
  "event " with nothing after it, and named no task);
* a resumed run's attempts are numbered in order, the attempt budget's own number beside it
  when a resume restarted it at 1 — in `motir runs show` and on the dashboard's run page (both
  listed every attempt of a resumed run as "1").

The CLI and the dashboard are called in this process (click's runner, Starlette's test client);
the runs are the engine's own, executed by ``Engine.execute`` (tests/fixtures/ops_helpers.py).
"""

from __future__ import annotations

import html
import re
import uuid
from typing import Any

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import text
from starlette.testclient import TestClient

import tests.fixtures.direct_jobs  # noqa: F401  (registers test.direct.* in this process, as MOTIR_IMPORTS would)
from motir_celery.core import jobs as job_registry
from motir_celery.core.jobs import Job
from motir_celery.ops.cli import main
from motir_celery.ops.dashboard import DashboardConfig, create_app
from motir_celery.settings import reset_settings
from tests.fixtures.engines import holding
from tests.fixtures.ops_helpers import dead_letter, emit, fix_switch, settle

OPS = {"X-Motir-User": "ops", "X-Motir-Admin": "true"}
PROXY = ("127.0.0.1", 50000)  # a loopback peer: header mode believes identity headers from it
#: One row of `motir runs show`'s attempts table: its label ("2" or "2 (1 after a resume)"), worker, outcome.
CLI_ATTEMPT = re.compile(r"^(\d+(?: \(\d+ after a resume\))?)\s+(\S+)\s+(\S+)")
#: One row of the run page's attempts table: its first cell, the worker, the outcome.
PAGE_ATTEMPT = re.compile(r'<tr><td>(.*?)</td><td class="mono">.*?</td><td><span class="state state-(\w+)">', re.S)


def motir(*args: str) -> Result:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, f"motir {' '.join(args)} exited {result.exit_code}:\n{result.output}"
    return result


@pytest.fixture
def env(database_url: str, engine: Any):  # type: ignore[no-untyped-def]
    """The CLI reads its settings from the environment (the session's database), like every motir process."""
    reset_settings()
    yield
    reset_settings()


def cli_attempts(run_id: uuid.UUID) -> list[tuple[str, str]]:
    """(label, outcome) of each row of `motir runs show`'s attempts table, top to bottom."""
    out = motir("runs", "show", str(run_id)).stdout
    table = re.split(r"^attempts \(\d+\)$", out, flags=re.M)[1].strip().splitlines()
    assert table[0].split()[:3] == ["#", "WORKER", "OUTCOME"], out
    rows = []
    for line in table[1:]:
        if not line.strip():
            break  # the table ends (the result follows)
        found = CLI_ATTEMPT.match(line)
        assert found, f"not an attempt row: {line!r}\n{out}"
        rows.append((found.group(1), found.group(3)))
    return rows


def page_attempts(run_id: uuid.UUID) -> list[tuple[str, str]]:
    """(label, outcome) of each row of the run page's attempts table, top to bottom."""
    client = TestClient(create_app(DashboardConfig(secret="test-secret")), follow_redirects=False, client=PROXY)
    page = client.get(f"/runs/{run_id}", headers=OPS)
    assert page.status_code == 200, page.text
    table = page.text.split('data-testid="attempts"', 1)[1].split("</table>", 1)[0]
    rows = []
    for cell, outcome in PAGE_ATTEMPT.findall(table):
        label = html.unescape(re.sub(r"<[^>]+>", "", cell))  # "2 <span class="muted">(1 after a resume)</span>"
        rows.append((" ".join(label.split()), outcome))
    return rows


def ledger(engine: Any, run_id: uuid.UUID) -> list[tuple[int, str]]:
    """The run's attempts as the ledger recorded them, oldest first: (budget number, outcome)."""
    with engine.connect() as conn:
        return [(r.attempt, r.outcome) for r in conn.execute(
            text("SELECT attempt, outcome FROM job_run WHERE run_id = :r ORDER BY started_at, id"), {"r": run_id})]


def resumed_once(engine: Any) -> uuid.UUID:
    """test.mixed-fail (one attempt, no retry): failed into the DLQ, resumed, then succeeded."""
    switch = uuid.uuid4().hex
    run_id, dlq_id = dead_letter(engine, "ws-a", switch)
    assert holding().resume_dlq(dlq_id, actor="carol").status == "resumed"
    fix_switch(engine, switch)
    assert settle(run_id, "test.mixed-fail").state == "succeeded"
    # The budget restarted at 1: the ledger's own numbers repeat, which is what was listed before.
    assert ledger(engine, run_id) == [(1, "failed"), (1, "succeeded")]
    return run_id


def resumed_after_retries(engine: Any) -> uuid.UUID:
    """test.doomed (two attempts, always fails): into the DLQ after attempts 1 and 2, resumed, 1 and 2 again."""
    (run_id,) = emit("test.doomed", {"workspace_id": "ws-a"}).values()
    assert settle(run_id, "test.doomed").state == "failed"
    with engine.connect() as conn:
        dlq_id = conn.execute(text("SELECT id FROM job_run_dlq WHERE run_id = :r"), {"r": run_id}).scalar_one()
    assert holding().resume_dlq(dlq_id, actor="carol").status == "resumed"
    assert settle(run_id, "test.doomed").state == "failed"
    assert ledger(engine, run_id) == [(1, "retrying"), (2, "failed"), (1, "retrying"), (2, "failed")]
    return run_id


# --- motir jobs ---------------------------------------------------------------------------


def test_jobs_lists_a_direct_job_as_direct_with_its_celery_task_name(env, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # A direct job given name= (the name its @app.task had): this test only.
    named = Job(id="test.friction.named", handler=lambda step, x: x, name="shop.tasks.add")
    monkeypatch.setitem(job_registry._registry, named.id, named)
    out = motir("jobs").stdout
    header, *lines = out.splitlines()
    assert header.split()[:3] == ["JOB", "TASK", "TRIGGER"], out

    def line_of(job_id: str) -> list[str]:
        return next(x for x in lines if x.split()[0] == job_id).split()

    # A direct job (neither event= nor cron=): its task is Celery's module.function, its trigger "direct".
    add = line_of("test.direct.add")
    assert add[1] == "tests.fixtures.direct_jobs.add", add
    assert add[2] == "direct" and "event" not in add, add
    assert line_of("test.friction.named")[1:3] == ["shop.tasks.add", "direct"]
    # An event job keeps its alias as its task name, and its trigger names its event.
    assert line_of("test.three-steps")[1:4] == ["motir.test.three-steps", "event", "test.three"]


# --- a resumed run's attempts -------------------------------------------------------------


def test_runs_show_numbers_a_resumed_runs_attempts_in_order(env, engine) -> None:  # type: ignore[no-untyped-def]
    run_id = resumed_once(engine)
    assert cli_attempts(run_id) == [("1", "failed"), ("2 (1 after a resume)", "succeeded")]
    # --traceback names the failed attempt by its place too.
    out = motir("runs", "show", str(run_id), "--traceback").stdout
    assert "--- attempt 1 traceback ---" in out and "the dependency is broken" in out


def test_the_run_page_numbers_a_resumed_runs_attempts_in_order(env, engine) -> None:  # type: ignore[no-untyped-def]
    run_id = resumed_once(engine)
    assert page_attempts(run_id) == [("1", "failed"), ("2 (1 after a resume)", "succeeded")]


def test_runs_show_and_the_run_page_list_a_resumed_runs_retries_in_the_order_they_ran(env, engine) -> None:  # type: ignore[no-untyped-def]
    run_id = resumed_after_retries(engine)
    in_order = [("1", "retrying"), ("2", "failed"), ("3 (1 after a resume)", "retrying"),
                ("4 (2 after a resume)", "failed")]
    assert cli_attempts(run_id) == in_order
    assert page_attempts(run_id) == in_order
