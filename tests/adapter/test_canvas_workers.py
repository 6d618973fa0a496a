"""The durable canvas on real workers (issue 27): kill -9 in each link, kills in a chord's header, a broker
restart between two links, failures and link_error, a chord of 10,000, and the wake of a canvas whose
member an operator cancelled or the sweeper failed.

Real ``celery worker`` processes (tests/conftest.py) on the session's Redis (a private one where the test
restarts it), against the session's Postgres. Every member's side effect is one ``step.run`` recorded in
``test.side_effect`` by a connection of its own (tests/fixtures/canvas_jobs.py): counts are of real executions.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

import tests.fixtures.canvas_jobs as cj
from motir_celery import JobFailed, cancel_run, chain, chord
from motir_celery.adapter.celery_app import create_app
from motir_celery.adapter.messages import engine_of
from motir_celery.core.current import make_current, peek
from motir_celery.core.shapes import CANVAS_JOB_ID
from motir_celery.dev.private import PrivateRedis
from motir_celery.settings import Settings
from tests.conftest import Worker, celery_worker, count_effects, run_state, wait_for

IMPORTS = "tests.fixtures.jobs,tests.fixtures.canvas_jobs"
#: Short leases, frequent sweeps: a killed worker's run is reclaimed within seconds.
KILLABLE = {"MOTIR_IMPORTS": IMPORTS}


@pytest.fixture
def producer(broker_url: str) -> Iterator[Any]:
    """``.delay()`` publishes through an app of this session's broker and queue (restored after)."""
    before = peek()
    app = create_app(Settings.from_env())  # its engine made current
    try:
        yield app
    finally:
        make_current(before)


def members(engine: Engine, canvas_id: Any) -> dict[str, Any]:
    with engine.connect() as conn:
        found = conn.execute(text("SELECT parent_step_id, id, job_id, state, result, attempts FROM job_queue "
                                  "WHERE parent_run_id = :p"), {"p": canvas_id}).all()
    return {r.parent_step_id: r for r in found}


