"""The dashboard in a real browser: Debian's Chromium, driven by Playwright.

A real `celery worker` runs the jobs, the dashboard is served by uvicorn on a
free port, and the browser presents identity headers as a proxy would. Never
skipped: without /usr/bin/chromium the tests fail and say how to install it
(`.ci/run` does). Playwright's own browser downloads are never used.

Screenshots of the pages go to the test's tmp dir; with
``MOTIR_UPDATE_SCREENSHOTS=1`` they also replace docs/screenshots/*.png.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from playwright.sync_api import Browser, expect
from sqlalchemy import text

from motir_celery import send_event
from motir_celery.adapter.celery_app import create_app as create_celery_app
from tests.conftest import celery_worker, run_state, wait_for
from tests.fixtures.browser import ALICE, BOB, new_context, shoot
from tests.fixtures.ops_helpers import dead_letter, fix_switch, run_event


def _finished(engine: Any, run_ids: list[Any]) -> bool:
    return all(run_state(engine, r) in ("succeeded", "failed") for r in run_ids)


def test_an_operator_opens_a_failed_run_presses_replay_and_watches_the_new_run_succeed(
        browser: Browser, dashboard: str, engine: Any, broker_url: str, tmp_path: Path) -> None:
    celery = create_celery_app()
    switch = uuid.uuid4().hex
    with celery_worker(tmp_path, broker=broker_url):
        runs: list[Any] = []
        for data in ({"order": 1}, {"order": 2}):
            runs += send_event("test.three", {"workspace_id": "ws-a", **data}, app=celery).run_ids
        runs += send_event("test.flaky", {"workspace_id": "ws-a"}, app=celery).run_ids
        mixed = send_event("test.mixed", {"workspace_id": "ws-a", "switch": switch}, app=celery)
        runs += mixed.run_ids
        wait_for(lambda: _finished(engine, runs), timeout=40, what="the seeded runs to finish")
        failed = next(r.run_id for r in mixed.runs if r.job_id == "test.mixed-fail")  # type: ignore[union-attr]
        assert run_state(engine, failed) == "failed"

        context = new_context(browser, ALICE)
        page = context.new_page()

        # 1. The runs page lists the failed run, flagged as dead-lettered.
        page.goto(f"{dashboard}/runs")
        expect(page.get_by_test_id("identity")).to_have_text("alice · ws-a")
        failed_row = page.locator(f'tr[data-run="{failed}"]')
        expect(failed_row).to_contain_text("failed")
        expect(failed_row).to_contain_text("in DLQ")
        expect(page.locator("tr[data-run]")).to_have_count(len(runs))
        shoot(page, tmp_path, "runs")

        # 2. The DLQ page shows the entry with its error and a Replay button.
        page.goto(f"{dashboard}/dlq")
        expect(page.get_by_test_id("dlq")).to_contain_text("the dependency is broken")
        shoot(page, tmp_path, "dlq")

        # 3. Open the failed run: timeline, attempts with the error, the dead-letter card.
        page.goto(f"{dashboard}/runs")
        failed_row.locator("a").first.click()
        expect(page).to_have_url(f"{dashboard}/runs/{failed}")
        expect(page.get_by_test_id("attempts")).to_contain_text("RuntimeError")
        expect(page.get_by_test_id("attempts")).to_contain_text("the dependency is broken")
        expect(page.get_by_test_id("dlq-entry")).to_contain_text("exhausted its attempts")
        expect(page.get_by_test_id("timeline")).to_be_visible()
        shoot(page, tmp_path, "run")

        # 4. The dependency is fixed; press Replay. The new run appears and runs to success.
        fix_switch(engine, switch)
        page.get_by_test_id("dlq-entry").get_by_test_id("replay").click()
        expect(page.get_by_role("status")).to_contain_text("replayed: this is the new run")
        new_run = page.url.split("?")[0].rsplit("/", 1)[1]
        assert new_run != str(failed)
        expect(page.locator("h1 .state")).to_have_text("succeeded", timeout=30_000)  # the page refreshes itself
        expect(page.locator("dl.facts")).to_contain_text("Replay of")
        expect(page.get_by_test_id("steps")).to_contain_text("try")
        shoot(page, tmp_path, "run-replayed")

        page.goto(f"{dashboard}/runs")
        expect(page.locator(f'tr[data-run="{new_run}"]')).to_contain_text("succeeded")
        page.goto(f"{dashboard}/runs/{failed}")
        expect(page.get_by_test_id("dlq-entry")).to_contain_text("Replayed by alice")
        expect(page.get_by_test_id("replay")).to_have_count(0)
        page.goto(f"{dashboard}/health")
        expect(page.get_by_test_id("depth")).to_contain_text("test.mixed-fail")
        shoot(page, tmp_path, "health")
        context.close()

    with engine.connect() as conn:
        audit = conn.execute(text("SELECT replayed_by, replay_run_id FROM job_run_dlq WHERE run_id = :r"),
                             {"r": failed}).one()
    assert audit.replayed_by == "alice" and str(audit.replay_run_id) == new_run


def test_workspace_b_user_never_sees_workspace_a_runs_in_the_browser(
        browser: Browser, dashboard: str, engine: Any) -> None:
    (a_run,) = run_event("test.three", {"workspace_id": "ws-a"}).values()
    a_failed, a_dlq = dead_letter(engine, "ws-a")
    (b_run,) = run_event("test.three", {"workspace_id": "ws-b"}).values()

    alice = new_context(browser, ALICE).new_page()
    alice.goto(f"{dashboard}/runs")
    expect(alice.locator(f'tr[data-run="{a_run}"]')).to_be_visible()  # the data is there…

    bob_context = new_context(browser, BOB)
    bob = bob_context.new_page()
    bob.goto(f"{dashboard}/runs")
    expect(bob.locator(f'tr[data-run="{b_run}"]')).to_be_visible()
    expect(bob.locator("tr[data-run]")).to_have_count(1)  # …and bob sees only his own
    body = bob.content()
    assert str(a_run) not in body and str(a_failed) not in body and "test.mixed" not in body

    for url in (f"/runs/{a_run}", f"/runs/{a_failed}"):
        response = bob.goto(f"{dashboard}{url}")
        assert response is not None and response.status == 404
        expect(bob.locator("p.problem")).to_contain_text("in your workspace")
        assert "test.three-steps" not in bob.content() and "ws-a" not in bob.content()

    bob.goto(f"{dashboard}/dlq")
    assert str(a_dlq) not in bob.content()
    expect(bob.locator("p.empty")).to_contain_text("Nothing in the dead-letter queue")
    bob.goto(f"{dashboard}/runs?workspace=ws-a")  # the filter cannot widen a user's view
    assert str(a_run) not in bob.content()
    bob_context.close()
