"""The cut-over: a Celery project moves to durable jobs without renaming a task, dropping a message
or changing a call site (issue 26; docs/tasks-to-jobs.md, "Cutting over").

Real workers on the real broker (this session's Redis queue), real Postgres. The project is
tests/cutover/: ``before/shop`` is plain Celery, ``after/shop`` the same tasks as durable jobs
(decorators changed, bodies not). The producer is ``tests/cutover/plain_producer.py``, a
process with no motir-celery in it, sending by task name — as an old producer, ``send_task``
and ``celery call`` do. The direct call and ``.apply()`` run in this process, with no worker.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
from celery import Celery
from celery.backends.base import DisabledBackend
from celery.result import AsyncResult
from sqlalchemy import text
from sqlalchemy.engine import Engine

from motir_celery import JobFailed, RunHandle, define_job
from motir_celery.adapter.backend import MotirBackend, RunsFirst
from motir_celery.adapter.celery_app import attach, create_app
from motir_celery.core.jobs import CallStep, DirectCallUnsupported, job_for_task
from motir_celery.settings import Settings
from tests.conftest import ROOT, celery_worker, count_effects, stop_group, wait_for
from tests.fixtures.browser import free_port

FIXTURE = ROOT / "tests" / "cutover"


def _queue() -> str:
    """This session's queue (set by the broker_url fixture)."""
    return os.environ["MOTIR_QUEUE"]


# --- jobs of this module (the in-process tests) -----------------------------------------

@define_job("test.cutover.sum", bind=False)
def plain_sum(numbers: list[int]) -> int:
    """A Celery task body, unchanged: no step."""
    return sum(numbers)


@define_job("test.cutover.double")
def double(step: Any, x: int) -> Any:
    return {"double": step.run("double", lambda: 2 * x), "run_id": step.run_id}


@define_job("test.cutover.wait")
def wait_a_day(step: Any) -> None:
    step.sleep("nap", 86400)


@define_job("test.cutover.refuse", bind=False, retry_policy="none")
def refuse(order: str) -> None:
    raise ValueError(f"no such order {order}")


# --- helpers -------------------------------------------------------------------------------

def _env(side: str, **extra: str) -> dict[str, str]:
    """A process of the project's ``side`` (before/after): its code first on the path."""
    env = dict(os.environ)
    env.update({"PYTHONPATH": f"{FIXTURE / side}{os.pathsep}{ROOT}", "SHOP_QUEUE": _queue(), "MOTIR_IMPORTS": "",
                **extra})
    return env


def _worker(tmp_path: Path, broker_url: str, side: str, name: str, **extra: str) -> Any:
    env = {k: v for k, v in _env(side, **extra).items() if k in ("PYTHONPATH", "SHOP_QUEUE", "MOTIR_IMPORTS", *extra)}
    return celery_worker(tmp_path, broker=broker_url, app="shop", env=env, name=name, lease=2.0)