def effects(engine: Engine, step: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM test.side_effect WHERE step = :s"), {"s": step}).scalar_one())


def effects_around_store(engine: Engine, run_id: Any, step: str) -> tuple[int, int]:
    """A step's recorded executions in attempts before the one that stored it, and from that one on."""
    with engine.connect() as conn:
        row = conn.execute(text(
            "SELECT count(*) FILTER (WHERE e.attempt < s.attempt) AS before, "
            "       count(*) FILTER (WHERE e.attempt >= s.attempt) AS since "
            "FROM test.side_effect e JOIN job_step s ON s.run_id::text = e.run_id AND s.step_id = :s "
            "WHERE e.run_id = :r AND e.step = :s"), {"r": str(run_id), "s": step}).one()
    return int(row.before), int(row.since)


def held(tmp_path: Path, marker: str) -> list[Path]:
    """The ``<marker>.<pid>.running`` files: the attempts that reached the hold."""
    return sorted(tmp_path.glob(f"{marker}.*.running"))


def start(stack: ExitStack, tmp_path: Path, broker: str, n: int, **options: Any) -> Worker:
    options.setdefault("lease", 3.0)
    options.setdefault("sweep_interval", 0.5)
    return stack.enter_context(celery_worker(tmp_path, broker=broker, env=KILLABLE, name=f"w{n}", **options))


def test_a_chain_of_three_survives_a_kill_9_in_the_middle_of_each_link(engine: Engine, broker_url: str,
                                                                      producer: Any, tmp_path: Path) -> None:
    markers = [tmp_path / f"link{i}" for i in range(3)]
    for marker in markers:
        marker.write_text("hold")
    with ExitStack() as stack:
        worker = start(stack, tmp_path, broker_url, 0)
        handle = chain(cj.slow.s(0, marker=str(markers[0])), cj.slow.s(marker=str(markers[1])),
                       cj.slow.s(marker=str(markers[2]))).delay()
        for i, marker in enumerate(markers):
            wait_for(lambda m=marker: held(tmp_path, m.name), timeout=90, what=f"link {i} to be running")
            worker.kill()  # kill -9, the whole process group, in the middle of link i
            marker.unlink()
            worker = start(stack, tmp_path, broker_url, i + 1)
        assert handle.get(timeout=90) == 3
    started = members(engine, handle.id)
    assert sorted(started) == ["0.t", "1.t", "2.t"]
    for key, member in started.items():
        assert count_effects(engine, member.id, "slow") == 1, f"link {key}'s side effect ran more than once"
        assert member.attempts == 2  # the killed attempt, charged, and the one that finished
    assert [len(held(tmp_path, m.name)) for m in markers] == [2, 2, 2]
    assert producer.AsyncResult(str(handle.id)).get(timeout=5) == 3  # AsyncResult(id) of a canvas


def test_a_chord_of_50_survives_two_kills_in_its_header(engine: Engine, broker_url: str, producer: Any,
                                                       tmp_path: Path) -> None:
    with ExitStack() as stack:
        worker = start(stack, tmp_path, broker_url, 0)
        handle = chord([cj.slow.s(i, seconds=0.15) for i in range(50)], cj.echo.s(tag="body")).delay()
        for n, after in enumerate((8, 24)):
            wait_for(lambda a=after: effects(engine, "slow") >= a, timeout=90, what=f"{after} header members")
            worker.kill()
            worker = start(stack, tmp_path, broker_url, n + 1)
        body = handle.get(timeout=120)
    assert body == {"args": [[i + 1 for i in range(50)]], "kwargs": {"tag": "body"}}  # in header order
    assert effects(engine, "echo") == 1  # the body once
    started = members(engine, handle.id)
    assert len(started) == 51
    # A member's step ran once from the attempt that stored it on; an earlier execution is only
    # one a kill cut off between the body's end and its record's commit (the re-run window the
    # contract allows), and each kill can cut off at most one member per pool process (2).
    reruns = 0
    for i in range(50):
        before, since = effects_around_store(engine, started[f"h[{i}]"].id, "slow")
        assert since == 1, f"h[{i}]'s step ran again after its record was stored"
        reruns += before
    assert reruns <= 2 * 2
    assert sum(m.attempts for m in started.values()) > 51  # the kills did land on running members


def test_a_broker_restart_between_two_links_loses_no_link(engine: Engine, tmp_path: Path) -> None:
    redis = PrivateRedis(tmp_path / "redis").start()
    marker = tmp_path / "first"
    marker.write_text("hold")
    before = peek()
    settings = Settings.from_env()
    create_app(dataclasses.replace(settings, broker_url=redis.url))  # its engine made current
    try:
        with celery_worker(tmp_path, broker=redis.url, env=KILLABLE, sweep_interval=0.5):
            handle = chain(cj.slow.s(0, marker=str(marker)), cj.add.s(10), cj.add.s(100)).delay()
            wait_for(lambda: held(tmp_path, marker.name), timeout=60, what="the first link to be running")
            redis.stop()  # no persistence: whatever was queued is gone
            marker.unlink()  # the first link settles while the broker is away; its canvas's message fails
            first = wait_for(lambda: (m := members(engine, handle.id).get("0.t")) is not None
                             and m.state == "succeeded" and m, timeout=60, what="the first link to settle")
            time.sleep(1.0)
            redis.start()
            assert handle.get(timeout=90) == 111
    finally:
        make_current(before)
        redis.close()
    started = members(engine, handle.id)
    assert sorted(started) == ["0.t", "1.t", "2.t"]
    assert count_effects(engine, first.id, "slow") == 1
    assert all(count_effects(engine, m.id, "add") == 1 for k, m in started.items() if k != "0.t")


def test_a_failed_link_calls_link_error_once_and_asyncresult_raises_its_error(engine: Engine, broker_url: str,
                                                                             producer: Any, tmp_path: Path) -> None:
    with celery_worker(tmp_path, broker=broker_url, env=KILLABLE):
        handle = (cj.add.s(1, 2) | cj.boom.s() | cj.add.s(1)).on_error(cj.errback.s(tag=".w")).delay()
        with pytest.raises(JobFailed) as failed:
            handle.get(timeout=60)
        assert isinstance(failed.value, ValueError)
        with pytest.raises(ValueError, match="boom 3"):
            producer.AsyncResult(str(handle.id)).get(timeout=5)
        wait_for(lambda: effects(engine, "errback.w") == 1, timeout=30, what="the errback")
    started = members(engine, handle.id)
    assert sorted(started) == ["0.t", "1.t", "e0[0]"]
    assert started["e0[0]"].result == str(started["1.t"].id)
    assert effects(engine, "errback.w") == 1 and started["1.t"].attempts == 2  # boom's own policy: two attempts


@pytest.mark.scale  # ~2 min of one worker on two cores: make test-scale
@pytest.mark.timeout(900)
def test_a_chord_of_10000_completes(engine: Engine, broker_url: str, producer: Any, tmp_path: Path) -> None:
    n = 10_000
    # A backlog of 10,000 takes minutes on two shared cores: past MOTIR_REPUBLISH_AFTER the sweeper would
    # take the members still waiting for "lost" and send them again (harmless duplicates, refused by
    # the claim, but thousands of them, queued before the canvas's wake-up). Sized as docs/jobs.md says.
    deep = {**KILLABLE, "MOTIR_REPUBLISH_AFTER": "900"}
    with celery_worker(tmp_path, broker=broker_url, env=deep, concurrency=2):
        started = time.monotonic()
        handle = chord([cj.big_add.s(i, i) for i in range(n)], cj.big_sum.s()).delay()
        result = handle.get(timeout=900)
        took = time.monotonic() - started
    print(f"\nchord of {n}: body's result {took:.1f} s after delay()")
    assert result == {"n": n, "sum": sum(2 * i for i in range(n))}
    assert effects(engine, "big_sum") == 1
    with engine.connect() as conn:
        counts = conn.execute(text("SELECT state, count(*) FROM job_queue WHERE parent_run_id = :p GROUP BY state"),
                              {"p": handle.id}).all()
        canvas = conn.execute(text("SELECT outcome FROM job_run WHERE run_id = :r ORDER BY started_at"),
                              {"r": handle.id}).scalars().all()
    assert dict(counts) == {"succeeded": n + 1}
    assert canvas == ["suspended", "suspended", "succeeded"]  # woken once by the header, once by the body


def test_a_canvas_whose_member_is_cancelled_is_woken_at_once(engine: Engine, broker_url: str, producer: Any,
                                                             tmp_path: Path) -> None:
    slow_sweeps = {"MOTIR_IMPORTS": IMPORTS, "MOTIR_REPUBLISH_AFTER": "60"}  # a lost message waits a minute
    with celery_worker(tmp_path, broker=broker_url, env=slow_sweeps, sweep_interval=30):
        handle = (cj.add.s(1, 1) | cj.nap.s() | cj.add.s(1)).delay()
        napping = wait_for(lambda: (m := members(engine, handle.id).get("1.t")) is not None
                           and _ledger(engine, m.id) == ["suspended"] and m, timeout=60, what="the nap")
        cancelled = time.monotonic()
        assert cancel_run(napping.id)
        wait_for(lambda: run_state(engine, handle.id) == "failed", timeout=20, what="the canvas to fail")
        woken_in = time.monotonic() - cancelled
    assert woken_in < 10, f"the canvas learnt of its cancelled member {woken_in:.1f} s later"
    assert "2.t" not in members(engine, handle.id)
    with engine.connect() as conn:
        failure = conn.execute(text("SELECT failure FROM job_run_dlq WHERE run_id = :r"), {"r": handle.id}).scalar()
    assert failure["type"] == "RunCancelled" and failure["child"]["run_id"] == str(napping.id)


def test_a_canvas_whose_member_the_sweeper_fails_is_woken_in_the_same_sweep(engine: Engine, broker_url: str,
                                                                           producer: Any, tmp_path: Path) -> None:
    marker = tmp_path / "fragile"
    marker.write_text("hold")
    slow_sweeps = {"MOTIR_IMPORTS": IMPORTS, "MOTIR_REPUBLISH_AFTER": "60"}
    with ExitStack() as stack:
        worker = stack.enter_context(celery_worker(tmp_path, broker=broker_url, env=slow_sweeps, lease=2.0,
                                                   sweep_interval=0.5, name="a"))
        handle = (cj.add.s(1, 1) | cj.fragile.s(str(marker)) | cj.add.s(1)).delay()
        wait_for(lambda: held(tmp_path, marker.name), timeout=60, what="the fragile link to be running")
        worker.kill()
        killed = time.monotonic()
        marker.unlink()
        stack.enter_context(celery_worker(tmp_path, broker=broker_url, env=slow_sweeps, lease=2.0,
                                          sweep_interval=0.5, name="b"))
        wait_for(lambda: run_state(engine, handle.id) == "failed", timeout=40, what="the canvas to fail")
        woken_in = time.monotonic() - killed
    fragile = members(engine, handle.id)["1.t"]
    assert fragile.state == "failed"  # its one attempt spent by the kill: the sweeper failed it into the DLQ
    assert woken_in < 20, f"the canvas learnt of its failed member {woken_in:.1f} s after the kill"


def _ledger(engine: Engine, run_id: Any) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT outcome FROM job_run WHERE run_id = :r ORDER BY started_at"),
                                 {"r": run_id}).scalars())


