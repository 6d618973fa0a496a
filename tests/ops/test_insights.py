"""Insights: the stats rollup folded off the hot path and exact across purge, its indexes, /metrics, ``motir stats``,
the dashboard's Insights page (under row-level security, and in a real browser), and the run page's "why it waits".

Runs execute in this process through the real runner (tests/fixtures/ops_helpers.py), except the race of
purge against runs finishing, which has a real worker settling them.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Connection, text
from sqlalchemy.engine import Engine
from starlette.testclient import TestClient

import tests.fixtures.flow_jobs  # noqa: F401  (the jobs these tests run)
from motir_celery import send_event
from motir_celery.adapter.celery_app import create_app as create_celery_app
from motir_celery.core.worker import rollup
from motir_celery.ops.cli import main
from motir_celery.ops.dashboard import DashboardConfig, create_app
from motir_celery.ops.insights import percentile
from motir_celery.ops.metrics import build_registry
from motir_celery.ops.purge import purge
from motir_celery.settings import reset_settings
from motir_celery.store.driver import plan
from motir_celery.store.records import DURATION_BOUNDS_MS
from motir_celery.store.sql import maintenance
from motir_celery.store.sql import reads as reads_sql
from tests.conftest import celery_worker, wait_for
from tests.fixtures.browser import CHROMIUM, CHROMIUM_ARGS
from tests.fixtures.engines import holding
from tests.fixtures.ops_helpers import emit, run_event

ALICE = {"X-Motir-User": "alice", "X-Motir-Workspace": "ws-a"}
BOB = {"X-Motir-User": "bob", "X-Motir-Workspace": "ws-b"}
OPS = {"X-Motir-User": "ops", "X-Motir-Admin": "true"}
ROOT = Path(__file__).resolve().parents[2]


def _one(engine: Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(text(sql), params).one()


def _totals(engine: Engine, job: str) -> Any:
    return _one(engine, "SELECT coalesce(sum(succeeded_count), 0) AS succeeded, coalesce(sum(failed_count), 0) AS failed,"
                        " coalesce(sum(retried_count), 0) AS retried, coalesce(sum(attempts_count), 0) AS attempts,"
                        " coalesce(sum(duration_samples), 0) AS samples FROM job_stats_rollup"
                        " WHERE job_id = :j AND bucket IS NULL", j=job)


def _buckets(engine: Engine, job: str) -> Any:
    return _one(engine, "SELECT coalesce(sum(succeeded_count), 0), coalesce(sum(failed_count), 0) FROM job_stats_rollup"
                        " WHERE job_id = :j AND bucket IS NOT NULL", j=job)


# --- the rollup -------------------------------------------------------------------------------


def test_a_settle_writes_nothing_to_the_rollup_and_the_sweep_folds_each_run_once(engine: Engine) -> None:
    for n in range(3):
        run_event("flow.plain", {"n": n})
    run_event("flow.fail", {"n": 9})
    assert _one(engine, "SELECT count(*) FROM job_stats_rollup")[0] == 0  # no settle touched it
    assert holding().sweep().folded == 4
    assert tuple(_totals(engine, "flow.plain"))[:2] == (3, 0) and tuple(_totals(engine, "flow.fails"))[:2] == (0, 1)
    assert tuple(_buckets(engine, "flow.plain")) == (3, 0)  # and in this 5-minute bucket
    assert holding().sweep().folded == 0  # folded once: the next sweeps find nothing
    assert tuple(_totals(engine, "flow.plain"))[:2] == (3, 0)
    assert _one(engine, "SELECT count(*) FROM job_queue WHERE folded_at IS DISTINCT FROM finished_at")[0] == 0


def test_the_rollup_counts_retries_attempts_and_a_duration_histogram(engine: Engine) -> None:
    for n in range(4):
        run_event("flow.flaky", {"n": n})  # attempt 1 fails, attempt 2 succeeds
    holding().sweep()
    totals = _totals(engine, "flow.flaky")
    assert (totals.succeeded, totals.failed, totals.retried, totals.attempts, totals.samples) == (4, 0, 4, 8, 4)
    (hist, sum_ms) = _one(engine, "SELECT duration_buckets, sum_duration_ms FROM job_stats_rollup "
                                  "WHERE job_id = 'flow.flaky' AND bucket IS NULL")
    assert len(hist) == len(DURATION_BOUNDS_MS) + 1 and sum(hist) == 4
    # first attempt's start to finish: the 0.2 s backoff is in every one of them
    assert sum_ms >= 4 * 200 and percentile(hist, 0.5) is not None and percentile(hist, 0.5) >= 100


def test_percentiles_interpolate_within_a_histogram_bucket() -> None:
    hist = [0] * (len(DURATION_BOUNDS_MS) + 1)
    i100 = DURATION_BOUNDS_MS.index(100)  # the bucket [50 ms, 100 ms)
    hist[i100], hist[i100 + 1] = 50, 50    # 50 runs of 50-100 ms, 50 of 100-250 ms
    assert percentile(hist, 0.5) == 100.0
    assert percentile(hist, 0.95) == pytest.approx(100 + 150 * 0.9)
    assert percentile(hist, 0.01) == pytest.approx(50 + 50 * 0.02)
    assert percentile([0] * 21, 0.5) is None
    hist = [0] * (len(DURATION_BOUNDS_MS) + 1)
    hist[-1] = 3                           # longer than the last bound: at least that
    assert percentile(hist, 0.95) == DURATION_BOUNDS_MS[-1]


def test_purge_while_runs_finish_leaves_nothing_uncounted_and_nothing_counted_twice(
        engine: Engine, broker_url: str, tmp_path: Path) -> None:
    """A real worker settles runs while one thread purges them a millisecond after they finish and
    another folds: every run is counted exactly once, by whichever got to it first."""
    celery = create_celery_app()
    ok, bad = 160, 40
    stop = threading.Event()
    purged = {"runs": 0, "folded": 0}
    folded = {"runs": 0}
    errors: list[BaseException] = []

    def purging() -> None:
        try:
            while not stop.is_set():
                report = purge(timedelta(milliseconds=1), batch_size=25)
                purged["runs"] += report.runs
                purged["folded"] += report.folded
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def folding() -> None:
        try:
            while not stop.is_set():
                folded["runs"] += rollup.fold(holding().pool(), batches=1, batch=20)
                time.sleep(0.05)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    env = {"MOTIR_IMPORTS": "tests.fixtures.jobs,tests.fixtures.flow_jobs"}
    with celery_worker(tmp_path, broker=broker_url, concurrency=3, env=env, sweep_interval=0.5):
        threads = [threading.Thread(target=purging), threading.Thread(target=folding)]
        for t in threads:
            t.start()
        try:
            for n in range(ok + bad):
                send_event("flow.plain" if n % 5 else "flow.fail", {"n": n}, app=celery)
            wait_for(lambda: _one(engine, "SELECT count(*) FROM job_queue WHERE state IN ('queued', 'running')")[0] == 0
                     and _one(engine, "SELECT count(*) FROM job_run_dlq")[0] == bad,
                     timeout=90, what="every run to finish")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
    assert not errors, errors
    rollup.fold(holding().pool())  # what is left: the failed runs (their open DLQ entries keep them) and the last ones
    assert tuple(_totals(engine, "flow.plain"))[:2] == (ok, 0)
    assert tuple(_totals(engine, "flow.fails"))[:2] == (0, bad)
    assert tuple(_buckets(engine, "flow.plain")) == (ok, 0) and tuple(_buckets(engine, "flow.fails")) == (0, bad)
    # Both ways of counting took part: purge folded runs the sweep had not reached, the folds the rest.
    assert purged["folded"] > 0 and purged["runs"] > purged["folded"] > 0, purged
    assert _one(engine, "SELECT count(*) FROM job_queue WHERE folded_at IS DISTINCT FROM finished_at")[0] == 0


# --- the partial indexes, by the queries that use them ----------------------------------------

ROWS = 60_000


def _fill(conn: Connection) -> None:
    """A large history: 200 jobs, 97 % succeeded at the first attempt, 2 % retried, over ten days."""
    conn.execute(text(
        """
        INSERT INTO job_queue (job_id, event_name, workspace_id, state, attempts, max_attempts, retry_policy,
                               created_at, finished_at, run_at)
        SELECT 'job.' || (i % 200), 'e', 'ws-a', s.state, CASE WHEN i % 50 = 0 THEN 2 ELSE 1 END, 3, 'transient',
               now() - make_interval(secs => i * 15), now() - make_interval(secs => i * 15 - 1), now()
        FROM generate_series(1, :n) AS i,
             LATERAL (SELECT CASE WHEN i % 33 = 0 THEN 'failed' ELSE 'succeeded' END AS state) AS s
        """), {"n": ROWS})
    conn.execute(text("ANALYZE job_queue"))


def _scans(conn: Connection, statement: Any, params: dict[str, Any]) -> dict[str, str]:
    def nodes(p: Any) -> Iterator[dict[str, Any]]:
        if isinstance(p, dict):
            if "Node Type" in p:
                yield p
            for v in p.values():
                yield from nodes(v)
        elif isinstance(p, list):
            for v in p:
                yield from nodes(v)

    (found,) = plan(conn, statement, params)
    return {str(n["Index Name"]): str(n["Node Type"]) for n in nodes(found) if "Index Name" in n}


def test_the_flaky_and_succeeded_duration_queries_use_their_partial_indexes(engine: Engine) -> None:
    with engine.connect() as conn, conn.begin() as tx:
        _fill(conn)
        since = conn.execute(text("SELECT now() - interval '1 day'")).scalar_one()
        queries = {
            "flaky runs": (reads_sql.FLAKY_RUNS, {"since": since, "job": None, "limit": 20}, "ix_job_queue_flaky"),
            "slowest runs": (reads_sql.SLOWEST_RUNS, {"job": "job.7", "since": since, "limit": 10},
                             "ix_job_queue_succeeded"),
            "the fold": (maintenance.FOLD_FINISHED, {"batch": 2000, "margin": 60.0}, "ix_job_queue_finished"),
        }
        for name, (statement, params, index) in queries.items():
            scans = _scans(conn, statement, params)
            assert scans.get(index) in ("Index Scan", "Index Only Scan", "Bitmap Index Scan"), (name, scans)
        # The same under the app role, with the workspace policy's predicate added (the dashboard's reads).
        conn.execute(text("SET LOCAL ROLE motir_app; SELECT set_config('motir.workspace_id', 'ws-a', true)"))
        for name in ("flaky runs", "slowest runs"):
            statement, params, index = queries[name]
            assert index in _scans(conn, statement, params), name
        conn.execute(text("RESET ROLE"))
        # Control: without its index each query reads another way: the plans above are the index's doing.
        for name in ("flaky runs", "slowest runs"):
            statement, params, index = queries[name]
            conn.execute(text(f"DROP INDEX {index}"))
            assert index not in _scans(conn, statement, params), name
        tx.rollback()


# --- /metrics and motir stats ---------------------------------------------------------------


def _samples(registry: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def test_metrics_counters_and_the_duration_histogram_come_from_the_rollup_and_survive_purge(
        engine: Engine, database_url: str) -> None:
    for n in range(3):
        run_event("flow.plain", {"n": n, "workspace_id": "ws-a"})
    run_event("flow.fail", {"n": 0, "workspace_id": "ws-b"})
    holding().sweep()
    registry = build_registry(settings=holding().settings)
    before = _samples(registry)
    assert before[("motir_runs_total", (("job", "flow.plain"), ("outcome", "succeeded")))] == 3
    assert before[("motir_runs_total", (("job", "flow.fails"), ("outcome", "failed")))] == 1
    assert before[("motir_run_duration_seconds_count", (("job", "flow.plain"),))] == 3
    assert before[("motir_run_duration_seconds_bucket", (("job", "flow.plain"), ("le", "+Inf")))] == 3
    assert not any("workspace" in dict(labels) for _, labels in before)  # tenant ids stay out unless asked
    with engine.begin() as conn:  # a week later, purged
        conn.execute(text("UPDATE job_queue SET finished_at = finished_at - interval '7 days', "
                          "folded_at = folded_at - interval '7 days'"))
        conn.execute(text("UPDATE job_run_dlq SET dismissed_at = now() - interval '7 days'"))
    report = purge(timedelta(days=1))
    assert report.runs == 4 and report.folded == 0  # all counted by the sweep already
    assert _one(engine, "SELECT count(*) FROM job_queue")[0] == 0
    after = _samples(build_registry(settings=holding().settings))
    assert {k: v for k, v in after.items() if k[0].startswith(("motir_runs_total", "motir_run_duration_seconds"))} == \
           {k: v for k, v in before.items() if k[0].startswith(("motir_runs_total", "motir_run_duration_seconds"))}
    by_workspace = _samples(build_registry(settings=holding().settings, by_workspace=True))
    assert by_workspace[("motir_runs_total", (("job", "flow.plain"), ("outcome", "succeeded"),
                                              ("workspace", "ws-a")))] == 3


def test_motir_stats_prints_each_jobs_numbers_and_json(engine: Engine, database_url: str, broker_url: str) -> None:
    from click.testing import CliRunner

    reset_settings()
    for n in range(2):
        run_event("flow.plain", {"n": n})
    run_event("flow.fail", {"n": 0})
    holding().sweep()
    out = CliRunner().invoke(main, ["stats", "--json"], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    found = {j["job"]: j for j in json.loads(out.stdout)["jobs"]}
    assert (found["flow.plain"]["runs"], found["flow.plain"]["failure_rate"]) == (2, 0.0)
    assert (found["flow.fails"]["failed"], found["flow.fails"]["dlq_open"], found["flow.fails"]["failure_rate"]) == (1, 1, 1.0)
    assert found["flow.plain"]["p50_ms"] is not None and found["flow.plain"]["p95_ms"] >= found["flow.plain"]["p50_ms"]
    table = CliRunner().invoke(main, ["stats", "flow.fails", "--since", "2h"], catch_exceptions=False)
    assert table.exit_code == 0 and "flow.fails" in table.stdout and "100.0%" in table.stdout
    assert "flow.plain" not in table.stdout
    bad = CliRunner().invoke(main, ["stats", "--since", "soon"])
    assert bad.exit_code == 2 and "--since" in bad.output


# --- the dashboard ----------------------------------------------------------------------------


@pytest.fixture
def client(database_url: str) -> TestClient:
    return TestClient(create_app(DashboardConfig(secret="test-secret"), engine=holding()),
                      follow_redirects=False, client=("127.0.0.1", 50000))


def test_the_insights_page_shows_each_workspace_its_own_jobs_and_an_admin_all(engine: Engine, client: TestClient) -> None:
    for n in range(3):
        run_event("flow.plain", {"n": n, "workspace_id": "ws-a"})
    run_event("flow.fail", {"n": 1, "workspace_id": "ws-a"})
    run_event("flow.flaky", {"n": 2, "workspace_id": "ws-b"})
    holding().sweep()
    alice = client.get("/insights?window=1h", headers=ALICE)
    assert alice.status_code == 200, alice.text
    assert 'data-job="flow.plain"' in alice.text and 'data-job="flow.fails"' in alice.text
    assert "flow.flaky" not in alice.text  # ws-b's job: row-level security, not this page, hides it
    assert 'data-testid="runs">4<' in alice.text and "<svg" in alice.text and "<script" not in alice.text
    bob = client.get("/insights", headers=BOB)
    assert 'data-job="flow.flaky"' in bob.text and "flow.plain" not in bob.text
    assert 'data-testid="flakiest"' in bob.text  # its one job needed a retry
    ops = client.get("/insights?window=7d", headers=OPS)
    assert all(f'data-job="{j}"' in ops.text for j in ("flow.plain", "flow.fails", "flow.flaky"))
    job = client.get("/insights?window=1d&job=flow.plain", headers=ALICE)
    assert job.status_code == 200 and 'data-testid="slowest"' in job.text and 'data-testid="durations"' in job.text
    assert client.get("/insights?window=2y", headers=ALICE).status_code == 400


@pytest.fixture
def admin_login(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A login of this test's own that is only a member of motir_admin, as MOTIR_ADMIN_DATABASE_URL
    (what the CLI's and the dashboard's operator reads log in as); dropped at the end."""
    from sqlalchemy import create_engine, make_url

    from motir_celery.store.db import dispose_engines

    owner = create_engine(database_url)
    name = f"motir_s{os.getpid()}_{random.randrange(10**8)}_admin"
    with owner.begin() as conn:
        conn.execute(text(f'CREATE ROLE "{name}" LOGIN IN ROLE motir_admin'))
    monkeypatch.setenv("MOTIR_ADMIN_DATABASE_URL",
                       make_url(database_url).set(username=name).render_as_string(hide_password=False))
    reset_settings()
    try:
        yield name
    finally:
        monkeypatch.delenv("MOTIR_ADMIN_DATABASE_URL")
        reset_settings()
        dispose_engines()
        with owner.begin() as conn:
            conn.execute(text(f'DROP ROLE IF EXISTS "{name}"'))
        owner.dispose()


