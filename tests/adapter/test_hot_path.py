"""The hot path's promise, through a real `celery worker` (issue 16, "What was found").

A step whose record is stored never runs again, and a finished step runs again
only if its worker stopped between its body and its record's commit. Nothing a
handler raises or returns can make its settle fail: the run ends by its retry
policy with the real error stored — never left ``running`` until its lease
expires, never a ``lost`` attempt, never a DLQ entry saying ``LeaseExpired``.
Every test counts real executions of step bodies, in a file ledger the jobs
append to (tests.fixtures.hot_path_jobs.record: fast enough to leave a fast step fast).
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

import tests.fixtures.hot_path_jobs  # noqa: F401  (registers the jobs here too, for send_event)
from motir_celery import send_event
from tests.conftest import celery_worker, wait_for

IMPORTS = "tests.fixtures.jobs,tests.fixtures.hot_path_jobs"
FINAL = ("succeeded", "failed", "cancelled")


# --- helpers -------------------------------------------------------------------


def _env(tmp_path: Path) -> dict[str, str]:
    return {"MOTIR_IMPORTS": IMPORTS, "HOT_PATH_LEDGER": str(_ledger(tmp_path))}


def _ledger(tmp_path: Path) -> Path:
    return tmp_path / "executions.txt"


def _executions(tmp_path: Path, run_id: object, step: str) -> int:
    """How many times a step body really ran for the run, over all its attempts."""
    ledger = _ledger(tmp_path)
    if not ledger.exists():
        return 0
    return sum(1 for line in ledger.read_text().splitlines() if line.split()[:2] == [str(run_id), step])


def _attempts(engine: Engine, run_id: object) -> list[Any]:
    with engine.connect() as conn:
        return conn.execute(text("SELECT attempt, outcome, error FROM job_run WHERE run_id = :r ORDER BY attempt, id"),
                            {"r": run_id}).all()


def _dlq(engine: Engine, run_id: object) -> Any:
    with engine.connect() as conn:
        return conn.execute(text("SELECT failure, attempts FROM job_run_dlq WHERE run_id = :r"), {"r": run_id}).one_or_none()


def _ended(engine: Engine, run_id: object, timeout: float = 20.0) -> str:
    """The run's final state, reached within ``timeout`` (a few short backoffs: a run
    left ``running`` until its lease expires fails here, with what the ledger says)."""
    deadline = time.monotonic() + timeout
    while True:
        with engine.connect() as conn:
            state = conn.execute(text("SELECT state FROM job_queue WHERE id = :r"), {"r": run_id}).scalar()
        if state in FINAL:
            return str(state)
        if time.monotonic() > deadline:
            ledger = [(a.attempt, a.outcome, (a.error or {}).get("type")) for a in _attempts(engine, run_id)]
            raise AssertionError(f"run {run_id} still {state!r} after {timeout}s (its settle was refused and "
                                 f"left to the lease?); attempts: {ledger}")
        time.sleep(0.1)


def _type_name(error: Any) -> str:
    """The exception class's name in a stored error, with or without its module."""
    return str((error or {}).get("type", "")).rsplit(".", 1)[-1]


def _ends_in_the_dlq(engine: Engine, tmp_path: Path, run_id: object, *, attempts: int,
                     error_type: str) -> dict[str, Any]:
    """The run failed for good after ``attempts`` attempts, each ended by its own error
    (never ``lost``), the DLQ entry names that error; the fast step ran once in all."""
    assert _ended(engine, run_id) == "failed"
    ledger = _attempts(engine, run_id)
    expected = ["retrying"] * (attempts - 1) + ["failed"]
    assert [a.outcome for a in ledger] == expected, [(a.outcome, a.error) for a in ledger]
    assert [_type_name(a.error) for a in ledger] == [error_type] * attempts
    entry = _dlq(engine, run_id)
    assert entry is not None, "no DLQ entry"
    assert _type_name(entry.failure) == error_type, entry.failure
    assert entry.attempts == attempts
    assert _executions(tmp_path, run_id, "fast") == 1
    return dict(entry.failure)


def _every_task_done(worker: Any, timeout: float = 30.0) -> None:
    """Every message the worker received has been through its task (Celery's INFO/ERROR line)."""
    def done() -> bool:
        log = worker.output()
        ended = len(re.findall(r"\] (?:succeeded in|raised |retry:)", log))
        return ended >= log.count("] received")
    wait_for(done, timeout=timeout, what="the worker's tasks to end")


