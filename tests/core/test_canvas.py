"""The durable canvas (issue 27), its semantics: chain, group, chord, callbacks, failures, resume, replay, cancel.

In this process against a real Postgres, through the real runner (the test kit: ``motir.drain()``
runs every due run — canvas runs and their members — with the claim, step and settle statements a
worker sends; ``crash_after`` kills an attempt right after a step's record commits). Every member's
side effect is recorded in ``test.side_effect`` by a connection of its own (tests/fixtures/canvas_jobs.py),
so a count is of real executions. Worker kills, broker restarts and the chord of 10,000 on real
workers: tests/adapter/test_canvas_workers.py.
"""

from __future__ import annotations

import asyncio
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import celery
import pytest
from sqlalchemy import text

import tests.fixtures.canvas_jobs as cj
from motir_celery import (
    CanvasNotSupported,
    JobFailed,
    JobRevoked,
    chain,
    chord,
    define_job,
    group,
    resume_dlq,
    signature,
)
from motir_celery.core.producer.canvas import Signature, chunks
from motir_celery.core.shapes import CANVAS_JOB_ID, MAX_DEPTH, CanvasError, member_id
from motir_celery.store.sql import worker as worker_sql
from motir_celery.testing import Motir
from motir_celery.testing.kit import DrainError
from tests.fixtures import kit_workers


@pytest.fixture(autouse=True)
def effects(motir: Motir) -> None:
    """The side-effect ledger of tests/fixtures/jobs.py, in the kit's database, empty."""
    kit_workers.effects(motir)


def effects_of(motir: Motir, step: str) -> list[str]:
    """The run ids whose body recorded ``step``, once per real execution."""
    with motir.sql.connect() as conn:
        return [r for (r,) in conn.execute(text("SELECT run_id FROM test.side_effect WHERE step = :s ORDER BY id"),
                                           {"s": step})]


def members(motir: Motir, canvas_id: Any) -> dict[str, Any]:
    """The runs a canvas run started: step key -> (id, job, state, result)."""
    with motir.sql.connect() as conn:
        found = conn.execute(text("SELECT parent_step_id, id, job_id, state, result FROM job_queue "
                                  "WHERE parent_run_id = :p"), {"p": canvas_id}).all()
    return {r.parent_step_id: r for r in found}


def dlq_of(motir: Motir, job_id: str) -> list[dict[str, Any]]:
    return [e for e in motir.dlq() if e["job_id"] == job_id]


# --- building: Celery's rules, refusals that name what is wrong --------------------------------


def test_pipes_build_what_celerys_build() -> None:
    assert (cj.add.s(1, 2) | cj.add.s(3)).node() == chain(cj.add.s(1, 2), cj.add.s(3)).node()
    assert (cj.add.s(1, 2) | cj.add.s(3) | cj.mul.s(10)).node()["tasks"][2] == {"job": "canvas.mul", "args": [10]}
    # group | task is a chord; a chain ending in a group, piped to a task, turns the group into a chord
    assert (group(cj.add.s(1, 1), cj.add.s(2, 2)) | cj.tsum.s()).node()["canvas"] == "chord"
    upgraded = cj.add.s(1, 1) | group(cj.add.s(1), cj.add.s(2)) | cj.tsum.s()
    assert [t.get("canvas", "task") for t in upgraded.node()["tasks"]] == ["task", "chord"]
    # a chord piped to a task extends its body; a group of one is its member in a chain
    grown = chord([cj.add.s(1, 1)], cj.tsum.s()) | cj.add.s(5)
    assert grown.node()["body"] == {"canvas": "chain", "tasks": [{"job": "canvas.tsum", "args": []},
                                                                  {"job": "canvas.add", "args": [5]}]}
    assert (cj.add.s(1, 1) | group(cj.add.s(2))).node()["tasks"][1] == {"job": "canvas.add", "args": [2]}
    assert (cj.add.s(1, 1) | group()).node() == cj.add.s(1, 1).node()  # an empty group is a no-op
    # Celery's own chain() of durable signatures is this chain (it folds with |)
    assert celery.chain(cj.add.s(1, 2), cj.add.s(3)).node() == chain(cj.add.s(1, 2), cj.add.s(3)).node()
    assert cj.add.si(1, 2).node() == {"job": "canvas.add", "args": [1, 2], "immutable": True}
    assert cj.add.signature((1,), {"y": 2}, countdown=5).node() == {
        "job": "canvas.add", "args": [1], "kwargs": {"y": 2}, "options": {"countdown": 5.0}}