def test_the_canvas_job_is_a_task_of_every_worker(engine: Engine, broker_url: str, tmp_path: Path) -> None:
    app = create_app(Settings.from_env())
    assert f"motir.{CANVAS_JOB_ID}" in app.tasks


def test_a_celery_message_carrying_a_chain_or_a_link_is_adopted_with_its_canvas(engine: Engine, broker_url: str,
                                                                               tmp_path: Path) -> None:
    import os

    import celery

    # What a producer of the release before the cut-over sends: Celery's own canvas, by task name.
    old = celery.Celery("old-producer", broker=broker_url, backend="redis://127.0.0.1:6379/1", set_as_current=False)
    old.conf.task_default_queue = os.environ["MOTIR_QUEUE"]
    add, mul, tsum = (old.signature(j.task_name) for j in (cj.add, cj.mul, cj.tsum))
    with celery_worker(tmp_path, broker=broker_url, env=KILLABLE):
        chained = (add.clone(args=(1, 2)) | mul.clone(args=(10,)) | add.clone(args=(5,))).apply_async()
        linked = add.clone(args=(2, 3)).apply_async(link=mul.clone(args=(3,)))
        in_chord = celery.chord([add.clone(args=(i, i)) for i in range(2)])(tsum.clone())
        head = chained.parent.parent.id  # the first message's task id: the canvas run's id
        assert wait_for(lambda: run_state(engine, head) == "succeeded", timeout=60, what="the adopted chain")
        assert wait_for(lambda: run_state(engine, linked.id) == "succeeded", timeout=60, what="the adopted link")
        refused = wait_for(lambda: _refusals(engine), timeout=60, what="the chord members' refusals")
    with engine.connect() as conn:
        canvas = conn.execute(text("SELECT job_id, result FROM job_queue WHERE id = :i"), {"i": head}).one()
    assert tuple(canvas) == (CANVAS_JOB_ID, 35)  # (1+2)*10+5: every link after the first ran
    started = members(engine, head)
    assert sorted(started) == ["0.t", "1.t", "2.t"]
    # The links kept the task ids Celery gave them: AsyncResult of the chain's result reads its last link.
    assert str(started["2.t"].id) == chained.id
    assert create_app(Settings.from_env()).AsyncResult(chained.id).get(timeout=5) == 35
    assert members(engine, linked.id)["l[0]"].result == 15
    assert len(refused) == 2 and all("Celery's chord()" in r for r in refused)  # kept where operators look
    assert in_chord.id  # (its body never runs: Celery's counter is not ours; the refusals say why)