def test_stats_and_insights_for_one_workspace_never_name_another_workspaces_dlq_entries(
        engine: Engine, client: TestClient, admin_login: str) -> None:
    """Under the admin login (every workspace visible), ``--workspace ws-a`` / ``?workspace=ws-a`` count
    ws-a's open DLQ entries only: ws-b's failed job is not on ws-a's list, not even as "0 runs, 1 open"."""
    from click.testing import CliRunner

    run_event("flow.plain", {"n": 0, "workspace_id": "ws-a"})
    run_event("flow.fail", {"n": 1, "workspace_id": "ws-b"})
    holding().sweep()

    def cli(workspace: str) -> dict[str, Any]:
        out = CliRunner().invoke(main, ["stats", "--workspace", workspace, "--json"], catch_exceptions=False)
        assert out.exit_code == 0, out.output
        return {j["job"]: j for j in json.loads(out.stdout)["jobs"]}

    assert set(cli("ws-a")) == {"flow.plain"}
    assert cli("ws-b")["flow.fails"]["dlq_open"] == 1 and "flow.plain" not in cli("ws-b")
    page = client.get("/insights?window=1d&workspace=ws-a", headers=OPS)
    assert page.status_code == 200 and 'data-job="flow.plain"' in page.text, page.text
    assert "flow.fails" not in page.text
    assert 'data-job="flow.fails"' in client.get("/insights?window=1d&workspace=ws-b", headers=OPS).text
    everyone = client.get("/insights?window=1d", headers=OPS).text   # no filter: every workspace's
    assert 'data-job="flow.plain"' in everyone and 'data-job="flow.fails"' in everyone