def test_a_plain_celery_task_in_a_canvas_is_refused_naming_it() -> None:
    app = celery.Celery("plain-tests", set_as_current=False)

    @app.task(name="billing.notify")
    def notify(x: Any) -> Any:
        return x

    for build in (lambda: cj.add.s(1) | notify.s(), lambda: notify.s(1) | cj.add.s(),
                  lambda: chain(cj.add.s(1), notify.s()), lambda: group(cj.add.s(1), notify.s()),
                  lambda: chord([notify.s()], cj.tsum.s()), lambda: celery.chain(notify.s(), cj.add.s()),
                  lambda: signature("billing.notify")):
        with pytest.raises(CanvasNotSupported, match="'billing.notify' is a plain Celery task"):
            build()


def test_celerys_own_group_and_chord_say_which_to_use() -> None:
    with pytest.raises(CanvasNotSupported, match="from motir_celery import chain, group, chord"):
        celery.group(cj.add.s(1, 2), cj.add.s(3, 4)).delay()
    with pytest.raises(CanvasNotSupported, match="from motir_celery import chain, group, chord"):
        celery.chord([cj.add.s(1, 2)], cj.tsum.s())


def test_a_celery_signature_of_a_durable_jobs_task_is_that_jobs() -> None:
    by_name = signature(cj.add.task_name, args=(1, 2))
    assert isinstance(by_name, Signature) and by_name.type is cj.add
    as_dict = dict(celery.signature(cj.add.task_name, args=(1,), kwargs={"y": 2}, immutable=True))
    assert (cj.mul.s(3, 4) | as_dict).node()["tasks"][1] == {"job": "canvas.add", "args": [1], "kwargs": {"y": 2},
                                                              "immutable": True}


def test_event_and_cron_jobs_take_no_part_in_a_canvas() -> None:
    @define_job("canvas.tests.on-event", event="canvas.tests.happened")
    def on_event(event: Any, step: Any) -> None:
        return None

    with pytest.raises(CanvasNotSupported, match="is an event job: only direct jobs"):
        on_event.s()


def test_member_options_are_checked_where_built() -> None:
    with pytest.raises(TypeError, match="idempotency_key is the canvas's own"):
        (cj.add.s(1).set(idempotency_key="k") | cj.add.s(2)).node()
    with pytest.raises(ValueError, match="priority must be an integer from 0 to 9"):
        (cj.add.s(1).set(priority=12) | cj.add.s(2)).node()
    with pytest.raises(ValueError, match="a member's task_id is its run id, a UUID"):
        (cj.add.s(1).set(task_id="order-1") | cj.add.s(2)).node()
    with pytest.raises(TypeError, match="unsupported option"):
        chain(cj.add.s(1), cj.add.s(2)).apply_async(expires_soon=1)
    deep: Any = cj.add.s(1)
    for _ in range(MAX_DEPTH + 1):
        deep = group(chain(deep, cj.add.s(1)), cj.add.s(0))
    with pytest.raises(CanvasError, match=f"nested more than {MAX_DEPTH} deep"):
        deep.delay()


def test_a_canvas_queue_and_priority_go_to_every_member_that_names_none() -> None:
    node = chain(cj.add.s(1, 1), cj.add.s(2).set(queue="fast", priority=9)).node({"queue": "slow", "priority": 3})
    assert [t["options"] for t in node["tasks"]] == [{"priority": 3, "queue": "slow"}, {"priority": 9, "queue": "fast"}]
    with pytest.raises(TypeError, match="unsupported option.*expires"):
        chain(cj.add.s(1, 1), cj.add.s(2)).apply_async(expires=60)  # refused by name, never dropped


