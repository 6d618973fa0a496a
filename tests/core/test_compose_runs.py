"""step.invoke / step.gather (issue 20): child runs awaited durably.

In this process on the test kit (``motir``: the real claim, step and settle statements against
Postgres, ``advance`` for the timeouts); the fan-out across two workers runs on two threads that
take and run due runs concurrently (tests/fixtures/kit_workers.py). No test here needs a worker
process: the worker's own side of composition is tests/adapter's.
"""

from __future__ import annotations

import pytest
from sqlalchemy import text

import tests.fixtures.compose_jobs  # noqa: F401
from motir_celery import cancel_run
from motir_celery.testing import Motir
from tests.conftest import count_effects, run_state
from tests.fixtures.kit_workers import run_concurrently


def _children(engine, parent):  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return conn.execute(text("SELECT id, parent_step_id, state, workspace_id, result, event_name "
                                 "FROM job_queue WHERE parent_run_id = :p ORDER BY parent_step_id"),
                            {"p": parent}).all()


def _ledger(engine, run_id):  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return conn.execute(text("SELECT outcome FROM job_run WHERE run_id = :r ORDER BY started_at"),
                            {"r": run_id}).scalars().all()


def _result(engine, run_id):  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return conn.execute(text("SELECT result FROM job_queue WHERE id = :r"), {"r": run_id}).scalar()


def _settle_all(kit: Motir, *, step: float = 1.0, rounds: int = 5) -> None:
    """Drain, skipping ``step`` seconds between rounds (retries' backoff), until a round runs nothing."""
    for _ in range(rounds):
        kit.drain()
        kit.advance(seconds=step)
    assert kit.drain() == []


def test_invoke_awaits_one_child_and_raises_its_failure_into_the_parent(kit: Motir) -> None:
    engine = kit.sql
    ok = kit.send_event("cb.parent", {"n": 21, "workspace_id": "acme"}).run_ids[0]
    bad = kit.send_event("cb.parent", {"n": 3, "fail": True, "workspace_id": "acme"}).run_ids[0]
    kit.drain()
    assert run_state(engine, ok) == "succeeded"
    assert run_state(engine, bad) == "succeeded"  # the handler caught ChildFailed
    assert _result(engine, ok) == {"child": 42}
    assert _result(engine, bad) == {"failed": "child 3 refused", "state": "failed"}
    (child,) = _children(engine, ok)
    assert (child.parent_step_id, child.state, child.workspace_id, child.result) == ("child", "succeeded", "acme", 42)
    assert child.event_name == "motir.invoke:cb.child"
    # The parent gave its executor back while the child ran, and resumed once.
    assert _ledger(engine, ok) == ["suspended", "succeeded"]
    assert count_effects(engine, ok, "before") == 1 and count_effects(engine, ok, "after") == 1
    assert count_effects(engine, child.id, "work") == 1
    (failed_child,) = _children(engine, bad)
    assert failed_child.state == "failed"


def test_cancelling_the_parent_cancels_its_child_and_a_timeout_cancels_it_too(kit: Motir) -> None:
    engine = kit.sql
    parent = kit.send_event("cb.parent", {"n": 1, "sleepy": True}).run_ids[0]
    timed = kit.send_event("cb.parent", {"n": 2, "sleepy": True, "timeout": 1.5}).run_ids[0]
    detached = kit.send_event("cb.parent", {"n": 3, "sleepy": True, "detach": True}).run_ids[0]
    kit.drain()
    for run_id in (parent, detached):  # each parent waits for its sleeping child
        assert [c.state for c in _children(engine, run_id)] == ["queued"] and _ledger(engine, run_id) == ["suspended"]
    assert cancel_run(parent) and cancel_run(detached)
    assert [c.state for c in _children(engine, parent)] == ["cancelled"]
    assert [c.state for c in _children(engine, detached)] == ["queued"]  # detach=True: it runs on
    kit.advance(seconds=0.5)
    kit.drain()
    assert run_state(engine, timed) == "queued"  # its timeout is not over yet
    kit.advance(seconds=1)
    kit.drain()
    assert run_state(engine, timed) == "succeeded"
    assert cancel_run(_children(engine, detached)[0].id)
    assert run_state(engine, parent) == "cancelled"
    assert _result(engine, timed)["state"] == "cancelled"
    assert "did not settle within the timeout" in _result(engine, timed)["failed"]
    assert [c.state for c in _children(engine, timed)] == ["cancelled"]


