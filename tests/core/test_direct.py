"""Direct runs, Celery-shaped: job.delay() / apply_async(), their result handle.

Never task_always_eager: every run is written by ``delay()`` / ``apply_async()`` and its message
published (held by the test kit, ``motir``), then claimed and settled by the real runner in this
process (``motir.drain()``, ``advance`` for countdowns); the handle reads the result from Postgres.
The plain Celery example runs on a real worker of its own app.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

import tests.fixtures.direct_jobs as dj
from motir_celery import (
    CanvasNotSupported,
    JobDefinitionError,
    JobFailed,
    PayloadError,
    ResultTimeout,
    RunHandle,
    replay_dlq,
    send_event,
)
from motir_celery.core.producer.results import celery_state
from motir_celery.testing import Held, Motir
from tests.conftest import ROOT, celery_worker, count_effects, run_state, wait_for


def test_delay_get_returns_the_result(kit: Motir) -> None:
    engine = kit.sql
    handle = dj.add.delay(2, 3, scale=10)
    assert handle.deduplicated is False
    kit.drain()
    result = handle.get(timeout=10)
    assert result == {"total": 50, "run_id": str(handle.id), "attempt": 1}
    assert handle.state == "SUCCESS" and handle.ready() and handle.successful()
    # The arguments are stored as the run's event: direct.<job_id>, {"args", "kwargs"}.
    with engine.connect() as conn:
        row = conn.execute(text("SELECT e.name, e.data FROM job_queue q JOIN job_event e ON e.id = q.event_id "
                                "WHERE q.id = :id"), {"id": handle.id}).one()
    assert row.name == "direct.test.direct.add"
    assert row.data == {"args": [2, 3], "kwargs": {"scale": 10}}
    assert count_effects(engine, handle.id, "add") == 1


def test_a_failing_job_raises_its_error_from_get(kit: Motir) -> None:
    engine = kit.sql
    handle = dj.fail.apply_async(args=["card declined"])
    kit.drain()
    with pytest.raises(ValueError) as info:  # a built-in error comes back as itself (and JobFailed)
        handle.get(timeout=10)
    assert isinstance(info.value, JobFailed)
    assert info.value.type == "builtins.ValueError" and info.value.message == "card declined"
    assert "raise ValueError(message)" in info.value.remote_traceback
    assert handle.state == "FAILURE" and handle.failed()
    assert handle.get(timeout=1, propagate=False)["message"] == "card declined"
    refused = dj.refuse.delay()
    kit.drain()
    with pytest.raises(JobFailed, match="NonRetriableError: no such customer"):
        refused.get(timeout=10)
    # Its DLQ entry replays the same arguments (the event's data) for the job.
    with engine.connect() as conn:
        dlq_id = conn.execute(text("SELECT id FROM job_run_dlq WHERE run_id = :id"), {"id": handle.id}).scalar_one()
    replay = replay_dlq(dlq_id, actor="test")
    assert replay.status == "replayed"
    kit.drain()
    with pytest.raises(ValueError, match="card declined"):
        RunHandle(replay.run_id, "test.direct.fail").get(timeout=10)


def test_direct_runs_join_a_framework_transaction(engine: Engine) -> None:
    """The engine's join_transactions (contrib/django's hook): delay() writes there, publishes on its commit."""
    from contextlib import contextmanager

    from motir_celery.core.current import make_current
    from tests.fixtures.engines import holding

    commits: list[Any] = []

    @contextmanager
    def joined(workspace_id: str | None) -> Iterator[Any]:
        with engine.begin() as conn:
            yield conn, commits.append

    published = Held()
    motir = holding(published)
    motir.join_transactions(joined)
    before = make_current(motir)
    try:
        handle = dj.add.delay(1, 2)
    finally:
        make_current(before)
    assert run_state(engine, handle.id) == "queued" and len(commits) == 1
    assert published == []  # not before the framework's commit
    commits[0]()
    assert [run_id for run_id, _, _ in published] == [handle.id]


def test_same_task_id_twice_makes_one_run(kit: Motir) -> None:
    engine = kit.sql
    task_id = str(uuid.uuid4())
    first = dj.add.apply_async(args=[1, 1], task_id=task_id)
    second = dj.add.apply_async(args=[1, 1], task_id=task_id)
    third = dj.add.apply_async(args=[1, 1], idempotency_key=task_id)  # the same key, by its other name
    assert not first.deduplicated and second.deduplicated and third.deduplicated
    assert first.id == second.id == third.id
    kit.drain()
    assert second.get(timeout=10)["total"] == 2
    with engine.connect() as conn:
        runs = conn.execute(text("SELECT count(*) FROM job_queue WHERE job_id = 'test.direct.add'")).scalar()
    assert runs == 1 and count_effects(engine, first.id, "add") == 1
    # The key is the job's own: another job may use the same one.
    other = dj.fail.apply_async(args=["x"], task_id=task_id)
    assert not other.deduplicated and other.id != first.id


def test_countdown_and_eta_are_respected(kit: Motir) -> None:
    engine = kit.sql
    with engine.connect() as conn:
        db_now = conn.execute(text("SELECT now()")).scalar_one()
    later = dj.add.apply_async(args=[1, 2], countdown=2.5)
    at = dj.add.apply_async(args=[3, 4], eta=db_now + timedelta(seconds=2.5))
    # Each message carries its run's countdown (Celery holds it), the database's run_at - now().
    countdowns = {run_id: countdown for run_id, _, countdown in kit.published}
    assert 2.0 <= countdowns[later.id] <= 2.5 and 2.0 <= countdowns[at.id] <= 2.5, countdowns
    # A message delivered early claims nothing: neither run is claimable yet.
    for handle in (later, at):
        assert kit.engine.execute(handle.id, job_id="test.direct.add", worker="early").state == "skipped"
    assert kit.drain() == []
    assert run_state(engine, later.id) == "queued" and run_state(engine, at.id) == "queued"
    assert later.state == "PENDING" and not later.ready()
    with pytest.raises(ResultTimeout):
        later.get(timeout=0.3)
    kit.advance(seconds=2.5)
    kit.drain()
    assert later.get(timeout=15)["total"] == 3 and at.get(timeout=15)["total"] == 7
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT q.id, r.started_at >= q.run_at AS after_due, "
            "extract(epoch FROM q.run_at - q.created_at) AS delay "
            "FROM job_queue q JOIN job_run r ON r.run_id = q.id WHERE q.id IN (:a, :b)"),
            {"a": later.id, "b": at.id}).all()
    assert len(rows) == 2  # one attempt each: no message claimed them early
    for row in rows:
        assert row.after_due, row  # first claimed once due, by the database's clock
        assert 2.0 <= row.delay <= 3.0, row


def test_celerys_canvas_internals_in_apply_async_point_at_the_canvas() -> None:
    # Signatures, chain, group and chord of direct jobs are durable (tests/core/test_canvas.py); what
    # Celery's own canvas puts on a message is refused by name, never silently dropped.
    for option in ("chain", "chord", "group_id"):
        with pytest.raises(CanvasNotSupported, match="belong to a canvas"):
            dj.add.apply_async(args=[1, 2], **{option: "x"})
    assert dj.add.s(1, 2).node() == {"job": dj.add.id, "args": [1, 2]}


def test_refusals_before_anything_is_written(engine: Engine) -> None:
    import tests.fixtures.jobs as tj

    with pytest.raises(JobDefinitionError, match="send_event"):
        tj.three_steps.delay()
    with pytest.raises(PayloadError, match="not JSON"):
        dj.add.delay(object(), 1)
    with pytest.raises(TypeError, match="expires"):
        dj.add.apply_async(args=[1, 2], expires=10)
    with pytest.raises(ValueError, match="countdown"):
        dj.add.apply_async(args=[1, 2], countdown=-1)
    with pytest.raises(PayloadError, match="priority"):
        dj.add.apply_async(args=[1, 2], priority=12)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM job_event")).scalar() == 0


def test_session_rollback_writes_nothing_and_commit_runs_it(kit: Motir) -> None:
    engine = kit.sql
    with Session(engine) as session:
        handle = dj.add.apply_async(args=[5, 5], session=session)
        session.rollback()
    assert run_state(engine, handle.id) is None and kit.published == []
    with Session(engine) as session, session.begin():
        handle = dj.add.apply_async(args=[5, 6], countdown=0.5, session=session)
        assert run_state(engine, handle.id) is None  # not committed yet: not visible, not published
        assert kit.published == []
    assert [run_id for run_id, _, _ in kit.published] == [handle.id]  # published on its commit
    kit.advance(seconds=0.5)
    kit.drain()
    assert handle.get(timeout=10)["total"] == 11


def test_send_event_gives_a_handle_per_run(kit: Motir) -> None:
    sent = send_event("test.three", {"k": 1})
    assert [h.id for h in sent.results] == sent.run_ids
    kit.drain()
    assert sent.results[0].get(timeout=10) == {"total": 6}


def test_queue_option_routes_this_call(engine: Engine, broker_url: str) -> None:
    if not broker_url.startswith("redis://"):  # make test's broker is Redis (embedded or the machine's)
        if os.environ.get("CI"):
            pytest.fail(f"CI's broker is Redis; this test reads the Redis list of the queue, got {broker_url}")
        pytest.skip("reads the Redis list of the queue: CELERY_BROKER_URL names another broker")
    queue = f"motir-test-other-{uuid.uuid4().hex[:6]}"
    client = redis.Redis.from_url(broker_url)
    try:
        handle = dj.add.apply_async(args=[1, 1], queue=queue, priority=0)
        assert client.llen(queue) == 1
        assert celery_state(run_state(engine, handle.id), None) == "PENDING"
    finally:
        client.delete(queue)



def test_plain_celery_example_end_to_end(tmp_path: Path, database_url: str, broker_url: str) -> None:
    """examples/plain_celery: `celery -A examples.plain_celery.app worker`, and its producer script."""
    ledger = tmp_path / "ledger.txt"
    # A queue of its own: the module's worker (another app) must not take the shop's messages.
    queue = f"{os.environ['MOTIR_QUEUE']}-shop"
    env = {"SHOP_QUEUE": queue, "MOTIR_QUEUE": queue, "SHOP_LEDGER": str(ledger), "MOTIR_IMPORTS": ""}
    with celery_worker(tmp_path, broker=broker_url, app="examples.plain_celery.app", env=env, name="shop") as w:
        done = subprocess.run([sys.executable, "-m", "examples.plain_celery.place_order", "42"],
                              env={**os.environ, **env, "CELERY_BROKER_URL": broker_url}, cwd=ROOT,
                              capture_output=True, text=True, timeout=90)
        assert done.returncode == 0, done.stderr[-3000:] + w.output()[-3000:]
        wait_for(lambda: "newsletter 7" in ledger.read_text(), timeout=10, what="the plain Celery task ran")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["result"] == {"order_id": 42, "charge_id": "ch_42", "tracking": "TRACK-42"}
    assert out["state"] == "SUCCESS"
    assert out["keyed"]["first"] == out["keyed"]["second"] and out["keyed"]["deduplicated"] is True
    lines = ledger.read_text().splitlines()
    # First run: load once, the charge timed out once and was retried (load not repeated); the
    # keyed run: once (its duplicate made nothing). The plain Celery task ran beside them.
    assert lines.count("load 42") == 2 and lines.count("charge-timeout 42") == 1
    assert sum(line.startswith("charge 42 ") for line in lines) == 2 and lines.count("ship 42") == 2
    assert "newsletter 7" in lines


def test_a_direct_run_in_the_app_roles_transaction(engine: Engine) -> None:
    """Under the app role (RLS, checked functions only): the run is written in the caller's
    workspace, a key reused there answers with the first run, and the same key in another
    workspace is that workspace's own (a run of its own; the first stays invisible to it)."""
    from tests.fixtures.engines import holding

    workspace_session = holding().session
    key = f"order-{uuid.uuid4()}"
    with workspace_session("acme") as session:
        first = dj.add.apply_async(args=[1, 2], session=session, workspace_id="acme", task_id=key, countdown=300)
    with workspace_session("acme") as session:
        again = dj.add.apply_async(args=[1, 2], session=session, workspace_id="acme", task_id=key, countdown=300)
    with workspace_session("globex") as session:
        other = dj.add.apply_async(args=[1, 2], session=session, workspace_id="globex", task_id=key, countdown=300)
    assert not first.deduplicated and again.deduplicated and again.id == first.id
    assert not other.deduplicated and other.id not in (None, first.id)
    with engine.connect() as conn:
        rows = dict(conn.execute(text("SELECT workspace_id, extract(epoch FROM run_at - created_at) AS delay "
                                      "FROM job_queue")).all())
    assert rows == {"acme": 300, "globex": 300}