def test_a_canvas_lives_in_one_workspace(motir: Motir) -> None:
    with pytest.raises(ValueError, match="one workspace; its members name acme, globex"):
        (cj.echo.s(workspace_id="acme") | cj.echo.s(workspace_id="globex")).delay()
    handle = (cj.add.s(1, 2) | cj.add.s(3)).apply_async(workspace_id="acme")
    motir.drain()
    assert handle.get(timeout=0) == 6
    assert {m.state for m in members(motir, handle.id).values()} == {"succeeded"}
    with motir.sql.connect() as conn:
        spaces = conn.execute(text("SELECT DISTINCT workspace_id FROM job_queue")).scalars().all()
    assert spaces == ["acme"]  # the canvas run and every member


# --- durable semantics ---------------------------------------------------------------------------


def test_a_chain_hands_each_result_on_and_si_ignores_it(motir: Motir) -> None:
    handle = (cj.add.s(1, 2) | cj.add.s(3) | cj.mul.s(10) | cj.add.si(100, 1)).delay()
    motir.drain()
    assert handle.get(timeout=0) == 101
    assert [h.get(timeout=0) for h in handle.children] == [3, 6, 60, 101]
    assert handle.parent.get(timeout=0) == 60  # Celery's result.parent: the link before the last
    assert len(effects_of(motir, "add")) == 3 and len(effects_of(motir, "mul")) == 1
    # The canvas run gave its worker back at each link and resumed once per link.
    assert motir.outcomes_of(handle) == ["suspended"] * 4 + ["succeeded"]
    # Partial arguments of delay() go to the first link; the ids the handle names are the members'.
    partial = (cj.add.s(2) | cj.mul.s(3)).delay(5)
    motir.drain()
    assert partial.get(timeout=0) == 21
    assert {str(h.id) for h in partial.children} == {str(m.id) for m in members(motir, partial.id).values()}


def test_a_group_returns_its_members_results_in_order_as_do_map_starmap_and_chunks(motir: Motir) -> None:
    handle = group(cj.add.s(i, 10) for i in range(7)).delay()
    mapped = cj.echo.map([1, 2]).delay()
    starred = cj.add.starmap([(1, 1), (2, 2)]).delay()
    chunked = chunks(cj.add, [(i, i) for i in range(5)], 2).delay()
    motir.drain()
    assert handle.get(timeout=0) == [10, 11, 12, 13, 14, 15, 16]
    assert [r.get(timeout=0) for r in handle.results] == [10, 11, 12, 13, 14, 15, 16]
    assert mapped.get(timeout=0) == [{"args": [1], "kwargs": {}}, {"args": [2], "kwargs": {}}]
    assert starred.get(timeout=0) == [2, 4]
    assert chunked.get(timeout=0) == [[0, 2], [4, 6], [8]]
    assert motir.outcomes_of(handle) == ["suspended", "succeeded"]  # all seven started at once, awaited once


def test_a_chords_body_runs_once_after_its_header_with_the_results_in_order(motir: Motir) -> None:
    handle = chord([cj.add.s(i, i) for i in range(20)], cj.echo.s(tag="body")).delay()
    motir.drain()
    assert handle.get(timeout=0) == {"args": [[2 * i for i in range(20)]], "kwargs": {"tag": "body"}}
    assert len(effects_of(motir, "echo")) == 1 and len(effects_of(motir, "add")) == 20
    started = members(motir, handle.id)
    assert sorted(started) == sorted([f"h[{i}]" for i in range(20)] + ["b.t"])
    assert motir.outcomes_of(handle) == ["suspended", "suspended", "succeeded"]  # no polling: woken twice


