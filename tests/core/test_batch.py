"""send_events: N events and their runs in one statement (issue 20).

The runs are run in this process by the test kit (``motir``: the real claim, step and settle
statements against Postgres). ``send_events`` publishes its runs through the adapter's pipelined
Redis lane (``publish_many``): the messages it left in the session's queue are read back, one per
run; tests/adapter/test_messages.py runs messages of that lane on a real worker.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Callable, Iterator

import pytest
import redis
from sqlalchemy import text

import tests.fixtures.compose_jobs  # noqa: F401  (registers the jobs in this process, for the fan-out)
import tests.fixtures.jobs  # noqa: F401
from motir_celery import PayloadError, send_events
from motir_celery.adapter.celery_app import create_app
from motir_celery.settings import Settings
from tests.conftest import count_effects, run_state
from tests.fixtures.engines import holding


@pytest.fixture
def app(broker_url):  # type: ignore[no-untyped-def]
    return create_app(Settings.from_env())


@pytest.fixture
def taken(app, broker_url) -> Iterator[Callable[[], list[str]]]:  # type: ignore[no-untyped-def]
    """Takes the messages waiting in the session's queue off it: the run ids they name (a
    message's task id is its run's id). The queue is emptied before and after the test."""
    client = redis.Redis.from_url(broker_url)
    queue = app.conf.task_default_queue
    keys = [queue] + [f"{queue}\x06\x16{step}" for step in range(1, 10)]  # kombu's priority lists

    def take() -> list[str]:
        found = []
        for key in keys:
            found += [json.loads(m)["headers"]["id"] for m in client.lrange(key, 0, -1)]
            client.delete(key)
        return found

    take()
    try:
        yield take
    finally:
        take()
        client.close()


def _done(engine, run_ids):  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM job_queue WHERE id = ANY(:r) AND state = 'succeeded'"),
                            {"r": run_ids}).scalar() == len(run_ids)


def test_a_batch_writes_every_event_and_run_once_publishes_each_run_once_and_they_run(kit, app, taken):  # type: ignore[no-untyped-def]
    engine = kit.sql
    items = [{"name": "cb.item", "data": {"i": i, "workspace_id": "acme" if i % 2 else "globex"},
              "idempotency_key": f"k-{i}"} for i in range(150)]
    items.append(("cb.item", {"i": 999}))  # a pair, no key, no workspace
    items.append({"name": "cb.item", "data": {"i": 0, "workspace_id": "globex"}, "idempotency_key": "k-0"})  # dup in batch
    items.append({"name": "nobody.listens", "data": {}})
    results = send_events(items, app=app)
    assert len(results) == len(items)
    run_ids = [r for res in results for r in res.run_ids]
    assert len(run_ids) == 151
    # One message per run, after the commit (the lane's in Redis; any the kit held, there).
    published = Counter(taken() + [str(run_id) for run_id, _, _ in kit.published])
    assert {r: published[str(r)] for r in run_ids} == {r: 1 for r in run_ids}
    kit.drain()
    assert _done(engine, run_ids)
    # one result per event, in order; the repeated key within the batch deduplicated (same data)
    assert results[151].deduplicated and not results[151].conflicting
    assert results[151].event_id == results[0].event_id
    assert results[152].event_id is not None and results[152].runs == []
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM job_event")).scalar() == 152
        ws = dict(conn.execute(text("SELECT workspace_id, count(*) FROM job_queue GROUP BY 1")).all())
    assert ws == {"acme": 75, "globex": 75, None: 1}  # the payload's workspace, per event
    assert all(count_effects(engine, r, "touch") == 1 for r in run_ids[:20])

    # the same batch again: every keyed event deduplicated, nothing written; one changed → conflicting
    again = send_events(items[:3] + [{"name": "cb.item", "data": {"i": -1, "workspace_id": "acme"},
                                      "idempotency_key": "k-1"}], app=app)
    assert [r.deduplicated for r in again] == [True, True, True, True]
    assert [r.conflicting for r in again] == [False, False, False, True]
    assert all(r.runs == [] for r in again)


def test_a_batch_wakes_waiters_and_is_all_or_nothing(kit, app, taken):  # type: ignore[no-untyped-def]
    engine = kit.sql
    (waiting,) = send_events([("cb.order", {"order": "o-7"})], app=app)[0].run_ids
    kit.drain()
    assert _waiting(engine, waiting)  # suspended, waiting for its payment
    results = send_events([("cb.paid", {"order": "o-6"}), ("cb.paid", {"order": "o-7"})], app=app)
    assert [w.run_id for r in results for w in r.woken] == [waiting]
    kit.drain()
    assert run_state(engine, waiting) == "succeeded"
    with engine.connect() as conn:
        assert conn.execute(text("SELECT result FROM job_queue WHERE id = :r"), {"r": waiting}).scalar() == {"paid": True}
        before = conn.execute(text("SELECT count(*) FROM job_event")).scalar()
    with pytest.raises(PayloadError):  # one bad item: nothing of the batch is written
        send_events([("cb.item", {"i": 1}), ("cb.item", {"bad": "\x00"})], app=app)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM job_event")).scalar() == before


def test_a_batch_through_the_app_role_session_publishes_on_commit_only(engine, broker_url, app):  # type: ignore[no-untyped-def]
    with holding().session("acme") as session:
        results = send_events([{"name": "cb.item", "data": {"i": i}, "workspace_id": "acme"} for i in (1, 2)],
                              session=session, app=app)
        assert len(results) == 2 and all(len(r.run_ids) == 1 for r in results)
        session.rollback()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM job_event")).scalar() == 0


def _waiting(engine, run_id):  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return conn.execute(text("SELECT wait_event FROM job_queue WHERE id = :r AND state = 'queued'"),
                            {"r": run_id}).scalar() == "cb.paid"


def test_a_batch_under_the_app_role_wakes_its_workspace_waiters_through_motir_wake_waiters(engine):  # type: ignore[no-untyped-def]
    from motir_celery.core.worker.steps import Step
    from motir_celery.errors import Suspended
    from motir_celery.store.sql import worker as worker_sql

    waiters = {}
    worker = holding()
    for ws in ("acme", "globex"):
        (run_id,) = worker.send_event("cb.order", {"order": "o-1", "workspace_id": ws}).run_ids
        conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        claim = worker_sql.claim(conn, run_id, job_id="cb.waiter", worker="test", lease_seconds=30,
                                 async_commit=True)
        assert claim is not None
        step = Step(worker, claim, conn, event_data=claim.event_data)
        with pytest.raises(Suspended):
            step.wait_for_event("paid", event="cb.paid", match="data.order", timeout=600)
        conn.close()
        waiters[ws] = run_id
    with holding().session("acme") as session:  # the app role: no UPDATE on job_queue
        (result,) = send_events([{"name": "cb.paid", "data": {"order": "o-1"}, "workspace_id": "acme"}],
                                session=session)
        session.commit()
    assert [w.run_id for w in result.woken] == [waiters["acme"]]  # its own workspace's waiter only
    with engine.connect() as conn:
        due = dict(conn.execute(text("SELECT workspace_id, run_at <= now() FROM job_queue WHERE id = ANY(:r)"),
                                {"r": list(waiters.values())}).all())
    assert due == {"acme": True, "globex": False}
