"""Progress and streams in-process (core/worker/streams.py, core/producer/streams.py), through the test kit.

Every write here is the real fenced statement on the attempt's connection; every read the real read
under the app role in the reader's workspace (the kit's engine reads a tenant's run as a result
handle does). The end-to-end proofs with real workers, another process reading and ``kill -9``
are tests/adapter/test_streams_e2e.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
from typing import Any, Iterator

import pytest
from sqlalchemy import text

from motir_celery import RetryPolicy, define_job
from motir_celery.core.producer.streams import RunNotFound, StreamItem
from motir_celery.core.worker.streams import POSITION_STRIDE
from motir_celery.errors import LostClaim, StreamFull
from motir_celery.testing import Motir

WS = "ws-streams"
AGAIN = RetryPolicy(max_attempts=3, backoff=0.0, factor=1.0, jitter=0.0)

#: What the jobs below do on their first attempt (a test sets it).
first_attempt: dict[str, Any] = {}


@define_job("streams.three-steps", retry_policy=AGAIN)
def three_steps(step: Any, n: int) -> str:
    out = step.stream("tokens")
    out.write("start")                        # outside any step: written again on every attempt

    def body(s: int) -> int:
        for i in range(n):
            out.write(f"{s}-{i}")
            if step.attempt == 1 and first_attempt.get("die_in") == s and i == n // 2:
                raise RuntimeError("the worker dies in the middle of this step")
        return s

    for s in range(3):
        step.run(f"s{s}", body, s)
        step.progress({"done": s + 1, "of": 3})
    out.write("end")
    return "ok"


@define_job("streams.answer", retry_policy=AGAIN)
def answer(step: Any) -> int:
    """A model's answer: the re-run writes other (fewer) tokens than the interrupted run."""
    out = step.stream("tokens")

    def generate() -> int:
        words = "the cat sat on the mat".split() if step.attempt == 1 else "a dog ran".split()
        for w in words:
            out.write(w)
        if step.attempt == 1:
            raise RuntimeError("cut off")
        return len(words)

    return step.run("generate", generate)  # type: ignore[no-any-return]


@define_job("streams.reports", retry_policy=AGAIN)
def reports(step: Any, key: str) -> str:
    step.progress({"done": 1}, state="PROGRESS")
    seen = first_attempt.setdefault(key, [])
    handle = step.engine.progress(step.run_id, workspace_id=WS)
    seen.append((handle.state, handle.meta, handle.current))
    step.run("work", lambda: 1)
    return "done"


@define_job("streams.flood", retry_policy="none")
def flood(step: Any, n: int, size: int) -> int:
    out = step.stream("big")
    for _ in range(n):
        out.write("x" * size)
    return n


@define_job("streams.many-names", retry_policy="none")
def many_names(step: Any, n: int) -> int:
    for i in range(n):
        step.stream(f"s{i}").write(i)
    return n


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    first_attempt.clear()
    yield
    first_attempt.clear()


def values(items: list[StreamItem]) -> list[Any]:
    return [i.value for i in items]


def expected(n: int) -> list[str]:
    return ["start"] + [f"{s}-{i}" for s in range(3) for i in range(n)] + ["end"]