def test_nesting_a_chain_in_a_chord_in_a_chain(motir: Motir) -> None:
    inner = chord([cj.add.s(1) | cj.mul.s(2), group(cj.add.s(10), cj.add.s(20)), cj.add.s(100)], cj.echo.s())
    handle = (cj.add.s(1, 1) | inner | cj.echo.s()).delay()
    motir.drain()
    # 2 -> header: (2+1)*2 = 6, the group [12, 22], 102 -> the body's echo -> the last link's echo
    body = {"args": [[6, [12, 22], 102]], "kwargs": {}}
    assert handle.get(timeout=0) == {"args": [body], "kwargs": {}}
    # Sequential nesting is steps of the same canvas run; parallel composites are canvas runs of their own.
    # (A chain ending in a chord, piped to a task, grows the chord's body, as in Celery.)
    top = members(motir, handle.id)
    assert sorted(top) == ["0.t", "1.b.0.t", "1.b.1.t", "1.h[0]", "1.h[1]", "1.h[2]"]
    assert top["1.h[0]"].job_id == top["1.h[1]"].job_id == CANVAS_JOB_ID and top["1.h[2]"].job_id == "canvas.add"
    assert sorted(members(motir, top["1.h[0]"].id)) == ["0.t", "1.t"]
    assert top["1.h[0]"].id == member_id(handle.id, "1.h[0]")


def test_a_canvas_run_killed_after_a_link_was_recorded_starts_nothing_twice(motir: Motir) -> None:
    motir.crash_after("0.t")       # the canvas run dies right after link 0's outcome is recorded
    motir.crash_after("add")       # and link 1's member dies right after its side effect's record
    handle = (cj.add.s(1, 2) | cj.add.s(3) | cj.add.s(4)).delay()
    motir.drain()
    assert handle.get(timeout=0) == 10
    assert len(effects_of(motir, "add")) == 3  # each link's side effect once, through both deaths
    assert "lost" in motir.outcomes_of(handle)
    assert len(members(motir, handle.id)) == 3


def test_each_member_retries_by_its_own_jobs_policy(motir: Motir) -> None:
    handle = chord([cj.flaky.s(i, failures=1) for i in range(3)], cj.tsum.s()).delay()
    motir.drain()
    motir.advance(seconds=1)
    motir.drain()
    assert handle.get(timeout=0) == 3
    assert all(motir.attempts(h) == 2 for h in handle.children[0])
    assert motir.attempts(handle) == 1  # the canvas run was never retried (a suspension charges nothing)


def test_a_failed_link_stops_the_chain_and_calls_link_error_once_with_its_id(motir: Motir) -> None:
    handle = (cj.add.s(1, 2) | cj.boom.s() | cj.add.s(100)).on_error(cj.errback.s(tag=".chain")).delay()
    motir.drain()
    motir.advance(seconds=1)
    motir.drain()
    with pytest.raises(JobFailed) as failed:
        handle.get(timeout=0)
    assert isinstance(failed.value, ValueError) and failed.value.message == "boom 3"  # the member's own error
    started = members(motir, handle.id)
    assert sorted(started) == ["0.t", "1.t", "e0[0]"]  # the third link never started
    boomed = started["1.t"]
    assert effects_of(motir, "errback.chain") == [str(started["e0[0]"].id)]  # once
    assert started["e0[0]"].result == str(boomed.id)  # called with the failed task run's id
    (entry,) = dlq_of(motir, CANVAS_JOB_ID)
    assert entry["failure"]["child"]["run_id"] == str(boomed.id) and entry["failure"]["origin"] == str(boomed.id)


def test_a_failed_header_member_fails_the_chord_with_its_error_and_the_body_never_starts(motir: Motir) -> None:
    header = [cj.add.s(1, 1), cj.refuse.s(message="card declined"), cj.add.s(2, 2), cj.refuse.s(message="later")]
    handle = chord(header, cj.tsum.s()).on_error(cj.errback.s(tag=".chord")).delay()
    grouped = group(cj.refuse.s(1), cj.add.s(1, 1), cj.refuse.s(2)).on_error(cj.errback.s(tag=".group")).delay()
    motir.drain()
    with pytest.raises(JobFailed, match="card declined"):
        handle.get(timeout=0)
    started = members(motir, handle.id)
    assert "b.t" not in started
    assert all(started[f"h[{i}]"].state in ("succeeded", "failed") for i in range(4))  # collect, not fail-fast
    assert len(effects_of(motir, "errback.chord")) == 1
    assert len(effects_of(motir, "errback.group")) == 2  # a group's errback: once per failed member
    with pytest.raises(JobFailed):
        grouped.get(timeout=0)


