"""Subjects (seed 003, issue 47): a run names what it is about (``subject=(type, id)``), an operator
cancels a subject's open runs in one audited statement (``cancel_subject``, ``motir cancel --workspace
--subject``), and a tenant asks whether one is already active for it (``active_for_subject``) under
row-level security. The EXPLAIN tests of both statements are in tests/store/test_schema.py.

In process against real Postgres with the test kit (``kit``: runs are held, not sent to a broker).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import text
from sqlalchemy.engine import Engine

import motir_celery
import tests.fixtures.direct_jobs as dj
from motir_celery.errors import PayloadError
from motir_celery.ops.cli import main
from motir_celery.store.sql import worker as worker_sql
from motir_celery.testing import Motir

A, B = "ws-a", "ws-b"
ACTOR, REASON = "ops@example.com", "media item 42 deleted (ticket 4712)"
ITEM = ("media_item", "42")


def _subject_of(engine: Engine, run_id: Any) -> tuple[Any, Any]:
    with engine.connect() as conn:
        row = conn.execute(text("SELECT subject_type, subject_id FROM job_queue WHERE id = :r"), {"r": run_id}).one()
    return row.subject_type, row.subject_id


def _runs(engine: Engine, workspace: str | None, subject: tuple[str, str] | None, n: int, *, state: str = "queued",
          run_at: str = "now()", wait_event: str | None = None) -> None:
    kind, ident = subject if subject else (None, None)
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO job_queue (job_id, event_name, workspace_id, state, max_attempts, retry_policy, run_at, "
            f"wait_event, finished_at, subject_type, subject_id) SELECT 'test.direct.add', 'direct.test.direct.add', "
            f":ws, :state, 3, 'fast', {run_at}, :wait, CASE WHEN :state = 'succeeded' THEN now() END, :t, :i "
            "FROM generate_series(1, :n)"),
            {"ws": workspace, "n": n, "state": state, "wait": wait_event, "t": kind, "i": ident})


def _states(engine: Engine, workspace: str, subject: tuple[str, str] | None) -> dict[str, int]:
    kind, ident = subject if subject else (None, None)
    with engine.connect() as conn:
        return dict(conn.execute(text(
            "SELECT state, count(*) FROM job_queue WHERE workspace_id = :ws AND subject_type IS NOT DISTINCT FROM :t "
            "AND subject_id IS NOT DISTINCT FROM :i GROUP BY state"), {"ws": workspace, "t": kind, "i": ident}).all())


# --- the producer names it -------------------------------------------------------------------


def test_apply_async_with_a_subject_writes_it_on_the_run_and_the_run_still_runs(kit: Motir) -> None:
    handle = dj.add.apply_async((2, 3), subject=ITEM, workspace_id=A)
    plain = dj.add.delay(1, 1, workspace_id=A)
    assert _subject_of(kit.sql, handle.id) == ITEM
    assert _subject_of(kit.sql, plain.id) == (None, None)   # none named: none stored
    kit.drain()
    assert handle.get(timeout=10)["total"] == 5   # the arguments are the same with a subject beside them


def test_a_tenants_own_transaction_sets_a_subject_through_the_checked_function(kit: Motir) -> None:
    """``session=`` an app-role session under RLS: the write goes through motir_enqueue_direct."""
    with kit.engine.session(A) as session:
        assert session.execute(text("SELECT pg_has_role(current_user, 'motir_engine', 'MEMBER')")).scalar() is False
        handle = dj.add.apply_async((1, 2), subject=("invoice", "inv-2026-001"), workspace_id=A, session=session)
    assert _subject_of(kit.sql, handle.id) == ("invoice", "inv-2026-001")


@pytest.mark.parametrize("subject", [("media item", "42"), ("a:b", "42"), ("x" * 65, "1"), ("media_item", ""),
                                     ("media_item", "x" * 256), ("media_item", 42), ("media_item",), "media_item:42",
                                     ("media_item", "line\nbreak")])
def test_a_bad_subject_is_refused_before_anything_is_written(subject: Any, kit: Motir) -> None:
    with pytest.raises(PayloadError, match="subject"):
        dj.add.apply_async((1, 2), subject=subject, workspace_id=A)
    with kit.sql.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM job_queue")).scalar_one() == 0


# --- "is one already active for this subject" --------------------------------------------------


def test_active_for_subject_lists_the_open_runs_of_the_subject_in_the_tenants_workspace_only(kit: Motir) -> None:
    queued = dj.add.apply_async((1, 2), subject=ITEM, workspace_id=A)
    _runs(kit.sql, A, ITEM, 1, run_at="now() + interval '1 day'", wait_event="test.paid")   # waiting
    _runs(kit.sql, A, ITEM, 2, state="succeeded")          # finished: history, not active
    _runs(kit.sql, A, ("media_item", "43"), 1)             # another subject
    _runs(kit.sql, B, ITEM, 3)                             # the same subject in another workspace
    found = motir_celery.active_for_subject(ITEM, workspace_id=A)
    assert len(found) == 2 and {r.state for r in found} == {"queued"}
    assert found[0].run_id == queued.id and found[0].job_id == "test.direct.add"
    assert found[1].wait_event == "test.paid"
    assert motir_celery.active_for_subject(ITEM, workspace_id=A, limit=1)[0].run_id == queued.id
    assert len(kit.engine.active_for_subject(ITEM, workspace_id=B)) == 3
    assert kit.engine.active_for_subject(("media_item", "44"), workspace_id=A) == []
    kit.drain()                                                            # the queued one ran: no longer active
    assert [r.wait_event for r in motir_celery.active_for_subject(ITEM, workspace_id=A)] == ["test.paid"]


def test_active_for_subject_is_read_under_row_level_security(kit: Motir) -> None:
    """The tenant's read is the app role's: a session of workspace B asking for A's subject sees nothing,
    though A's runs match every predicate the statement has (only the policy hides them)."""
    _runs(kit.sql, A, ITEM, 2)
    with kit.engine.session(A) as session:
        assert len(kit.engine.active_for_subject(ITEM, workspace_id=A, session=session)) == 2
    with kit.engine.session(B) as session:
        assert kit.engine.active_for_subject(ITEM, workspace_id=A, session=session) == []
    with kit.sql.connect() as conn:   # control: the owner, whom the policy does not bind, sees them
        assert conn.execute(text("SELECT count(*) FROM job_queue WHERE workspace_id = :a AND subject_id = '42'"),
                            {"a": A}).scalar_one() == 2