def test_items_come_in_the_order_written_across_steps_and_positions_derive_from_the_step(motir: Motir) -> None:
    handle = motir.apply_async(three_steps, (5,), workspace_id=WS)
    motir.drain()
    assert handle.get() == "ok"
    items = handle.stream("tokens").read()
    assert values(items) == expected(5)
    # segment 0 before the first step; s0's body is segment 1, s1's 3, s2's 5; "end" after the last, 6
    assert [i.position // POSITION_STRIDE for i in items] == [0] + [1] * 5 + [3] * 5 + [5] * 5 + [6]
    assert [i.position for i in items] == sorted(i.position for i in items)
    # from a cursor, from an offset, a page at a time
    assert values(handle.stream("tokens").read(after=items[5].position)) == expected(5)[6:]
    assert values(handle.stream("tokens").read(offset=16)) == ["end"]
    assert values(handle.stream("tokens").read(limit=2)) == ["start", "0-0"]
    progress = handle.progress
    assert progress is not None and progress.streams == ("tokens",) and progress.stream_items == 17
    assert progress.meta == {"done": 3, "of": 3} and not progress.current  # the run has finished


def test_a_step_cut_off_in_its_middle_runs_again_over_the_same_positions_each_item_once(motir: Motir) -> None:
    first_attempt["die_in"] = 1
    handle = motir.apply_async(three_steps, (10,), workspace_id=WS)
    motir.drain()
    assert handle.get() == "ok" and motir.attempts(handle) == 2
    items = handle.stream("tokens").read()
    assert values(items) == expected(10)                       # each exactly once, in order
    attempts = {i.value: i.attempt for i in items}
    assert attempts["0-9"] == 1                                # a completed step's items stay the first run's
    assert attempts["1-0"] == 2 and attempts["start"] == 2     # the re-run's overwrote the same positions
    assert handle.progress is not None and handle.progress.stream_items == len(expected(10))


def test_a_rerun_that_writes_other_items_leaves_only_its_own_to_a_later_reader(motir: Motir) -> None:
    handle = motir.apply_async(answer, (), workspace_id=WS)
    motir.drain()
    assert handle.get() == 3
    assert values(handle.stream("tokens").read()) == ["a", "dog", "ran"]   # "on the mat" trimmed
    assert handle.progress is not None and handle.progress.stream_items == 3


def test_progress_is_the_running_attempts_own_and_shows_as_the_handles_state(motir: Motir) -> None:
    key = uuid.uuid4().hex
    handle = motir.apply_async(reports, (key,), workspace_id=WS)
    motir.drain()
    assert first_attempt[key] == [("PROGRESS", {"done": 1}, True)]
    assert handle.state == "SUCCESS" and handle.result == "done"
    assert handle.progress is not None and handle.progress.state == "PROGRESS" and not handle.progress.current


def test_another_workspaces_reader_gets_nothing_under_the_app_role(motir: Motir) -> None:
    handle = motir.apply_async(three_steps, (2,), workspace_id=WS)
    motir.drain()
    assert len(handle.stream("tokens").read()) == 8
    for workspace in ("ws-other", None):
        with pytest.raises(RunNotFound):
            motir.engine.stream(handle.id, "tokens", workspace_id=workspace).read()  # type: ignore[arg-type]
        assert motir.engine.progress(handle.id, workspace_id=workspace) is None  # type: ignore[arg-type]
    # and the app role itself, in the other workspace, reads no row of either table
    with motir.engine.session("ws-other") as s:
        assert s.execute(text("SELECT count(*) FROM job_stream_item")).scalar() == 0
        assert s.execute(text("SELECT count(*) FROM job_progress")).scalar() == 0
    with motir.engine.session(WS) as s:
        assert s.execute(text("SELECT count(*) FROM job_stream_item")).scalar() == 8


def test_a_follower_gets_every_item_then_ends_with_the_run(motir: Motir) -> None:
    handle = motir.apply_async(three_steps, (50,), workspace_id=WS)
    got: list[Any] = []
    follower = threading.Thread(target=lambda: got.extend(values(list(handle.stream("tokens").follow(timeout=30)))))
    follower.start()
    motir.drain()
    follower.join(30)
    assert not follower.is_alive() and got == expected(50)

    async def follow_async() -> list[Any]:
        return [i.value async for i in handle.stream("tokens").afollow(timeout=30)]

    assert asyncio.run(follow_async()) == expected(50)


def test_a_follower_of_a_run_that_does_not_end_gets_a_timeout_error_sync_and_async(motir: Motir) -> None:
    handle = motir.apply_async(three_steps, (1,), workspace_id=WS)        # queued: never drained here
    with pytest.raises(TimeoutError, match="not ended after 0.3s"):
        list(handle.stream("tokens").follow(timeout=0.3))

    async def follow_async() -> list[StreamItem]:
        return [i async for i in handle.stream("tokens").afollow(timeout=0.3)]

    with pytest.raises(TimeoutError, match="not ended after 0.3s"):
        asyncio.run(follow_async())


@pytest.fixture
def small_kit(motir_database_url: str) -> Iterator[Motir]:
    from motir_celery.settings import Settings

    kit = Motir(settings=dataclasses.replace(Settings.from_env(), max_stream_bytes=10_000))
    kit.reset()
    kit.install()
    try:
        yield kit
    finally:
        kit.uninstall()


def test_a_run_past_its_streams_bound_gets_stream_full_and_nothing_of_that_write_is_stored(small_kit: Motir) -> None:
    ok = small_kit.apply_async(flood, (10, 100), workspace_id=WS)            # 10 x (102 + 64) bytes
    over = small_kit.apply_async(flood, (100, 100), workspace_id=WS)         # 100 x 166 > 10,000
    names = small_kit.apply_async(many_names, (101,), workspace_id=WS)
    small_kit.drain()
    assert ok.get() == 10
    failed = small_kit.dlq()
    errors = {str(d["run_id"]): d["failure"] for d in failed}
    assert "MOTIR_MAX_STREAM_BYTES=10000" in errors[str(over.id)]["message"]
    assert errors[str(over.id)]["type"] == "motir_celery.errors.StreamFull"
    assert len(over.stream("big").read()) == 10_000 // 166                  # up to the bound, not past it
    assert "100 stream names" in errors[str(names.id)]["message"]
    assert issubclass(StreamFull, Exception)


def test_a_write_after_the_run_was_lost_is_refused(motir: Motir) -> None:
    @define_job("streams.lost-midway", retry_policy="none")
    def lost_midway(step: Any) -> None:
        step.stream("s").write(1)
        with motir.sql.begin() as conn:  # another worker reclaims it meanwhile
            conn.execute(text("UPDATE job_queue SET claim_token = gen_random_uuid() WHERE id = :r"),
                         {"r": step.run_id})
        try:
            step.stream("s").write(2)
        except LostClaim as exc:
            first_attempt["refused"] = str(exc)
            raise
        try:
            step.progress({"never": True})
        except LostClaim:
            pass

    handle = motir.apply_async(lost_midway, (), workspace_id=WS)
    motir.drain()
    assert "lost its claim" in first_attempt["refused"]
    assert values(handle.stream("s").read()) == [1]