def _refusals(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return [r for (r,) in conn.execute(text("SELECT failure->>'message' FROM job_run_dlq "
                                                "WHERE failure->>'message' LIKE '%chord%'"))]


def test_lost_and_duplicated_messages_start_no_link_twice_and_lose_none(engine: Engine, broker_url: str,
                                                                       producer: Any, tmp_path: Path) -> None:
    import os

    import redis

    marker = tmp_path / "held"
    marker.write_text("hold")
    handle = (cj.slow.s(1, marker=str(marker)) | cj.add.s(10)).delay()
    redis.Redis.from_url(broker_url).delete(os.environ["MOTIR_QUEUE"])  # the canvas run's message, lost
    with celery_worker(tmp_path, broker=broker_url, env=KILLABLE, sweep_interval=0.5):
        # MOTIR_REPUBLISH_AFTER=5 in the workers (conftest): the sweeper sends the canvas run again.
        first = wait_for(lambda: (m := members(engine, handle.id).get("0.t")) is not None and m, timeout=60,
                         what="the lost canvas run to be found and started")
        wait_for(lambda: held(tmp_path, marker.name), timeout=60, what="the first link to be running")
        send = engine_of(producer).publish
        for _ in range(5):  # redelivered / duplicated messages of the canvas run and of its first link
            send(handle.id, CANVAS_JOB_ID, 0.0)
            send(first.id, "canvas.slow", 0.0)
        marker.unlink()
        assert handle.get(timeout=60) == 12
    started = members(engine, handle.id)
    assert sorted(started) == ["0.t", "1.t"]
    assert count_effects(engine, first.id, "slow") == 1 and count_effects(engine, started["1.t"].id, "add") == 1
    assert started["0.t"].attempts == 1 and len(held(tmp_path, marker.name)) == 1  # the duplicates claimed nothing
    assert _ledger(engine, handle.id) == ["suspended", "suspended", "succeeded"]
