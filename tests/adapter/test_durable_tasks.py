"""A team's own Celery task made durable by ``durable=True`` (adapter/tasks.py), through real workers.

The tasks are ``tests/fixtures/durable_tasks.py``: Celery's decorator and options, ``self.request``,
``self.retry``, ``autoretry_for``, ``self.step``; this process is their producer, a real
``celery worker`` (prefork) their consumer, Redis their broker and result backend.
"""

from __future__ import annotations

import importlib
import signal
import uuid
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import pytest
from celery import chain, chord
from celery.exceptions import TaskRevokedError
from sqlalchemy import text
from sqlalchemy.engine import Engine

from motir_celery.errors import PayloadError
from tests.conftest import celery_worker, run_state, wait_for

APP = "tests.fixtures.durable_tasks"


@pytest.fixture
def tasks(broker_url: str, database_url: str) -> Iterator[ModuleType]:
    module = importlib.import_module(APP)
    yield module


def effects(engine: Engine, key: str) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT step FROM test.side_effect WHERE run_id = :k ORDER BY id"),
                                 {"k": key}).scalars())


def dlq_failure(engine: Engine, run_id: str) -> dict[str, Any] | None:
    with engine.connect() as conn:
        return conn.execute(text("SELECT failure FROM job_run_dlq WHERE run_id = :r"), {"r": run_id}).scalar()


def test_autoretry_for_retries_the_bound_task_until_it_succeeds(tmp_path: Path, tasks: ModuleType,
                                                                 engine: Engine, broker_url: str) -> None:
    key = uuid.uuid4().hex
    with celery_worker(tmp_path, broker=broker_url, app=APP):
        result = tasks.flaky.delay(key, 2)
        assert result.get(timeout=30) == 2
    assert effects(engine, key) == ["retries=0", "retries=1", "retries=2"]   # self.request.retries, as Celery counts
    assert run_state(engine, result.id) == "succeeded"                        # one run, under the task's id
    with engine.connect() as conn:
        outcomes = conn.execute(text("SELECT outcome FROM job_run WHERE run_id = :r ORDER BY attempt"),
                                {"r": result.id}).scalars().all()
    assert outcomes == ["retrying", "retrying", "succeeded"]


def test_a_retry_after_a_stored_step_does_not_run_the_step_again(tmp_path: Path, tasks: ModuleType,
                                                                  engine: Engine, broker_url: str) -> None:
    key = uuid.uuid4().hex
    with celery_worker(tmp_path, broker=broker_url, app=APP):
        result = tasks.charge_then_retry.delay(key)
        assert result.get(timeout=30) == "charge"   # the second attempt read the step's stored result
    assert effects(engine, key) == ["charge"]


def test_exhausted_retries_land_in_the_dlq_with_the_tasks_own_exception(tmp_path: Path, tasks: ModuleType,
                                                                        engine: Engine, broker_url: str) -> None:
    key = uuid.uuid4().hex
    with celery_worker(tmp_path, broker=broker_url, app=APP):
        result = tasks.exhausts.delay(key)
        with pytest.raises(tasks.Declined, match=f"declined {key}"):
            result.get(timeout=30)
    assert effects(engine, key) == ["attempt"] * 3                 # max_retries=2: three attempts
    assert run_state(engine, result.id) == "failed"
    failure = dlq_failure(engine, result.id)
    assert failure is not None and failure["type"] == "tests.fixtures.durable_tasks.Declined"
    assert failure["message"] == f"declined {key}"


def test_celerys_chord_of_durable_tasks_runs_once_through_a_kill_9(tmp_path: Path, tasks: ModuleType,
                                                                  engine: Engine, broker_url: str) -> None:
    key, parts = uuid.uuid4().hex, 6
    env = {"MOTIR_REPUBLISH_AFTER": "3"}
    with celery_worker(tmp_path, broker=broker_url, app=APP, lease=2, env=env, name="doomed") as doomed:
        result = chord([tasks.part.s(key, i, 2.0) for i in range(parts)], tasks.total.s(key)).delay()
        wait_for(lambda: len(effects(engine, key)) >= 2, timeout=30, what="two parts under way")
        doomed.kill(signal.SIGKILL)   # mid-chord: two parts past their step, in their sleep
    with celery_worker(tmp_path, broker=broker_url, app=APP, lease=2, env=env, name="heir"):
        assert result.get(timeout=90) == sum(range(parts))
    done = effects(engine, key)
    assert sorted(done) == sorted([f"part-{i}" for i in range(parts)] + ["total"]), done   # each exactly once
    with engine.connect() as conn:
        again = conn.execute(text("SELECT count(*) FROM job_queue WHERE job_id = :j AND attempts > 1"),
                             {"j": tasks.part.name}).scalar()
    assert again >= 2   # the parts the kill cut short ran again, from their stored step on


def test_revoke_of_a_queued_run_cancels_it_and_it_never_runs(tmp_path: Path, tasks: ModuleType,
                                                            engine: Engine, broker_url: str) -> None:
    key = uuid.uuid4().hex
    result = tasks.add.delay(key, 1, 2)    # queued: no worker yet
    result.revoke()                       # heard by no worker: the run is cancelled in Postgres
    assert run_state(engine, result.id) == "cancelled"
    assert result.state == "REVOKED"
    with celery_worker(tmp_path, broker=broker_url, app=APP) as worker:
        wait_for(lambda: "was revoked: not run" in worker.output(), timeout=30, what="the message refused")
        with pytest.raises(TaskRevokedError):
            result.get(timeout=10)
    assert effects(engine, key) == []