def test_link_callbacks_get_the_result_and_the_handle_is_the_tasks(motir: Motir) -> None:
    handle = cj.add.apply_async((2, 3), link=[cj.mul.s(10), cj.echo.s()], link_error=cj.errback.s())
    plain = cj.add.apply_async((2, 3), link=None, link_error=None)  # Celery's defaults: a plain direct run
    motir.drain()
    assert handle.get(timeout=0) == 5 and plain.get(timeout=0) == 5
    assert plain.job_id == "canvas.add"
    started = members(motir, handle.id)
    assert started["l[0]"].result == 50 and started["l[1]"].result == {"args": [5], "kwargs": {}}
    assert effects_of(motir, "errback") == []


def test_a_member_countdown_and_priority_and_task_id(motir: Motir) -> None:
    wanted = uuid.uuid4()
    handle = (cj.add.s(1, 1).set(priority=7, task_id=str(wanted)) | cj.add.s(1).set(countdown=3600)).delay()
    motir.drain()
    started = members(motir, handle.id)
    assert started["0.t"].id == wanted and started["1.t"].state == "queued"  # not due for an hour
    with motir.sql.connect() as conn:
        assert conn.execute(text("SELECT priority FROM job_queue WHERE id = :i"), {"i": wanted}).scalar() == 7
    motir.advance(hours=1)
    motir.drain()
    assert handle.get(timeout=0) == 3


def test_an_idempotent_canvas_is_written_once(motir: Motir) -> None:
    first = chain(cj.add.s(1, 1), cj.add.s(1)).apply_async(idempotency_key="order-7")
    again = chain(cj.add.s(1, 1), cj.add.s(1)).apply_async(idempotency_key="order-7")
    assert again.deduplicated and again.id == first.id
    motir.drain()
    assert first.get(timeout=0) == 3 and len(effects_of(motir, "add")) == 2


def test_a_canvas_written_in_a_rolled_back_transaction_never_runs(motir: Motir) -> None:
    from sqlalchemy.orm import Session

    with Session(motir.sql) as session:
        (cj.add.s(1, 1) | cj.add.s(1)).apply_async(session=session)
        session.rollback()
    with Session(motir.sql) as session:
        kept = (cj.add.s(1, 1) | cj.add.s(1)).apply_async(session=session)
        session.commit()
    motir.drain()
    assert kept.get(timeout=0) == 3
    with motir.sql.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM job_queue WHERE job_id = :j"),
                            {"j": CANVAS_JOB_ID}).scalar() == 1


def test_a_canvas_is_started_from_asyncio_code_too(motir: Motir) -> None:
    handle = asyncio.run((cj.add.s(1, 1) | cj.add.s(1)).delay_async())
    motir.drain()
    assert handle.get(timeout=0) == 3


def test_apply_runs_the_whole_canvas_here(motir: Motir) -> None:
    handle = chord([cj.add.s(i, 1) for i in range(3)], cj.tsum.s()).apply()
    assert handle.get(timeout=0) == 6  # no drain: every member ran in this process, through the engine


# --- cancel, resume, replay ------------------------------------------------------------------------


@define_job("canvas.tests.nap")
def nap(step: Any, x: int) -> int:
    step.sleep("nap", 3600)
    return x