def test_the_run_page_says_why_a_run_waits_on_flow_control(engine: Engine, client: TestClient) -> None:
    debounced = emit("flow.debounce", {"key": "k", "workspace_id": "ws-a"})["flow.debounced"]
    page = client.get(f"/runs/{debounced}", headers=ALICE).text
    assert 'data-testid="flow"' in page and "debouncing" in page and "<code>k</code>" in page
    throttled = [emit("flow.throttle", {"key": "t", "n": n, "workspace_id": "ws-a"})["flow.throttled"]
                 for n in range(tests.fixtures.flow_jobs.LIMIT + 2)]
    worker = holding()
    outcomes = [worker.execute(r, job_id="flow.throttled", worker="t").state for r in throttled]
    assert outcomes == ["succeeded"] * tests.fixtures.flow_jobs.LIMIT + ["skipped"] * 2
    waiting = client.get(f"/runs/{throttled[-1]}", headers=ALICE).text
    assert "waiting for a throttle slot" in waiting and "1 run of the key ahead" in waiting
    started = client.get(f"/runs/{throttled[0]}", headers=ALICE).text
    assert "under its throttle" in started
    insights = client.get("/insights", headers=ALICE).text
    assert 'data-testid="flow-waiting"' in insights and "throttle" in insights and "debounce" in insights
    assert client.get(f"/runs/{debounced}", headers=BOB).status_code == 404


