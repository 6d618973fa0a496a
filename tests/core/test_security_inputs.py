"""Refuse, don't crash (issue 17): what the engine's API must turn away, and operator actions on behalf of a caller.

Each input here once surfaced as a raw database error or was silently accepted;
each refusal is a typed error raised before anything is written. Operator
actions (``core.dlq.*_as``) read the target under the app role in the caller's
workspace context first: another workspace's row is ``not_found`` and is left
untouched; a visible one is changed through the engine, with the caller's name
in the audit columns.
"""

from __future__ import annotations

import logging
import math
import uuid

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

from motir_celery.core.jobs import define_job
from motir_celery.core.operator import dlq
from motir_celery.core.producer.events import MAX_IDEMPOTENCY_KEY
from motir_celery.core.retries import RetryPolicy
from motir_celery.errors import JobDefinitionError, PayloadError
from tests.fixtures.engines import holding, send
from tests.fixtures.ops_helpers import dead_letter, emit


@pytest.mark.parametrize("field", ["backoff", "factor", "max_backoff", "jitter"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_retry_policy_numbers_must_be_finite(field: str, value: float) -> None:
    with pytest.raises(JobDefinitionError, match=field):
        RetryPolicy(**{field: value})  # type: ignore[arg-type]


def test_retry_policy_max_attempts_must_be_a_whole_number() -> None:
    for bad in (2.5, True, math.nan):
        with pytest.raises(JobDefinitionError, match="max_attempts"):
            RetryPolicy(max_attempts=bad)  # type: ignore[arg-type]


def test_a_huge_attempt_number_is_capped_by_max_backoff_not_an_overflow() -> None:
    assert RetryPolicy(backoff=10, factor=10, max_backoff=60, jitter=0).delay(10_000) == 60


@pytest.mark.parametrize("job_id", ["job.a\n", "job.a\n\n", "\njob.a", "job a", ""])
def test_a_job_id_is_matched_whole(job_id: str) -> None:
    with pytest.raises(JobDefinitionError, match="job id"):
        define_job(job_id, event="test.never")(lambda event, step: None)


@pytest.mark.parametrize("key", ["k" * 10_000, "k" * (MAX_IDEMPOTENCY_KEY + 1), "a\x00b", "a\nb", "\ud800", ""])
def test_an_unusable_idempotency_key_is_a_payload_error(key: str, engine: Engine) -> None:
    with pytest.raises(PayloadError, match="idempotency_key"):
        send("test.three", {}, idempotency_key=key)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM job_event")).scalar_one() == 0


def test_the_longest_idempotency_key_is_accepted(engine: Engine) -> None:
    assert not send("test.three", {}, idempotency_key="k" * MAX_IDEMPOTENCY_KEY).deduplicated


@pytest.mark.parametrize("data", [{"a": "\ud800"}, {"a": "x\udfffy"}, ["\ud83d"], {"\udc00": 1}])
def test_a_lone_surrogate_in_event_data_is_a_payload_error(data: object, engine: Engine) -> None:
    with pytest.raises(PayloadError, match="lone surrogate"):
        send("test.three", data)


def test_a_surrogate_pair_is_just_a_character(engine: Engine) -> None:
    send("test.three", {"emoji": "\U0001F600", "text": "\\ud800 is only text here"})
    with engine.connect() as conn:
        assert conn.execute(text("SELECT data->>'emoji' FROM job_event")).scalar_one() == "\U0001F600"


def test_a_reused_idempotency_key_with_different_data_is_flagged_and_logged_and_writes_nothing(
        engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    key = f"order-{uuid.uuid4().hex[:6]}"
    first = send("test.three", {"n": 1, "workspace_id": "ws-a"}, idempotency_key=key)
    same = send("test.three", {"workspace_id": "ws-a", "n": 1}, idempotency_key=key)
    assert same.deduplicated and not same.conflicting and same.event_id == first.event_id  # jsonb equality
    with caplog.at_level(logging.WARNING, logger="motir_celery.core.producer.events"):
        other = send("test.three", {"n": 2, "workspace_id": "ws-a"}, idempotency_key=key)
        # Keys are per workspace (issue 24): ws-b's use of the same key is its own event.
        elsewhere = send("test.three", {"n": 1, "workspace_id": "ws-b"}, idempotency_key=key)
    assert other.deduplicated and other.conflicting and other.event_id == first.event_id and not other.runs
    assert not elsewhere.deduplicated and elsewhere.event_id != first.event_id and elsewhere.runs
    assert sum("already used in workspace" in r.getMessage() for r in caplog.records) == 1
    with engine.connect() as conn:
        assert conn.execute(text("SELECT data->>'n' FROM job_event ORDER BY received_at")).scalars().all() == ["1", "1"]


# --- operator actions on behalf of a caller ----------------------------------------------


def test_operator_actions_on_another_workspaces_rows_are_not_found_and_change_nothing(engine: Engine) -> None:
    _, dlq_id = dead_letter(engine, "ws-a")
    (queued,) = emit("test.three", {"workspace_id": "ws-a"}).values()
    ops = holding()
    bob = dlq.Caller("bob", "ws-b")
    assert dlq.replay_as(ops, bob, dlq_id).status == "not_found"
    assert dlq.dismiss_as(ops, bob, dlq_id) == "not_found"
    assert dlq.cancel_as(ops, bob, queued) == "not_found"
    assert dlq.cancel_as(ops, dlq.Caller("eve", None), queued) == "not_found"  # no workspace, not admin: nothing
    with engine.connect() as conn:
        row = conn.execute(text("SELECT replayed_by, dismissed_by FROM job_run_dlq WHERE id = :d"), {"d": dlq_id}).one()
        state = conn.execute(text("SELECT state FROM job_queue WHERE id = :r"), {"r": queued}).scalar_one()
    assert (row.replayed_by, row.dismissed_by, state) == (None, None, "queued")


def test_operator_actions_on_visible_rows_act_through_the_engine_and_record_the_actor(engine: Engine) -> None:
    _, replayable = dead_letter(engine, "ws-a")
    _, dismissable = dead_letter(engine, "ws-a")
    (queued,) = emit("test.three", {"workspace_id": "ws-a"}).values()
    ops = holding()
    alice = dlq.Caller("alice", "ws-a")
    assert dlq.replay_as(ops, alice, replayable).status == "replayed"
    assert dlq.dismiss_as(ops, alice, dismissable) == "dismissed"
    assert dlq.dismiss_as(ops, alice, dismissable) == "closed"
    assert dlq.cancel_as(ops, dlq.Caller("ops", None, admin=True), queued) == "cancelled"
    with engine.connect() as conn:
        audit: dict[uuid.UUID, str] = dict(conn.execute(text("SELECT id, coalesce(replayed_by, dismissed_by) FROM job_run_dlq")).all())
        assert conn.execute(text("SELECT state FROM job_queue WHERE id = :r"), {"r": queued}).scalar_one() == "cancelled"
    assert audit == {replayable: "alice", dismissable: "alice"}


@pytest.mark.parametrize("actor", ["", "  ", "a\nb", "x" * 201])
def test_an_action_needs_a_printable_actor(actor: str, engine: Engine) -> None:
    with pytest.raises(ValueError, match="actor"):
        dlq.dismiss_dlq(holding(), uuid.uuid4(), actor=actor)


# --- issue 47: a run whose data no worker can decode -------------------------------------------


def _forged_deep_run(engine: Engine, job_id: str, event_name: str) -> uuid.UUID:
    """A run whose event data is nested 5,000 deep, written as the engine role could (the app role's
    checked functions refuse it since migration 0020)."""
    deep = '{"args": [' + "[" * 5000 + "]" * 5000 + "]}"
    with engine.begin() as conn:
        event = conn.execute(text("INSERT INTO job_event (name, data, workspace_id) "
                                  "VALUES (:n, CAST(:d AS jsonb), 'ws-a') RETURNING id"),
                             {"n": event_name, "d": deep}).scalar_one()
        return conn.execute(text(
            "INSERT INTO job_queue (event_id, job_id, event_name, workspace_id, max_attempts, retry_policy) "
            "VALUES (:e, :j, :n, 'ws-a', 3, 'fast') RETURNING id"), {"e": event, "j": job_id, "n": event_name}
        ).scalar_one()


@pytest.mark.parametrize("job_id, event_name", [("test.direct.add", "direct.test.direct.add"),
                                                 ("test.limited", "test.limited")],   # concurrency=: a claim in a transaction
                         ids=["plain claim", "claim under a concurrency limit"])
def test_a_run_whose_data_cannot_be_decoded_fails_at_its_first_claim_into_the_dlq_with_the_reason(
        job_id: str, event_name: str, engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    import tests.fixtures.direct_jobs  # noqa: F401
    import tests.fixtures.jobs  # noqa: F401
    from motir_celery.core.current import current

    run = _forged_deep_run(engine, job_id, event_name)
    with caplog.at_level(logging.ERROR, logger="motir_celery.runner"):
        outcome = current().execute(run, job_id=job_id, worker="w1")
    assert outcome.state == "failed"
    assert "nested too deeply" in caplog.text
    with engine.connect() as conn:
        state = conn.execute(text("SELECT state, lease_expires_at FROM job_queue WHERE id = :r"), {"r": run}).one()
        entry = conn.execute(text("SELECT failure->>'type', failure->>'message', event_data->>'undecodable' "
                                  "FROM job_run_dlq WHERE run_id = :r"), {"r": run}).one()
    assert tuple(state) == ("failed", None)   # not running until its lease expires
    assert entry[0].endswith("NonRetriableError") and "nested too deeply" in entry[1]
    assert "nested deeper than a worker decodes" in entry[2]   # the DLQ row is readable; the data stays in job_event
    assert current().execute(run, job_id=job_id, worker="w2").state == "skipped"   # a redelivery: nothing more
