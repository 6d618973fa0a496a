"""Offboarding (issue 47): one call cancels a workspace's whole pending and running work, audited,
and touches no other workspace (core/operator/offboard.py; ``motir cancel --workspace``).

In process against real Postgres, as the engine role's operator action; the running runs are
claimed by the worker's own claim statement, and their next step record is what the cancel fences.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import text
from sqlalchemy.engine import Engine

from motir_celery.core.current import current
from motir_celery.ops.cli import main
from motir_celery.store.sql import worker as worker_sql

A, B = "ws-a", "ws-b"
ACTOR, REASON = "ops@example.com", "contract ended (ticket 4711)"


def _runs(engine: Engine, workspace: str, n: int, *, state: str = "queued", run_at: str = "now()",
          wait_event: str | None = None, job: str = "test.three-steps") -> None:
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO job_queue (job_id, event_name, workspace_id, state, max_attempts, retry_policy, run_at, "
            f"wait_event, finished_at) SELECT :job, 'test.three', :ws, :state, 3, 'fast', {run_at}, :wait, "
            "CASE WHEN :state = 'succeeded' THEN now() END FROM generate_series(1, :n)"),
            {"ws": workspace, "n": n, "state": state, "wait": wait_event, "job": job})


def _claimed(engine: Engine, workspace: str, n: int) -> list[Any]:
    """``n`` runs of ``workspace`` claimed by a worker, as the runner claims them (the claim statement)."""
    _runs(engine, workspace, n, job="test.direct.add")
    with engine.connect() as conn:
        ids = conn.execute(text("SELECT id FROM job_queue WHERE workspace_id = :ws AND job_id = 'test.direct.add' "
                                "AND state = 'queued'"), {"ws": workspace}).scalars().all()
    claims = []
    with current().pool().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for run_id in ids:
            claims.append(worker_sql.claim(conn, run_id, job_id="test.direct.add", worker="w1", lease_seconds=60,
                                           async_commit=False))
    assert all(c is not None for c in claims)
    return claims


def _states(engine: Engine, workspace: str) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(conn.execute(text("SELECT state, count(*) FROM job_queue WHERE workspace_id = :ws "
                                      "GROUP BY state"), {"ws": workspace}).all())


def test_offboarding_a_workspace_cancels_all_its_pending_and_running_work_in_one_call_and_nothing_else(
        engine: Engine) -> None:
    _runs(engine, A, 10_000)                                                     # pending, due
    _runs(engine, A, 50, run_at="now() + interval '1 day'")                      # sleeping (step.sleep, a backoff)
    _runs(engine, A, 30, run_at="now() + interval '1 day'", wait_event="test.paid")   # waiting for an event
    _runs(engine, A, 40, state="succeeded")                                      # finished: stays as it ended
    running = _claimed(engine, A, 20)
    _runs(engine, B, 300)
    _runs(engine, B, 10, run_at="now() + interval '1 day'")
    theirs = _claimed(engine, B, 5)
    b_before = _states(engine, B)

    done = current().cancel_workspace(A, actor=ACTOR, reason=REASON)

    assert (done.cancelled, done.running) == (10_000 + 50 + 30 + 20, 20)
    assert _states(engine, A) == {"cancelled": 10_100, "succeeded": 40}
    assert _states(engine, B) == b_before == {"queued": 310, "running": 5}
    with engine.connect() as conn:
        audit = conn.execute(text(
            "SELECT count(*) FILTER (WHERE cancelled_by = :a AND cancel_reason = :r AND finished_at IS NOT NULL "
            "AND claim_token IS NULL AND lease_expires_at IS NULL AND wait_event IS NULL), count(*) "
            "FROM job_queue WHERE state = 'cancelled'"), {"a": ACTOR, "r": REASON}).one()
        assert tuple(audit) == (10_100, 10_100)   # who and when and why, on every cancelled run, and only there
        assert conn.execute(text("SELECT count(*) FROM job_queue WHERE cancelled_by IS NOT NULL "
                                 "AND workspace_id IS DISTINCT FROM :a"), {"a": A}).scalar_one() == 0
        ledger = dict(conn.execute(text("SELECT workspace_id, outcome FROM job_run")).all())
        assert ledger == {A: "cancelled", B: "running"}
    # A running run stops at its next step boundary: its next record is refused, and says why.
    with current().pool().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for claim in running:
            assert not worker_sql.store_step(conn, claim, "next", "1", 0.0)
            assert worker_sql.why_fenced(conn, claim) == "cancelled"
        for claim in theirs:   # another workspace's running runs go on writing
            assert worker_sql.store_step(conn, claim, "next", "1", 0.0)


def test_offboarding_one_job_of_a_workspace_leaves_its_other_jobs(engine: Engine) -> None:
    _runs(engine, A, 5)
    _runs(engine, A, 3, job="test.slow")
    done = current().cancel_workspace(A, actor=ACTOR, reason=REASON, job="test.slow")
    assert (done.cancelled, done.running) == (3, 0)
    assert _states(engine, A) == {"queued": 5, "cancelled": 3}


@pytest.mark.parametrize("field, value", [("actor", ""), ("actor", "x" * 201), ("reason", " "),
                                          ("reason", "r" * 501), ("reason", "two\nlines"), ("workspace", "")])
def test_offboarding_needs_a_workspace_an_actor_and_a_reason(field: str, value: str, engine: Engine) -> None:
    _runs(engine, A, 2)
    args: dict[str, Any] = {"workspace_id": A, "actor": ACTOR, "reason": REASON, field if field != "workspace"
                            else "workspace_id": value}
    with pytest.raises(ValueError):
        current().cancel_workspace(args.pop("workspace_id"), **args)
    assert _states(engine, A) == {"queued": 2}


def test_motir_cancel_workspace_on_the_command_line(engine: Engine) -> None:
    _runs(engine, A, 4)
    _runs(engine, B, 2)
    refused = CliRunner().invoke(main, ["cancel", "--workspace", A])
    assert refused.exit_code == 2 and "--actor" in refused.output
    both = CliRunner().invoke(main, ["cancel", str(uuid.uuid4()), "--workspace", A, "--actor", ACTOR, "--reason", REASON])
    assert both.exit_code == 2 and "not both" in both.output
    out = CliRunner().invoke(main, ["cancel", "--workspace", A, "--actor", ACTOR, "--reason", REASON, "--json"],
                             catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert '"cancelled": 4' in out.stdout and f'"actor": "{ACTOR}"' in out.stdout
    assert _states(engine, A) == {"cancelled": 4} and _states(engine, B) == {"queued": 2}


# --- export, then erase ------------------------------------------------------------------------

#: Every table that holds a workspace's rows.
TABLES = ("job_event", "job_queue", "job_step", "job_run", "job_run_dlq", "job_batch_item", "job_progress",
          "job_stream_item", "job_stats_rollup")


def _rows_of(engine: Engine, workspace: str) -> dict[str, int]:
    with engine.connect() as conn:
        return {t: conn.execute(text(f"SELECT count(*) FROM {t} WHERE workspace_id = :ws"), {"ws": workspace})
                .scalar_one() for t in TABLES}


def _history(engine: Engine, workspace: str) -> None:
    """A workspace's history in every table: an event with a run, its step, its attempt, a DLQ entry, its
    progress and a stream item, a batch item, a stats rollup row; and a run whose data is nested too deeply."""
    deep = "[" * 5000 + "]" * 5000
    with engine.begin() as conn:
        for data in ('{"k": 1}', deep):
            event = conn.execute(text("INSERT INTO job_event (name, data, workspace_id) VALUES ('test.three', "
                                      "CAST(:d AS jsonb), :ws) RETURNING id"), {"d": data, "ws": workspace}).scalar_one()
            run = conn.execute(text(
                "INSERT INTO job_queue (event_id, job_id, event_name, workspace_id, state, max_attempts, retry_policy, "
                "finished_at) VALUES (:e, 'test.three-steps', 'test.three', :ws, 'failed', 3, 'fast', now()) "
                "RETURNING id"), {"e": event, "ws": workspace}).scalar_one()
            params = {"r": run, "e": event, "ws": workspace}
            conn.execute(text("INSERT INTO job_step (run_id, step_id, output, attempt, started_at, workspace_id) "
                              "VALUES (:r, 'a', '1', 1, now(), :ws)"), params)
            conn.execute(text("INSERT INTO job_run (run_id, attempt, workspace_id, job_id, event_name, worker, outcome) "
                              "VALUES (:r, 1, :ws, 'test.three-steps', 'test.three', 'w', 'failed')"), params)
            conn.execute(text("INSERT INTO job_run_dlq (run_id, workspace_id, function_id, event_id, event_name, "
                              "event_data, failure, attempts, first_failed_at) VALUES (:r, :ws, 'test.three-steps', :e, "
                              "'test.three', '{}', '{}', 1, now())"), params)
            conn.execute(text("INSERT INTO job_batch_item (run_id, position, event_id, workspace_id) "
                              "VALUES (:r, 1, :e, :ws)"), params)
            conn.execute(text("INSERT INTO job_progress (run_id, workspace_id, attempt) VALUES (:r, :ws, 1)"), params)
            conn.execute(text("INSERT INTO job_stream_item (run_id, stream, position, workspace_id, item, bytes, "
                              "attempt) VALUES (:r, 's', 1, :ws, '\"x\"', 3, 1)"), params)
        conn.execute(text("INSERT INTO job_stats_rollup (job_id, workspace_id, bucket, duration_buckets) "
                          "VALUES ('test.three-steps', :ws, NULL, ARRAY[0]::bigint[])"), {"ws": workspace})


def test_a_workspace_cancelled_exported_then_erased_leaves_no_row_of_it_and_an_audit_of_who_when_and_why(
        engine: Engine) -> None:
    import io
    import json

    _history(engine, A)
    _history(engine, B)
    _runs(engine, A, 100)
    b_before = _rows_of(engine, B)
    with pytest.raises(Exception, match="queued or running"):   # WorkspaceActive: cancel first
        current().erase_workspace(A, actor=ACTOR, reason=REASON)
    assert current().cancel_workspace(A, actor=ACTOR, reason=REASON).cancelled == 100
    before = _rows_of(engine, A)
    assert all(before.values()), before   # every table holds rows of it

    out = io.StringIO()
    exported = current().export_workspace(A, out)
    assert exported == before
    lines = out.getvalue().splitlines()
    assert len(lines) == sum(before.values())
    first = json.loads(lines[0])
    assert set(first) == {"table", "row"} and first["row"]["workspace_id"] == A
    assert sum(1 for ln in lines if '"table": "job_event"' in ln and "[[[[" in ln) == 1   # exported undecoded

    erased = current().erase_workspace(A, actor=ACTOR, reason=REASON)
    assert erased.before == before and erased.after == dict.fromkeys(TABLES, 0)
    assert _rows_of(engine, A) == dict.fromkeys(TABLES, 0)   # table by table, as the owner sees them
    assert _rows_of(engine, B) == b_before                   # nothing of another workspace
    with engine.connect() as conn:
        audit = conn.execute(text("SELECT data, workspace_id, received_at <= now() FROM job_event "
                                  "WHERE name = 'motir.workspace.erased'")).one()
    assert audit[0]["erased_workspace"] == A and audit[0]["actor"] == ACTOR and audit[0]["reason"] == REASON
    assert audit[0]["rows"] == before and audit[1] is None and audit[2]   # a system row: who, why, what; when


def test_motir_export_and_erase_on_the_command_line(engine: Engine, tmp_path: Any) -> None:
    import json

    _history(engine, A)
    path = tmp_path / "ws-a.jsonl"
    out = CliRunner().invoke(main, ["export", "--workspace", A, "--output", str(path)], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert len(path.read_text().splitlines()) == sum(_rows_of(engine, A).values())
    missing = CliRunner().invoke(main, ["erase", "--workspace", A, "--actor", ACTOR])
    assert missing.exit_code == 2 and "--reason" in missing.output
    done = CliRunner().invoke(main, ["erase", "--workspace", A, "--actor", ACTOR, "--reason", REASON, "--json"],
                              catch_exceptions=False)
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["left"] == dict.fromkeys(TABLES, 0)
    assert _rows_of(engine, A) == dict.fromkeys(TABLES, 0)