# --- in a real browser: the screenshot in docs/screenshots ---------------------------------------


def _history(engine: Engine) -> None:
    """A day of runs, as the fold finds them: four jobs, a few failing or retried, durations spread."""
    rng = random.Random(30)
    plan_ = ([("flow.plain", {"n": n}) for n in range(60)] + [("flow.flaky", {"n": n}) for n in range(12)]
             + [("flow.fail", {"n": n}) for n in range(6)] + [("test.three", {"order": n}) for n in range(24)])
    for name, data in plan_:
        run_event(name, {**data, "workspace_id": "ws-a"})
    with engine.begin() as conn:
        for (run_id,) in conn.execute(text("SELECT id FROM job_queue")).all():
            back, took = rng.uniform(0, 23.5 * 3600), rng.lognormvariate(-1.0, 1.2)
            conn.execute(text("UPDATE job_queue SET created_at = created_at - make_interval(secs => :b),"
                              " finished_at = finished_at - make_interval(secs => :b) WHERE id = :r"),
                         {"b": back, "r": run_id})
            conn.execute(text("UPDATE job_run SET started_at = started_at - make_interval(secs => :b + :t),"
                              " finished_at = finished_at - make_interval(secs => :b) WHERE run_id = :r"),
                         {"b": back, "t": took, "r": run_id})
    holding().sweep()