def test_a_fan_out_of_50_on_two_workers_runs_each_child_once_and_resumes_the_parent_once(kit: Motir) -> None:
    engine = kit.sql
    parent = kit.send_event("cb.fan", {"n": 50, "fail": [7], "workspace_id": "acme"}).run_ids[0]
    # Two threads take and run due runs concurrently, as two worker processes of one process each.
    run_concurrently(kit, 2, lambda: run_state(engine, parent) in ("succeeded", "failed", "cancelled"),
                     timeout=150, name="w")
    assert run_state(engine, parent) == "succeeded"
    kids = _children(engine, parent)
    assert len(kids) == 50 and {k.parent_step_id for k in kids} == {f"kids[{i}]" for i in range(50)}
    assert sorted(k.state for k in kids).count("succeeded") == 49
    assert all(count_effects(engine, k.id, "work") == 1 for k in kids)  # each child once
    with engine.connect() as conn:
        workers = conn.execute(text("SELECT count(DISTINCT r.worker) FROM job_run r JOIN job_queue q ON q.id = r.run_id "
                                    "WHERE q.parent_run_id = :p"), {"p": parent}).scalar()
    assert workers == 2  # both workers took children
    # Collect semantics: the failed child did not stop its siblings; the parent saw every result.
    assert _result(engine, parent) == {"sum": sum(2 * i for i in range(50) if i != 7), "failed": [7]}
    # Resumed once: one suspended attempt, one that finished; the handler ran twice in all.
    assert _ledger(engine, parent) == ["suspended", "succeeded"]
    assert count_effects(engine, parent, "handler") == 2
    assert count_effects(engine, parent, "after") == 1


# --- the dashboard shows composition (Chromium, like tests/ops/test_browser.py) ------------------

from tests.fixtures.browser import ALICE, new_context, shoot  # noqa: E402


def test_the_dashboard_shows_parents_children_events_and_resumes_in_a_browser(
        kit, browser, dashboard, engine, tmp_path):  # type: ignore[no-untyped-def]  # noqa: F811
    # The runs are made by the kit (requested before the dashboard, so the dashboard's replays and
    # resumes are held by it too); kit and dashboard share the session's database.
    from playwright.sync_api import expect

    assert kit.sql.url == engine.url
    fan = kit.send_event("cb.fan", {"n": 3, "workspace_id": "ws-a"}).run_ids[0]
    single = kit.send_event("cb.parent", {"n": 4, "workspace_id": "ws-a"}).run_ids[0]
    order = kit.send_event("cb.order.paid", {"order": "K", "workspace_id": "ws-a"},
                           idempotency_key="ws-a:order-K").run_ids[0]
    waiting = kit.send_event("cb.parent", {"n": 5, "sleepy": True, "workspace_id": "ws-a"}).run_ids[0]
    _settle_all(kit, step=0.5, rounds=3)  # the order's charge fails twice: its retry's backoff skipped
    for run_id in (fan, single):
        assert run_state(engine, run_id) == "succeeded"
    assert run_state(engine, order) == "failed"
    assert _ledger(engine, waiting) == ["suspended"]  # the parent waiting for its child

    context = new_context(browser, ALICE)
    page = context.new_page()
    # A run page lists its children with their states; a child links its parent.
    page.goto(f"{dashboard}/runs/{fan}")
    children = page.get_by_test_id("children")
    expect(children.locator("tbody tr")).to_have_count(3)
    expect(children).to_contain_text("kids[2]")
    expect(children.locator(".state-succeeded")).to_have_count(3)
    shoot(page, tmp_path, "run-children")
    children.locator("a").first.click()
    expect(page.get_by_test_id("parent")).to_contain_text("cb.fan")
    page.get_by_test_id("parent").locator("a").click()
    expect(page).to_have_url(f"{dashboard}/runs/{fan}")
    expect(page.locator('meta[http-equiv="refresh"]')).to_have_count(0)  # finished: no refresh
    expect(page.locator("main[data-live]")).to_have_count(0)              # nor a live view
    # A live run (a parent waiting for its child) follows itself: its page's live view (its
    # <noscript> refresh is for a browser without JavaScript: tests/ops/test_progress_ops.py).
    page.goto(f"{dashboard}/runs/{waiting}")
    expect(page.locator("main[data-live]")).to_have_count(1)
    expect(page.get_by_test_id("children")).to_contain_text("queued")

    # The events page: by name and a payload field, with the runs each event made.
    page.goto(f"{dashboard}/events?name=cb.parent&field=n&value=4")
    rows = page.locator("tr[data-event]")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("cb.parent")
    expect(rows.first.locator(".state-succeeded")).to_have_count(1)
    page.goto(f"{dashboard}/events?field=order&value=K")
    expect(page.locator("tr[data-event]")).to_have_count(1)
    expect(page.locator("tr[data-event]").first).to_contain_text("ws-a:order-K")
    page.goto(f"{dashboard}/events")
    shoot(page, tmp_path, "events")
    admin = new_context(browser, {"X-Motir-User": "root", "X-Motir-Admin": "true"})
    admin_page = admin.new_page()
    admin_page.goto(f"{dashboard}/events?workspace=ws-a&name=cb.order.paid")
    expect(admin_page.locator("tr[data-event]")).to_have_count(1)
    admin_page.goto(f"{dashboard}/events?workspace=ws-b")
    expect(admin_page.locator("tr[data-event]")).to_have_count(0)
    admin.close()

    # The DLQ page shows the event data and warns before replaying a keyed event.
    page.goto(f"{dashboard}/dlq")
    entry = page.locator("tr[data-dlq]")
    expect(entry.get_by_test_id("event-data")).to_contain_text('"order": "K"')
    expect(entry.get_by_test_id("key-warning")).to_contain_text("ws-a:order-K")
    shoot(page, tmp_path, "dlq-keyed")
    entry.get_by_test_id("replay").click()  # the box is not ticked: the browser does not send it
    expect(page).to_have_url(f"{dashboard}/dlq")
    expect(entry.get_by_test_id("replay")).to_be_visible()

    # Resume (after fixing the cause): the same run, from its failed step.
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO test.side_effect (run_id, step) VALUES ('fixed', 'charge')"))
    entry.get_by_test_id("resume").click()
    expect(page).to_have_url(f"{dashboard}/runs/{order}?notice=resumed")
    expect(page.get_by_role("status")).to_contain_text("queued again from its failed step")
    kit.drain()  # the resumed run, as a worker would take its message
    expect(page.locator("h1 .state")).to_have_text("succeeded", timeout=30_000)  # refreshes itself
    expect(page.get_by_test_id("resumed")).to_contain_text("alice")
    shoot(page, tmp_path, "run-resumed")
    context.close()
    cancel_run(waiting)
    assert count_effects(engine, order, "invoice") == 1 and count_effects(engine, order, "email") == 1