@pytest.fixture
def worker(broker_url: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    with celery_worker(tmp_path, broker=broker_url, env=_env(tmp_path)) as w:
        yield w


# --- 1. a settle Postgres would refuse ---------------------------------------------


def test_a_nul_in_an_exception_message_is_stored_and_the_step_before_ran_once(engine, worker, tmp_path):  # type: ignore[no-untyped-def]
    (run_id,) = send_event("hot.nul-message", {}).run_ids
    failure = _ends_in_the_dlq(engine, tmp_path, run_id, attempts=3, error_type="BadNews")  # the retry policy's 3
    assert "\x00" not in failure["message"]
    assert re.search(r"bad.{1,6}news", failure["message"]), failure["message"]  # NUL replaced (U+FFFD), not dropped


def test_a_lone_surrogate_in_a_step_result_is_a_step_output_error_not_retried(engine, worker, tmp_path):  # type: ignore[no-untyped-def]
    (run_id,) = send_event("hot.surrogate-step", {}).run_ids
    _ends_in_the_dlq(engine, tmp_path, run_id, attempts=1, error_type="StepOutputError")
    assert _executions(tmp_path, run_id, "surrogate") == 1
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT step_id FROM job_step WHERE run_id = :r"), {"r": run_id}).scalars().all()
    assert stored == ["fast"]


def test_a_lone_surrogate_in_a_handler_result_is_a_step_output_error_not_retried(engine, worker, tmp_path):  # type: ignore[no-untyped-def]
    (run_id,) = send_event("hot.surrogate-result", {}).run_ids
    _ends_in_the_dlq(engine, tmp_path, run_id, attempts=1, error_type="StepOutputError")


def test_a_10_kb_step_id_is_refused_at_step_run_naming_the_200_character_limit(engine, worker, tmp_path):  # type: ignore[no-untyped-def]
    (run_id,) = send_event("hot.long-step-id", {}).run_ids
    failure = _ends_in_the_dlq(engine, tmp_path, run_id, attempts=1, error_type="StepIdError")
    assert "200" in failure["message"], failure["message"]
    assert len(failure["message"]) < 2_000  # names the limit; does not echo the 10 KB id
    assert _executions(tmp_path, run_id, "long-id") == 0  # refused before its body


@pytest.mark.parametrize("job, shown", [
    ("hot.nan-delay", ("nan",)),
    ("hot.huge-delay", ("1e15", "1e+15", "1000000000000000")),
    ("hot.infinite-rate-limit", ("inf",)),
], ids=["RetryAfterError-nan", "RetryAfterError-1e15", "RateLimited-inf"])
def test_a_delay_postgres_cannot_store_is_a_value_error_where_it_is_raised(engine, worker, tmp_path, job, shown):  # type: ignore[no-untyped-def]
    """The constructor refuses the delay, so the handler raised an ordinary ValueError:
    the retry policy applies (3 attempts) and the stored error names the value."""
    (run_id,) = send_event(job, {}).run_ids
    failure = _ends_in_the_dlq(engine, tmp_path, run_id, attempts=3, error_type="ValueError")
    assert any(s in failure["message"].lower() for s in shown), failure["message"]


def test_a_2000_level_nested_step_result_is_a_step_output_error_not_a_retried_recursion_error(engine, worker, tmp_path):  # type: ignore[no-untyped-def]
    (run_id,) = send_event("hot.deep-result", {}).run_ids
    _ends_in_the_dlq(engine, tmp_path, run_id, attempts=1, error_type="StepOutputError")
    assert _executions(tmp_path, run_id, "deep") == 1


def test_a_10_mb_exception_message_is_stored_and_logged_bounded(engine, broker_url, tmp_path):  # type: ignore[no-untyped-def]
    with celery_worker(tmp_path, broker=broker_url, env=_env(tmp_path)) as worker:
        (run_id,) = send_event("hot.huge-message", {}).run_ids
        failure = _ends_in_the_dlq(engine, tmp_path, run_id, attempts=2, error_type="BadNews")
        _every_task_done(worker)  # the failure's log lines come after its settle's commit
    assert 0 < len(failure["message"]) < 20_000
    assert failure["message"].startswith("xxx")
    for attempt in _attempts(engine, run_id):
        assert len(str(attempt.error)) < 64_000  # message, traceback and all
    # The worker has stopped: its log is complete, every process's lines in.
    longest = max(len(line) for line in worker.output().splitlines())
    assert longest < 20_000, f"a worker log line of {longest} characters"


# --- 2. a body that holds the GIL ---------------------------------------------------


def _regex_length(seconds: float) -> int:
    """n for which _catastrophic(n) takes about ``seconds`` on this machine now
    (each extra character doubles it)."""
    took = []
    for _ in range(2):
        started = time.monotonic()
        re.match(r"(a+)+$", "a" * 23 + "b")
        took.append(time.monotonic() - started)
    return max(25, min(30, 23 + round(math.log2(seconds / max(min(took), 1e-3)))))


@pytest.mark.parametrize("lease", [30, 5])
def test_a_body_holding_the_gil_never_reruns_the_step_before_it(engine, broker_url, tmp_path, lease):  # type: ignore[no-untyped-def]
    """Step one is fast, step two is ~7.5 s of C that never releases the GIL (every
    thread of its process starves, the heartbeat's too). With a 30 s lease the run
    succeeds with each step run once. With a 5 s lease the lease may be lost and the
    GIL-holding step run again (the documented bound), the run may end in the DLQ,
    but the step before it — stored before that body started — runs once."""
    n = _regex_length(7.5)  # longer than the 5 s lease and a sweep
    with celery_worker(tmp_path, broker=broker_url, env=_env(tmp_path), lease=lease):
        (run_id,) = send_event("hot.gil", {"n": n}).run_ids
        state = _ended(engine, run_id, timeout=60)
    assert _executions(tmp_path, run_id, "fast") == 1
    if lease == 30:
        assert state == "succeeded"
        assert [a.outcome for a in _attempts(engine, run_id)] == ["succeeded"]
        assert _executions(tmp_path, run_id, "gil") == 1
    else:
        assert state in ("succeeded", "failed")
        assert 1 <= _executions(tmp_path, run_id, "gil") <= 2  # once per attempt at most (TWO: 2 attempts)
        with engine.connect() as conn:
            fast_attempt = conn.execute(text("SELECT attempt FROM job_step WHERE run_id = :r AND step_id = 'fast'"),
                                        {"r": run_id}).scalar()
        assert fast_attempt == 1  # stored by the first attempt, before the GIL-holding body


# --- 3. concurrency per pool type, default settings ---------------------------------


@pytest.mark.parametrize("pool, concurrency", [("threads", 16), ("prefork", 8), ("solo", 1)])
def test_each_pool_type_drains_200_runs_with_default_settings(engine, broker_url, tmp_path, pool, concurrency):  # type: ignore[no-untyped-def]
    """No pool-size setting: the engine's connections must fit the pool it runs in,
    and the sweeper in the same process must not be starved of one."""
    runs = 200
    run_ids: list[Any] = []
    lock = threading.Lock()

    def send(part: range) -> None:
        for i in part:
            (run_id,) = send_event("hot.pair", {"i": i}).run_ids
            with lock:
                run_ids.append(run_id)

    with celery_worker(tmp_path, broker=broker_url, env=_env(tmp_path), pool=pool, concurrency=concurrency) as w:
        senders = [threading.Thread(target=send, args=(range(k, runs, 4),)) for k in range(4)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        assert len(run_ids) == runs

        def states() -> dict[str, int]:
            with engine.connect() as conn:
                return dict(conn.execute(text("SELECT state, count(*) FROM job_queue WHERE id = ANY(:r) GROUP BY state"),
                                         {"r": run_ids}).all())

        try:
            wait_for(lambda: states().get("succeeded") == runs, timeout=60, interval=0.5, what=f"{runs} runs")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; states {states()}") from None
        output = w.output()
    assert "QueuePool limit" not in output
    assert "sweep failed" not in output
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT count(*) FROM job_step WHERE run_id = ANY(:r)"), {"r": run_ids}).scalar()
        ledger = conn.execute(text("SELECT outcome, count(*) FROM job_run WHERE run_id = ANY(:r) GROUP BY outcome"),
                              {"r": run_ids}).all()
    lines = [line.split()[:2] for line in _ledger(tmp_path).read_text().splitlines()]
    executions = Counter((run_id, step) for run_id, step in lines)
    assert sorted(set(executions.values())) == [1]  # no body ran twice
    assert sorted(executions) == sorted((str(r), s) for r in run_ids for s in ("one", "two"))  # nor none
    assert stored == 2 * runs
    assert [tuple(row) for row in ledger] == [("succeeded", runs)]  # one attempt each