def test_values_come_back_as_celerys_json_serializer_gives_them_and_an_ignored_one_is_kept_nowhere(
        tmp_path: Path, tasks: ModuleType, engine: Engine, broker_url: str) -> None:
    value = {"bytes": b"\x01raw", "when": datetime(2026, 12, 4, tzinfo=timezone.utc), "amount": Decimal("1.10"),
             "pair": (1, 2)}
    with celery_worker(tmp_path, broker=broker_url, app=APP):
        assert tasks.echo.delay(value).get(timeout=30) == {**value, "pair": [1, 2]}
        ignored = tasks.add.apply_async((uuid.uuid4().hex, 1, 2), ignore_result=True)
        wait_for(lambda: run_state(engine, ignored.id) == "succeeded", timeout=30, what="the ignored run")
    assert ignored.get(timeout=1) is None and ignored.result is None     # as Celery (its own suite's test)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT result FROM job_queue WHERE id = :id"), {"id": ignored.id}).scalar() is None


def test_apply_async_of_a_durable_task_with_a_subject_stores_it_on_the_run(tasks: ModuleType, engine: Engine) -> None:
    key = uuid.uuid4().hex
    result = tasks.add.apply_async((key, 1, 2), subject=("media_item", "7"))   # queued: no worker needed
    plain = tasks.add.apply_async((key, 2, 3))
    with engine.connect() as conn:
        subjects = dict(conn.execute(text("SELECT id::text, subject_type || ':' || subject_id FROM job_queue "
                                          "WHERE id IN (:a, :b)"), {"a": result.id, "b": plain.id}).all())
    assert subjects == {result.id: "media_item:7", plain.id: None}
    with pytest.raises(PayloadError, match="subject"):
        tasks.add.apply_async((key, 1, 2), subject="media_item:7")
    # No message of this test is left: the next test starts on empty tables, where a later worker would
    # adopt a message with no run behind it (and run it), revoked or not.
    assert tasks.app.control.purge() == 2


def test_a_direct_call_runs_the_body_here_and_stores_nothing(tasks: ModuleType, engine: Engine) -> None:
    key = uuid.uuid4().hex
    assert tasks.add(key, 2, 3) == 5
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM job_queue")).scalar() == 0
    assert effects(engine, key) == ["add"]


def test_a_copy_of_a_message_runs_nothing_and_a_signature_sent_again_runs_again(
        tmp_path: Path, tasks: ModuleType, engine: Engine, broker_url: str) -> None:
    key, task_id = uuid.uuid4().hex, str(uuid.uuid4())
    with celery_worker(tmp_path, broker=broker_url, app=APP) as worker:
        assert tasks.add.apply_async((key, 1, 2), task_id=task_id).get(timeout=30) == 3
        tasks.app.send_task(tasks.add.name, (key, 1, 2), task_id=task_id)   # a copy (a redelivery, a duplicate)
        wait_for(lambda: worker.output().count(f"[{task_id}] ignored") == 1, timeout=30, what="the copy refused")
        tasks.add.apply_async((key, 1, 2), task_id=task_id)    # a frozen signature sent again: Celery runs it again
        tasks.add.apply_async((key, 5, 5), task_id=task_id)    # and with other arguments
        wait_for(lambda: len(effects(engine, key)) == 3, timeout=30, what="the two calls after the copy")
    with engine.connect() as conn:
        results = conn.execute(text("SELECT result FROM job_queue WHERE state = 'succeeded'")).scalars().all()
    assert sorted(results) == [3, 3, 10]   # three calls, three runs; the copy none


def test_one_setting_makes_every_task_of_an_app_durable_but_one_that_opts_out(
        tmp_path: Path, engine: Engine, broker_url: str, database_url: str) -> None:
    module = importlib.import_module("tests.fixtures.durable_everything")   # no result backend: the runs table
    with celery_worker(tmp_path, broker=broker_url, app="tests.fixtures.durable_everything") as worker:
        doubled, tripled, halved = module.double.delay(4), module.triple.delay(4), module.halve.delay(4)
        assert (doubled.get(timeout=30), tripled.get(timeout=30)) == (8, 12)
        assert chain(module.double.s(1), module.double.s(), module.triple.s()).delay().get(timeout=30) == 12
        assert chord([module.double.s(i) for i in range(4)], module.total.s()).delay().get(timeout=60) == 12
        wait_for(lambda: f"halve[{halved.id}] succeeded" in worker.output(), timeout=30, what="the plain task")
    with engine.connect() as conn:
        jobs = set(conn.execute(text("SELECT job_id FROM job_queue WHERE state = 'succeeded'")).scalars())
        plain = conn.execute(text("SELECT count(*) FROM job_queue WHERE id = :r"), {"r": halved.id}).scalar()
    assert jobs == {f"tests.fixtures.durable_everything.{name}" for name in ("double", "triple", "total")}
    assert plain == 0   # halve stayed a plain Celery task


def test_a_dead_lettered_task_resumes_from_its_stored_steps(tmp_path: Path, tasks: ModuleType,
                                                                      engine: Engine, broker_url: str) -> None:
    import motir_celery

    key = uuid.uuid4().hex
    with celery_worker(tmp_path, broker=broker_url, app=APP):
        result = tasks.until_allowed.delay(key)
        with pytest.raises(tasks.Declined):
            result.get(timeout=30)
        with engine.connect() as conn:
            entry = conn.execute(text("SELECT id FROM job_run_dlq WHERE run_id = :r"), {"r": result.id}).scalar()
        tasks.record(key, "allow")
        resumed = motir_celery.resume_dlq(entry, actor="test", app=tasks.app)   # the run itself, its steps kept
        wait_for(lambda: run_state(engine, result.id) == "succeeded", timeout=30, what="the resumed run")
        assert tasks.app.AsyncResult(result.id).get(timeout=10) == "charge"   # under the task's own id
    assert resumed is not None
    assert effects(engine, key) == ["charge", "allow"]   # the stored step did not run again