def test_active_for_subject_checks_what_it_is_asked(kit: Motir) -> None:
    with pytest.raises(ValueError, match="subject"):
        motir_celery.active_for_subject("media_item:42", workspace_id=A)   # type: ignore[arg-type]
    with pytest.raises(ValueError, match="limit"):
        motir_celery.active_for_subject(ITEM, workspace_id=A, limit=0)


# --- "cancel everything for this subject" -------------------------------------------------------


def test_cancelling_a_subject_cancels_its_open_runs_in_the_workspace_audited_and_nothing_else(kit: Motir) -> None:
    _runs(kit.sql, A, ITEM, 30)                                                        # pending, due
    _runs(kit.sql, A, ITEM, 5, run_at="now() + interval '1 day'")                      # sleeping
    _runs(kit.sql, A, ITEM, 4, run_at="now() + interval '1 day'", wait_event="test.paid")   # waiting
    _runs(kit.sql, A, ITEM, 6, state="succeeded")                                      # finished: stays
    _runs(kit.sql, A, ("media_item", "43"), 7)                                         # another subject
    _runs(kit.sql, A, None, 8)                                                         # no subject
    _runs(kit.sql, B, ITEM, 9)                                                         # another workspace
    with kit.sql.connect() as conn:   # two of A's runs of the subject are running (claimed by a worker)
        ids = conn.execute(text("SELECT id FROM job_queue WHERE workspace_id = :a AND subject_id = '42' "
                                "AND state = 'queued' AND wait_event IS NULL AND run_at <= now() LIMIT 2"),
                           {"a": A}).scalars().all()
    with kit.engine.pool().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        claims = [worker_sql.claim(conn, r, job_id="test.direct.add", worker="w1", lease_seconds=60,
                                   async_commit=False) for r in ids]
    assert all(claims)

    done = kit.engine.cancel_subject(A, ITEM, actor=ACTOR, reason=REASON)

    assert (done.cancelled, done.running) == (30 + 5 + 4, 2)
    assert _states(kit.sql, A, ITEM) == {"cancelled": 39, "succeeded": 6}
    assert _states(kit.sql, A, ("media_item", "43")) == {"queued": 7}
    assert _states(kit.sql, A, None) == {"queued": 8}
    assert _states(kit.sql, B, ITEM) == {"queued": 9}
    with kit.sql.connect() as conn:
        audit = conn.execute(text(
            "SELECT count(*) FILTER (WHERE cancelled_by = :a AND cancel_reason = :r AND finished_at IS NOT NULL "
            "AND claim_token IS NULL AND wait_event IS NULL), count(*) FROM job_queue WHERE state = 'cancelled'"),
            {"a": ACTOR, "r": REASON}).one()
    assert tuple(audit) == (39, 39)
    with kit.engine.pool().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for claim in claims:   # a running one stops at its next step boundary
            assert not worker_sql.store_step(conn, claim, "next", "1", 0.0)
    assert kit.engine.active_for_subject(ITEM, workspace_id=A) == []
    again = kit.engine.cancel_subject(A, ITEM, actor=ACTOR, reason=REASON)
    assert (again.cancelled, again.running) == (0, 0)