def test_cancelling_a_canvas_cancels_what_has_not_run(motir: Motir) -> None:
    handle = (cj.add.s(1, 1) | nap.s() | cj.add.s(1)).delay()
    motir.drain()
    started = members(motir, handle.id)
    assert started["0.t"].state == "succeeded" and started["1.t"].state == "queued"  # napping
    assert handle.revoke()
    assert members(motir, handle.id)["1.t"].state == "cancelled"
    motir.advance(hours=2)
    motir.drain()
    assert "2.t" not in members(motir, handle.id)  # never started
    with pytest.raises(JobRevoked):
        handle.get(timeout=0)


def test_resuming_a_failed_chord_resumes_its_failed_members_and_completes_it(motir: Motir, tmp_path: Path) -> None:
    flag = str(tmp_path / "fixed")
    handle = chord([cj.add.s(1, 1), cj.fixable.s(2, flag), cj.fixable.s(3, flag)], cj.tsum.s()).delay()
    motir.drain()
    assert motir.state(handle) == "failed"
    (canvas_entry,) = dlq_of(motir, CANVAS_JOB_ID)
    assert len(dlq_of(motir, "canvas.fixable")) == 2
    Path(flag).touch()  # the fix is deployed
    result = resume_dlq(canvas_entry["id"], actor="ops")
    assert result.status == "resumed" and len(result.resumed) == 3  # the chord and both failed members
    motir.drain()
    assert handle.get(timeout=0) == 2 + 2 + 3
    assert len(effects_of(motir, "fixable.before")) == 2  # each failed member resumed, not re-run from the start
    assert len(effects_of(motir, "tsum")) == 1 and len(effects_of(motir, "add")) == 1
    with motir.sql.connect() as conn:
        audited = conn.execute(text("SELECT function_id, resumed_by FROM job_run_dlq ORDER BY function_id")).all()
    assert [tuple(r) for r in audited] == [("canvas.fixable", "ops"), ("canvas.fixable", "ops"),
                                           (CANVAS_JOB_ID, "ops")]  # one audit record each


def test_resuming_the_member_that_failed_resumes_its_canvas_too(motir: Motir, tmp_path: Path) -> None:
    flag = str(tmp_path / "fixed")
    inner = chain(cj.add.s(1, 1), cj.fixable.s(flag))  # in a group: a canvas run of its own
    handle = (group(inner, cj.add.s(5, 5)) | cj.echo.s()).delay()
    motir.drain()
    (member_entry,) = dlq_of(motir, "canvas.fixable")
    assert len(dlq_of(motir, CANVAS_JOB_ID)) == 2  # the inner chain's run and the outer chord's
    Path(flag).touch()
    result = resume_dlq(member_entry["id"], actor="ops")
    assert result.status == "resumed" and len(result.resumed) == 3  # climbed to the top
    motir.drain()
    assert handle.get(timeout=0) == {"args": [[2, 10]], "kwargs": {}}


@define_job("canvas.tests.charge", retry_policy="none")
def charge(step: Any, flag: str) -> str:
    """Fails until the file ``flag`` exists."""
    if not Path(flag).exists():
        raise RuntimeError("card declined")
    return flag


@define_job("canvas.tests.invoker", event="canvas.tests.invoke")
def invoker(event: Any, step: Any) -> Any:
    return {"child": step.invoke("charge", charge, event.data["flag"])}


def test_resuming_a_parent_whose_child_succeeded_since_sees_the_success(motir: Motir, tmp_path: Path) -> None:
    flag = str(tmp_path / "fixed")
    (parent,) = motir.handles(motir.send_event("canvas.tests.invoke", {"flag": flag}))
    motir.drain()
    assert motir.state(parent) == "failed"
    (child_entry,) = dlq_of(motir, "canvas.tests.charge")
    (parent_entry,) = dlq_of(motir, "canvas.tests.invoker")
    Path(flag).touch()
    # The child resumed on its own (as the docs suggest) succeeds; it does not wake a failed parent...
    with motir.sql.begin() as conn:
        conn.execute(text("UPDATE job_run_dlq SET resumed_at = now(), resumed_by = 'ops', resumed_run_id = run_id, "
                          "run_id = NULL WHERE id = :i"), {"i": child_entry["id"]})
        conn.execute(text("UPDATE job_queue SET state = 'queued', attempts = 0, run_at = now() WHERE id = "
                          "(SELECT resumed_run_id FROM job_run_dlq WHERE id = :i)"), {"i": child_entry["id"]})
    motir.drain()
    assert motir.state(parent) == "failed"
    # ...and resuming the parent then looks at the child's outcome now: success, not the stored ChildFailed.
    assert resume_dlq(parent_entry["id"], actor="ops").status == "resumed"
    motir.drain()
    assert parent.get(timeout=0) == {"child": flag}
    steps = motir.steps(parent)
    assert "charge" in steps and any(s.startswith("charge:resumed:") for s in steps)  # the failure kept, renamed


