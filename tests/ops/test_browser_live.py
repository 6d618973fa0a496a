"""The run page follows a running run in a real browser, without a reload (issue 45).

A real `celery worker` runs ``test.streams.watched`` (tests/fixtures/stream_jobs.py): a progress report
and a stream item every 0.3 s. Debian's Chromium opens the run's page while it runs; the page's
script follows ``/runs/<id>/live`` and the report and the items change in place. A marker set on the
page's ``window`` survives to the end: the page was never loaded again.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from playwright.sync_api import Browser, expect

import tests.fixtures.stream_jobs as sj
from tests.conftest import celery_worker, run_state, wait_for
from tests.fixtures.browser import ALICE, new_context, shoot

IMPORTS = {"MOTIR_IMPORTS": "tests.fixtures.jobs,tests.fixtures.stream_jobs"}
#: True once the page shows a report of at least ``arg`` done and at least ``arg`` stream items.
MOVED = """(least) => {
  const meta = document.querySelector('[data-testid="progress-meta"]');
  const items = document.querySelectorAll('[data-stream="log"] li').length;
  return meta !== null && JSON.parse(meta.textContent).done >= least && items >= least;
}"""


def test_the_run_page_shows_progress_and_stream_items_as_they_come_without_a_reload(
        browser: Browser, dashboard: str, engine: Any, broker_url: str, tmp_path: Path) -> None:
    n = 30
    with celery_worker(tmp_path, broker=broker_url, concurrency=1, env=IMPORTS):
        handle = sj.watched.apply_async((n, 0.3), workspace_id="ws-a")
        wait_for(lambda: run_state(engine, handle.id) == "running", timeout=30, what="the run to start")
        context = new_context(browser, ALICE)
        page = context.new_page()
        page.goto(f"{dashboard}/runs/{handle.id}")
        page.evaluate("window.__motirStayed = 'yes'")            # gone if the page is loaded again
        meta = page.get_by_test_id("progress-meta")
        expect(meta).to_contain_text('"done":', timeout=10_000)
        first = json.loads(meta.inner_text())["done"]
        # Moved, in place, while the run still runs. "At least": a report lasts 0.3 s, and Playwright's
        # polling (up to 1 s apart) may step over any one value.
        page.wait_for_function(MOVED, arg=first + 3, timeout=10_000)
        now = json.loads(meta.inner_text())["done"]
        assert first + 3 <= now < n, f"the report went from {first} to {now} of {n}: not followed live"
        assert page.locator('[data-stream="log"] li').count() >= first + 3
        assert page.evaluate("window.__motirStayed") == "yes"
        shoot(page, tmp_path, "run-live")
        # to the end: the last report, every item, and the finished run's page, still never reloaded
        expect(meta).to_contain_text(re.compile(f'"done":{n}[,}}]'), timeout=30_000)
        expect(page.locator("h1 .state")).to_have_text("succeeded", timeout=30_000)
        assert page.evaluate("window.__motirStayed") == "yes"
        items = page.locator('[data-stream="log"] li code').all_inner_texts()
        assert items[-1] == f'"line {n}"' and len(items) == min(n, 20)
        context.close()
    assert handle.get(timeout=10) == n