def test_eta_and_countdown_under_non_utc_zones(engine: Engine, database_url: str) -> None:
    """One clock: a non-UTC session TimeZone and process TZ change nothing; a naive eta is UTC."""
    from datetime import datetime, timezone
    from zoneinfo import ZoneInfo

    from sqlalchemy import create_engine

    odd = create_engine(database_url, connect_args={"options": "-c TimeZone=Pacific/Chatham"})
    old_tz = os.environ.get("TZ")
    os.environ["TZ"] = "Asia/Kolkata"
    time.tzset()
    try:
        with odd.connect() as conn:
            db_now = conn.execute(text("SELECT now()")).scalar_one()
        calls = {
            "countdown": {"countdown": 100},
            "aware eta": {"eta": (db_now + timedelta(seconds=100)).astimezone(ZoneInfo("America/New_York"))},
            "naive eta": {"eta": (db_now + timedelta(seconds=100)).astimezone(timezone.utc).replace(tzinfo=None)},
        }
        handles = {}
        for name, options in calls.items():
            with Session(odd) as session, session.begin():
                handles[name] = dj.add.apply_async(args=[1, 1], session=session, **options)
        assert datetime.now().astimezone().utcoffset() == timedelta(hours=5, minutes=30)  # the odd TZ is on
    finally:
        if old_tz is None:
            os.environ.pop("TZ")
        else:
            os.environ["TZ"] = old_tz
        time.tzset()
        odd.dispose()
    with engine.connect() as conn:
        for name, handle in handles.items():
            due_in = conn.execute(text("SELECT extract(epoch FROM run_at - :now) FROM job_queue WHERE id = :id"),
                                  {"id": handle.id, "now": db_now}).scalar_one()
            assert 99 <= due_in <= 103, (name, due_in)