# --- the machinery, step by step in this process (no worker): the key, the wake, the trace ---

def _claim(engine, run_id):  # type: ignore[no-untyped-def]
    from motir_celery.core.worker.steps import Step
    from motir_celery.store.sql import worker as worker_sql
    from tests.fixtures.engines import holding

    conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    claim = worker_sql.claim(conn, run_id, job_id="cb.parent", worker="test", lease_seconds=30, async_commit=True)
    assert claim is not None
    return conn, Step(holding(), claim, conn, event_data=claim.event_data)


def test_one_child_per_parent_step_across_reclaims_and_the_settle_wakes_the_parent(engine):  # type: ignore[no-untyped-def]
    from sqlalchemy.exc import IntegrityError

    from motir_celery.errors import Suspended
    from tests.fixtures.engines import send

    (parent,) = send("cb.parent", {"n": 1, "workspace_id": "acme"}).run_ids
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with engine.begin() as conn:
        conn.execute(text("UPDATE job_queue SET traceparent = :t WHERE id = :r"), {"t": trace, "r": parent})
    for _ in range(2):  # the first attempt, then the same step after a lost lease (reclaimed, claimed anew)
        conn, step = _claim(engine, parent)
        with pytest.raises(Suspended):
            step.invoke("child", "cb.child", {"n": 1})
        conn.close()
        with engine.begin() as c:
            c.execute(text("UPDATE job_queue SET run_at = now(), wait_event = NULL WHERE id = :r"), {"r": parent})
    with engine.connect() as c:
        kids = c.execute(text("SELECT id, workspace_id, traceparent, event_name FROM job_queue "
                              "WHERE parent_run_id = :p"), {"p": parent}).all()
        assert len(kids) == 1 and kids[0].workspace_id == "acme" and kids[0].traceparent == trace
        assert c.execute(text("SELECT count(*) FROM job_event WHERE idempotency_key LIKE 'motir.invoke:%'")).scalar() == 1
    with pytest.raises(IntegrityError):  # the database refuses a second child for the step, whoever asks
        with engine.begin() as c:
            c.execute(text("INSERT INTO job_queue (job_id, event_name, max_attempts, retry_policy, parent_run_id, "
                           "parent_step_id) VALUES ('cb.child', 'x', 1, 'none', :p, 'child')"), {"p": parent})
    # Suspended again (the loop's last attempt): the child's settle makes the parent due, in its transaction.
    conn, step = _claim(engine, parent)
    with pytest.raises(Suspended):
        step.invoke("child", "cb.child", {"n": 1})
    conn.close()
    with engine.begin() as c:
        c.execute(text("UPDATE job_queue SET state = 'succeeded', result = '7', finished_at = now() WHERE id = :k"),
                  {"k": kids[0].id})
        assert c.execute(text("SELECT run_at <= now() FROM job_queue WHERE id = :r"), {"r": parent}).scalar()
    conn, step = _claim(engine, parent)
    assert step.invoke("child", "cb.child", {"n": 1}) == 7
    conn.close()