def _produce(*args: str, **extra: str) -> dict[str, Any]:
    """Run the plain producer (no motir-celery in it); its JSON line."""
    proc = subprocess.run([sys.executable, str(FIXTURE / "plain_producer.py"), *args], env=_env("before", **extra),
                          cwd=FIXTURE, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    sent: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sent["motir_loaded"] is False  # the producer knows nothing of motir-celery
    return sent


def _celery_call(name: str, args: str) -> str:
    """``celery -A plain_producer call NAME --args=ARGS``: the task id it prints."""
    proc = subprocess.run([sys.executable, "-m", "celery", "-A", "plain_producer", "call", name, f"--args={args}",
                           f"--queue={_queue()}"], env=_env("before"), cwd=FIXTURE, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def _runs(engine: Engine, job_id: str) -> dict[str, Any]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, state, result FROM job_queue WHERE job_id = :j"), {"j": job_id}).all()
    return {str(r.id): r for r in rows}


def _queued(broker_url: str) -> int:
    return int(redis.Redis.from_url(broker_url).llen(_queue()))


@pytest.fixture(autouse=True)
def _empty_queue(broker_url: str) -> Iterator[None]:
    redis.Redis.from_url(broker_url).delete(_queue())
    yield


@pytest.fixture(scope="module")
def after_worker(tmp_path_factory: pytest.TempPathFactory, database_url: str, broker_url: str) -> Iterator[Any]:
    """The project after the cut-over: `celery -A shop worker`, durable jobs attached."""
    with _worker(tmp_path_factory.mktemp("after"), broker_url, "after", "after") as w:
        yield w


# --- names ---------------------------------------------------------------------------------

def test_a_direct_job_keeps_the_name_celery_gives_its_function_and_answers_to_its_alias() -> None:
    from motir_celery import JobDefinitionError

    celery_name = f"{__name__}.plain_sum"   # what @app.task would have named it: module.function
    assert plain_sum.task_name == celery_name
    assert plain_sum.task_names == (celery_name, "motir.test.cutover.sum")
    assert job_for_task("motir.test.cutover.sum") is job_for_task(celery_name) is plain_sum
    app = attach(Celery("names", set_as_current=False))
    assert {celery_name, "motir.test.cutover.sum"} <= set(app.tasks)
    named = define_job("test.cutover.named", name="legacy.tasks.add", bind=False)(lambda x: x)
    assert named.task_names == ("legacy.tasks.add", "motir.test.cutover.named")
    lambda_job = define_job("test.cutover.lambda")(lambda step: None)  # no stable Celery name: the alias
    assert lambda_job.task_name == "motir.test.cutover.lambda"
    # Two jobs cannot claim one task name; the alias space is the jobs' own.
    with pytest.raises(JobDefinitionError, match="already job 'test.cutover.named'"):
        define_job("test.cutover.other", name="legacy.tasks.add")(lambda step: None)
    with pytest.raises(JobDefinitionError, match="aliases"):
        define_job("test.cutover.squat", name="motir.test.cutover.sum")(lambda step: None)


# --- the call surface, without a worker ----------------------------------------------------

def test_a_direct_call_runs_the_body_inline_with_nothing_stored(engine: Engine) -> None:
    assert plain_sum([1, 2, 3]) == 6          # an unchanged Celery body, called as a unit test calls a task
    assert double(21) == {"double": 42, "run_id": None}   # step.run just calls the function
    assert double(CallStep(), 2)["double"] == 4            # a step given first is used as it is
    with pytest.raises(DirectCallUnsupported, match="job.apply"):
        wait_a_day()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM job_queue")).scalar_one() == 0


def test_apply_runs_the_job_now_through_the_engine_without_a_worker(engine: Engine) -> None:
    handle = double.apply(args=[21])
    assert handle.state == "SUCCESS"            # before apply() returned: no worker, no broker
    assert handle.get(timeout=0) == {"double": 42, "run_id": str(handle.id)}
    with engine.connect() as conn:
        steps = conn.execute(text("SELECT step_id, output FROM job_step WHERE run_id = :r"), {"r": handle.id}).all()
        ledger = conn.execute(text("SELECT worker, outcome FROM job_run WHERE run_id = :r"), {"r": handle.id}).all()
    assert [(s.step_id, s.output) for s in steps] == [("double", 42)]
    assert len(ledger) == 1 and ledger[0].outcome == "succeeded" and ledger[0].worker.startswith("inline/")
    task_id = str(uuid.uuid4())
    again = plain_sum.apply(args=[[1, 2]], task_id=task_id)
    assert again.id == uuid.UUID(task_id) and again.get(timeout=0) == 3   # a UUID task_id is the run id
    assert plain_sum.apply(args=[[1, 2]], task_id=task_id).deduplicated


def test_the_handle_is_usable_where_an_async_result_is(engine: Engine) -> None:
    ok = double.apply(args=[1])
    assert (ok.id, ok.state, ok.ready(), ok.successful(), ok.failed()) == (ok.id, "SUCCESS", True, True, False)
    assert ok.result == ok.info == {"double": 2, "run_id": str(ok.id)} and ok.traceback is None
    assert ok.date_done is not None and ok.forget() is None and ok.get(timeout=1, propagate=False)["double"] == 2
    bad = plain_sum.apply(args=[["x"]])  # sum(['x']) raises TypeError: transient policy, retried by a worker later
    assert bad.state == "RETRY" and bad.result is None and not bad.ready()


def test_app_async_result_reads_the_runs_table(engine: Engine, broker_url: str) -> None:
    app = create_app(Settings.from_env())
    assert isinstance(app.backend, MotirBackend) and not isinstance(app.backend, DisabledBackend)
    handle = double.apply(args=[5])
    for result in (app.AsyncResult(str(handle.id)), AsyncResult(str(handle.id), app=app)):
        assert result.state == "SUCCESS" and result.get(timeout=5) == {"double": 10, "run_id": str(handle.id)}
    assert app.AsyncResult(str(uuid.uuid4())).state == "PENDING"   # no such run: as Celery says of an unknown id


def test_an_app_with_its_own_result_backend_keeps_it_and_still_answers_for_runs(broker_url: str) -> None:
    own = broker_url.rsplit("/", 1)[0] + "/15"   # a Redis result backend of the app's own
    app = Celery("own-backend", broker=broker_url, backend=own, set_as_current=False)
    attach(app)
    backend = app.backend
    assert isinstance(backend, RunsFirst) and type(backend).__mro__[2].__name__ == "RunsTable"
    assert "RedisBackend" in {c.__name__ for c in type(backend).__mro__}
    handle = double.apply(args=[4])
    assert app.AsyncResult(str(handle.id)).get(timeout=5)["double"] == 8   # from Postgres
    other = str(uuid.uuid4())
    backend.store_result(other, {"plain": True}, "SUCCESS")                  # a plain task's result: Redis
    assert app.AsyncResult(other).get(timeout=5) == {"plain": True}
    redis.Redis.from_url(own).delete(backend.get_key_for_task(other))


def test_under_motir_publish_alias_a_runs_message_carries_the_alias_routed_as_the_celery_name(
        broker_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rolling cut-over's switch: a worker of the code before still has a plain task under the
    Celery name, and must not get a run id as its argument; the alias is unknown to it."""
    from motir_celery.adapter.messages import engine_of
    from motir_celery.settings import reset_settings

    queue = f"{_queue()}-routed"
    client = redis.Redis.from_url(broker_url)
    monkeypatch.setenv("MOTIR_PUBLISH_ALIAS", "1")
    reset_settings()
    try:
        app = create_app(Settings.from_env())
        app.conf.task_routes = {plain_sum.task_name: {"queue": queue}}
        runs = [uuid.uuid4(), uuid.uuid4()]
        for run in runs:  # the first through send_task, the next the short way (messages.py)
            engine_of(app).publish(run, plain_sum.id, 0.0)
        sent = [json.loads(m) for m in reversed(client.lrange(queue, 0, -1))]
        assert [(m["headers"]["task"], m["headers"]["id"]) for m in sent] == [
            ("motir.test.cutover.sum", str(r)) for r in runs]
    finally:
        client.delete(queue)
        monkeypatch.delenv("MOTIR_PUBLISH_ALIAS")
        reset_settings()


# --- the switch, with real workers ---------------------------------------------------------

def test_every_message_from_a_producer_without_motir_becomes_exactly_one_run_across_the_switch(
        tmp_path: Path, engine: Engine, broker_url: str) -> None:
    """Before: plain Celery runs the task. Then no worker while messages queue up (a protocol-1
    one, a duplicated one, `celery call`). After: the durable job adopts each of them, and each
    the unchanged producer sends next."""
    with _worker(tmp_path, broker_url, "before", "before") as old:
        before = _produce("shop.tasks.add", "[1, 1]", "[2, 2]")["ids"]
        wait_for(lambda: old.output().count("succeeded in") >= 2, what="the plain worker's runs")
    queued = _produce("shop.tasks.add", "[3, 4]", "[5, 6]", "--duplicate")["ids"]   # waiting at the switch
    queued += _produce("shop.tasks.add", "[7, 8]", "--protocol-1")["ids"]
    queued.append(_celery_call("shop.tasks.add", "[20, 22]"))
    assert _queued(broker_url) == len(queued) + 1   # and the duplicate's copy
    with _worker(tmp_path, broker_url, "after", "switched") as new:
        later = _produce("shop.tasks.add", "[9, 10]", "[100, 200]", "--duplicate")["ids"]   # after the switch
        expected = dict(zip(queued + later, [7, 11, 15, 42, 19, 300]))
        wait_for(lambda: set(_runs(engine, "shop.add")) >= set(expected)
                 and all(r.state == "succeeded" for r in _runs(engine, "shop.add").values()),
                 timeout=60, what="every message adopted and run")
        wait_for(lambda: _queued(broker_url) == 0, what="the duplicates consumed too")
        wait_for(lambda: new.output().count("adopted message") >= len(expected) + 2, what="both copies adopted")
    runs = _runs(engine, "shop.add")
    assert set(runs) == set(expected)              # one run per message, its id the task id; none made before
    assert {i: r.result for i, r in runs.items()} == expected
    assert not set(before) & set(runs)
    log = new.output()
    assert "unregistered" not in log and "discarded" not in log and "cannot be adopted" not in log
    assert log.count("(a copy: the run exists already)") == 2   # each duplicated message: the same run


def test_a_message_whose_arguments_cannot_be_stored_is_a_dlq_entry_with_its_reason(
        engine: Engine, broker_url: str, after_worker: Any) -> None:
    from celery import Celery as PlainCelery

    plain = PlainCelery("refuser", broker=broker_url, set_as_current=False)
    sent = plain.send_task("shop.tasks.add", (math.nan, 1), queue=_queue())   # NaN: not JSON, Postgres cannot store it
    with engine.connect() as conn:
        dlq = wait_for(lambda: conn.execute(text(
            "SELECT d.id, d.failure, d.event_data, q.state FROM job_run_dlq d JOIN job_queue q ON q.id = d.run_id "
            "WHERE d.run_id = :r"), {"r": sent.id}).first(), timeout=30, what="the refusal's DLQ entry")
    assert dlq.state == "failed" and "not JSON" in dlq.failure["message"]
    assert dlq.event_data["task_id"] == sent.id and "nan" in dlq.event_data["argsrepr"]
    assert "cannot be adopted" in after_worker.output() and "ERROR" in after_worker.output()
    with pytest.raises(JobFailed, match="not JSON"):
        RunHandle(uuid.UUID(sent.id), "shop.add").get(timeout=5)


def test_kill_9_after_the_adoption_and_before_the_first_step_the_run_completes_once(
        tmp_path: Path, engine: Engine, broker_url: str) -> None:
    # A queue of this test's own: the module's after_worker (when an earlier test started it)
    # must not take the message, or the kill would land on a worker that does not hold the run.
    own = {"MOTIR_QUEUE": f"{_queue()}-kill", "SHOP_QUEUE": f"{_queue()}-kill"}
    with _worker(tmp_path, broker_url, "after", "doomed", **own) as doomed:
        (task_id,) = _produce("shop.tasks.slow_add", "[2, 3]", **own)["ids"]
        wait_for(lambda: _runs(engine, "shop.slow-add").get(task_id) is not None
                 and _runs(engine, "shop.slow-add")[task_id].state == "running", what="the adopted run, claimed")
        assert count_effects(engine, task_id, "add") == 0     # sleeping before its first step
        doomed.kill(signal.SIGKILL)
    with _worker(tmp_path, broker_url, "after", "heir", **own):
        wait_for(lambda: _runs(engine, "shop.slow-add")[task_id].state == "succeeded", timeout=60,
                 what="the run reclaimed and finished")
    run = _runs(engine, "shop.slow-add")
    assert list(run) == [task_id] and run[task_id].result == 5
    assert count_effects(engine, task_id, "add") == 1


@contextmanager
def _beat(tmp_path: Path, name: str, every: float) -> Iterator[Path]:
    log = tmp_path / f"beat-{name}.log"
    cmd = [sys.executable, "-m", "celery", "-A", "shop", "beat", "-l", "DEBUG", "-s", str(tmp_path / f"sched-{name}"),
           "--pidfile", str(tmp_path / f"beat-{name}.pid")]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env("after", SHOP_BEAT_EVERY=str(every)),
                                cwd=ROOT, start_new_session=True)
    try:
        wait_for(lambda: "beat: Starting..." in log.read_text(errors="replace") or proc.poll() is not None,
                 timeout=60, what=f"beat {name}")
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        yield log
    finally:
        stop_group(proc)


def _sent_ids(log: Path) -> list[str]:
    return [line.rsplit("id->", 1)[1].strip() for line in log.read_text(errors="replace").splitlines()
            if "shop.tasks.add sent. id->" in line]


def test_two_beats_with_a_beat_schedule_entry_for_a_durable_job_make_one_run_per_tick(
        tmp_path: Path, engine: Engine, after_worker: Any) -> None:
    with _beat(tmp_path, "a", 1.0) as a, _beat(tmp_path, "b", 1.0) as b:
        wait_for(lambda: len(set(_sent_ids(a)) & set(_sent_ids(b))) >= 3, timeout=30,
                 what="both beats sending the same ticks")
    sent_a, sent_b = _sent_ids(a), _sent_ids(b)
    assert max(Counter(sent_a).values()) == 1 and max(Counter(sent_b).values()) == 1   # one id per tick per beat
    ticks = set(sent_a) | set(sent_b)
    wait_for(lambda: set(_runs(engine, "shop.add")) >= ticks, timeout=30, what="a run for every tick")
    runs = _runs(engine, "shop.add")
    assert set(runs) == ticks and len(runs) < len(sent_a) + len(sent_b)   # two beats' messages, one run a tick
    assert all(r.result == 2 for r in runs.values())


def test_async_result_in_a_fresh_process_and_what_flower_reads(engine: Engine, after_worker: Any) -> None:
    """`app.AsyncResult(id).get()` in a process that only has the project's app; and Flower's
    /api/task/result: AsyncResult(id) on the current app, its backend not Celery's disabled one,
    then state, result and traceback (flower/api/tasks.py, read_result). Flower's task list
    comes from the worker's events: the Celery name, and as result what the job returned."""
    (ok,) = _produce("shop.tasks.add", "[40, 2]")["ids"]
    (failing,) = _produce("shop.tasks.add", "[1]")["ids"]   # add(1): a TypeError (retry_policy "none")
    code = f"""
import json
from celery.backends.base import DisabledBackend
from celery.result import AsyncResult
from shop.celery import app
app.set_current()
out = {{"get": app.AsyncResult({ok!r}).get(timeout=30)}}
for task_id in ({ok!r}, {failing!r}):
    result = AsyncResult(task_id)
    assert not isinstance(result.backend, DisabledBackend)
    result.get(timeout=60, propagate=False)
    out[task_id] = {{"state": result.state, "result": repr(result.result), "traceback": result.traceback}}
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], env=_env("after"), cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["get"] == 42 and out[ok] == {"state": "SUCCESS", "result": "42", "traceback": None}
    assert out[failing]["state"] == "FAILURE" and "TypeError" in out[failing]["result"]
    assert "missing 1 required positional argument" in out[failing]["traceback"]
    assert f"Task shop.tasks.add[{ok}] succeeded in" in after_worker.output()
    assert any(line.rstrip().endswith(": 42") for line in after_worker.output().splitlines() if ok in line)


@contextmanager
def _flower(tmp_path: Path, app: str, database_url: str, broker_url: str, **extra: str) -> Iterator[str]:
    """A real ``celery -A <app> flower`` (the console script of this environment) on a free port,
    as docs/operations.md starts it; its base URL. Its API without auth (FLOWER_UNAUTHENTICATED_API),
    and no events: it must not switch them on in other sessions' workers on this broker."""
    port = free_port()
    log = tmp_path / f"flower-{port}.log"
    env = _env("after", MOTIR_DATABASE_URL=database_url, CELERY_BROKER_URL=broker_url,
               FLOWER_UNAUTHENTICATED_API="true", **extra)
    if "MOTIR_RESULTS_ANY_WORKSPACE" not in extra:
        env.pop("MOTIR_RESULTS_ANY_WORKSPACE", None)
    cmd = [str(Path(sys.executable).with_name("celery")), "-A", app, "flower", "--address=127.0.0.1",
           f"--port={port}", "--enable_events=False", "--persistent=False"]
    base = f"http://127.0.0.1:{port}"

    def listening() -> bool:
        try:
            with urllib.request.urlopen(f"{base}/healthcheck", timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                start_new_session=True)
    try:
        wait_for(lambda: proc.poll() is not None or listening(), timeout=60, what="Flower to listen")
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        yield base
    finally:
        stop_group(proc, grace=10.0)


def _flower_result(base: str, task_id: Any) -> dict[str, Any]:
    """Flower's ``GET /api/task/result/<task id>``."""
    with urllib.request.urlopen(f"{base}/api/task/result/{task_id}", timeout=30) as response:
        assert response.status == 200
        body: dict[str, Any] = json.loads(response.read())
    return body


FLOWER_APPS = [
    pytest.param("shop", id="a-project-app-with-attach"),
    # Flower builds AsyncResult(id) on the *current* app of its main thread (flower/api/tasks.py,
    # TaskResult.get): `motir_celery.app` makes ours current when the CLI loads it.
    pytest.param("motir_celery", id="celery-A-motir_celery"),
]


@pytest.mark.parametrize("app", FLOWER_APPS)
def test_flowers_task_result_for_a_durable_run_is_the_runs(app: str, tmp_path: Path, engine: Engine,
                                                          database_url: str, broker_url: str) -> None:
    """A real Flower's /api/task/result/<run id>: state and result (a failure's error and
    traceback) read from the runs table through the backend ``attach`` installs. Flower has no
    workspace: a tenant's run is PENDING there until the operator opts in with
    MOTIR_RESULTS_ANY_WORKSPACE=1 (docs/operations.md, "Flower and the dashboard")."""
    ok = double.apply(args=[21])
    failed = refuse.apply(args=["42"])
    tenant = double.apply(args=[4], workspace_id="ws-b")
    assert (ok.state, failed.state, tenant.state) == ("SUCCESS", "FAILURE", "SUCCESS")
    unknown = uuid.uuid4()
    with _flower(tmp_path, app, database_url, broker_url) as flower:
        assert _flower_result(flower, ok.id) == {"task-id": str(ok.id), "state": "SUCCESS",
                                                 "result": {"double": 42, "run_id": str(ok.id)}}
        refused = _flower_result(flower, failed.id)
        assert (refused["state"], refused["result"]) == ("FAILURE", "ValueError('no such order 42')"), refused
        assert "ValueError: no such order 42" in refused["traceback"], refused
        assert _flower_result(flower, tenant.id) == {"task-id": str(tenant.id), "state": "PENDING"}
        assert _flower_result(flower, unknown) == {"task-id": str(unknown), "state": "PENDING"}
    with _flower(tmp_path, app, database_url, broker_url, MOTIR_RESULTS_ANY_WORKSPACE="1") as flower:
        assert _flower_result(flower, tenant.id) == {"task-id": str(tenant.id), "state": "SUCCESS",
                                                     "result": {"double": 8, "run_id": str(tenant.id)}}