@pytest.mark.parametrize("args", [{"actor": ""}, {"reason": "two\nlines"}, {"subject": ("media_item", "")},
                                  {"subject": "media_item:42"}, {"workspace_id": ""}])
def test_cancelling_a_subject_needs_a_workspace_a_subject_an_actor_and_a_reason(args: dict[str, Any],
                                                                                  kit: Motir) -> None:
    _runs(kit.sql, A, ITEM, 2)
    call: dict[str, Any] = {"workspace_id": A, "subject": ITEM, "actor": ACTOR, "reason": REASON, **args}
    with pytest.raises(ValueError):
        kit.engine.cancel_subject(call.pop("workspace_id"), call.pop("subject"), **call)
    assert _states(kit.sql, A, ITEM) == {"queued": 2}


def test_motir_cancel_workspace_subject_on_the_command_line(kit: Motir) -> None:
    _runs(kit.sql, A, ITEM, 3)
    _runs(kit.sql, A, ("media_item", "43"), 2)
    refused = CliRunner().invoke(main, ["cancel", "--workspace", A, "--subject", "media_item:42"])
    assert refused.exit_code == 2 and "--actor" in refused.output
    bad = CliRunner().invoke(main, ["cancel", "--workspace", A, "--subject", "media_item", "--actor", ACTOR,
                                    "--reason", REASON])
    assert bad.exit_code == 2 and "TYPE:ID" in bad.output
    both = CliRunner().invoke(main, ["cancel", "--workspace", A, "--subject", "media_item:42", "--job", "x",
                                     "--actor", ACTOR, "--reason", REASON])
    assert both.exit_code == 2 and "not both" in both.output
    alone = CliRunner().invoke(main, ["cancel", str(uuid.uuid4()), "--subject", "media_item:42"])
    assert alone.exit_code == 2 and "--workspace" in alone.output
    out = CliRunner().invoke(main, ["cancel", "--workspace", A, "--subject", "media_item:42", "--actor", ACTOR,
                                    "--reason", REASON, "--json"], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert '"cancelled": 3' in out.output and '"subject_id": "42"' in out.output
    assert _states(kit.sql, A, ITEM) == {"cancelled": 3}
    assert _states(kit.sql, A, ("media_item", "43")) == {"queued": 2}


def test_a_replayed_run_keeps_the_subject_of_the_run_that_failed(kit: Motir) -> None:
    failed = dj.refuse.apply_async((), subject=ITEM, workspace_id=A)   # NonRetriableError: straight to the DLQ
    kit.drain()
    (entry,) = kit.dlq()
    replayed = motir_celery.replay_dlq(entry["id"], actor=ACTOR)
    assert replayed.status == "replayed" and replayed.run_id != failed.id
    assert _subject_of(kit.sql, replayed.run_id) == ITEM
    assert [r.run_id for r in kit.engine.active_for_subject(ITEM, workspace_id=A)] == [replayed.run_id]
    assert kit.engine.cancel_subject(A, ITEM, actor=ACTOR, reason=REASON).cancelled == 1   # it is found, too