def test_resuming_a_parent_whose_child_was_cancelled_says_why_not(motir: Motir) -> None:
    handle = (cj.add.s(1, 1) | nap.s() | cj.add.s(1)).delay()
    motir.drain()
    napping = members(motir, handle.id)["1.t"]
    assert motir.engine.cancel_run(napping.id)
    motir.drain()
    (entry,) = dlq_of(motir, CANVAS_JOB_ID)
    assert entry["failure"]["type"] == "RunCancelled"
    result = resume_dlq(entry["id"], actor="ops")
    assert result.status == "child_not_resumable" and result.run_id == napping.id
    assert "was cancelled" in result.detail and "Replay the parent" in result.detail
    assert motir.state(handle) == "failed"  # nothing changed


def test_replaying_a_canvas_runs_only_its_failed_link_again(motir: Motir, tmp_path: Path) -> None:
    flag = str(tmp_path / "fixed")
    handle = (cj.add.s(1, 1) | cj.fixable.s(flag) | cj.add.s(1)).delay()
    motir.drain()
    (entry,) = dlq_of(motir, CANVAS_JOB_ID)
    Path(flag).touch()
    replayed = motir.engine.replay_dlq(entry["id"], actor="ops")
    assert replayed.status == "replayed" and replayed.run_id != handle.id
    motir.drain()
    again = members(motir, replayed.run_id)
    assert sorted(again) == ["1.t", "2.t"]  # link 0's record was copied: it did not run again
    assert len(effects_of(motir, "add")) == 2
    with motir.sql.connect() as conn:
        assert conn.execute(text("SELECT result FROM job_queue WHERE id = :i"), {"i": replayed.run_id}).scalar() == 3


# --- bounds ---------------------------------------------------------------------------------------


def test_a_body_whose_arguments_would_be_too_large_fails_its_canvas_at_once(motir: Motir) -> None:
    handle = chord([cj.big.s(300_000) for _ in range(4)], cj.tsum.s()).delay()
    motir.drain()
    with pytest.raises(JobFailed, match="over the 1000000-byte limit"):
        handle.get(timeout=0)
    assert motir.attempts(handle) == 1  # not retried: the results would not get smaller
    assert "b.t" not in members(motir, handle.id)


def test_a_group_of_10000_starts_in_ten_statements_and_bounded_memory(motir: Motir, monkeypatch: Any) -> None:
    calls: list[int] = []
    start = worker_sql.start_members

    def counted(conn: Any, claim: Any, batch: Any, **kwargs: Any) -> Any:
        calls.append(len(batch))
        return start(conn, claim, batch, **kwargs)

    monkeypatch.setattr(worker_sql, "start_members", counted)
    handle = chord([cj.big_add.s(i, 1) for i in range(10_000)], cj.big_sum.s()).delay()
    tracemalloc.start()
    with pytest.raises(DrainError):  # the canvas run's first attempt only: it starts the header and suspends
        motir.drain(limit=1)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert calls == [1000] * 10
    assert len(members(motir, handle.id)) == 10_000
    assert motir.outcomes_of(handle) == ["suspended"]
    assert peak < 64 * 2**20, f"the canvas run's attempt peaked at {peak / 2**20:.0f} MiB"