def test_an_on_call_engineer_reads_the_insights_page_in_a_browser(
        engine: Engine, browser: Any, dashboard: str, tmp_path: Path) -> None:  # noqa: F811
    from playwright.sync_api import expect

    _history(engine)
    emit("flow.debounce", {"key": "invoice-7", "workspace_id": "ws-a"})  # something waiting on flow control
    context = browser.new_context(extra_http_headers=ALICE, viewport={"width": 1320, "height": 900})
    page = context.new_page()
    page.goto(f"{dashboard}/insights?window=1d")
    expect(page.get_by_test_id("runs")).to_have_text("102")
    expect(page.locator("tr[data-job]")).to_have_count(4)
    expect(page.get_by_test_id("flakiest")).to_contain_text("flow.flaky")
    expect(page.get_by_test_id("flow-waiting")).to_contain_text("debounce")
    assert page.locator('[data-testid="runs-chart"] rect').count() > 10  # drawn on the server, shown by the browser
    shot = tmp_path / "insights.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    if os.environ.get("MOTIR_UPDATE_SCREENSHOTS") == "1":
        shutil.copyfile(shot, ROOT / "docs" / "screenshots" / "insights.png")
    context.close()
    assert CHROMIUM and CHROMIUM_ARGS  # the Debian Chromium the browser tests use
