"""resume_dlq: the same run from its failed step (issue 20).

``cb.fulfil`` stores ``invoice``, then ``charge`` fails until the test "fixes the
cause" (a marker row). Resumed, the run does not invoice again; replayed (a new
run, by design) it does. The runs run in this process on the test kit (``motir``: the
real claim, step and settle statements; ``advance`` skips the retries' backoff); the
operators' actions publish as in production, their messages held by the kit.
"""

from __future__ import annotations

import threading

from click.testing import CliRunner
from sqlalchemy import text

import tests.fixtures.compose_jobs  # noqa: F401
from motir_celery import replay_dlq, resume_dlq, send_event
from motir_celery.adapter.celery_app import create_app
from motir_celery.core.operator.dlq import Caller
from motir_celery.core.operator.resume import resume_as
from motir_celery.ops.cli import main as cli
from motir_celery.settings import Settings
from motir_celery.testing import Motir
from tests.conftest import count_effects, run_state


def _until_quiet(kit: Motir, *, step: float = 1.0, rounds: int = 5) -> None:
    """Drain, skipping ``step`` seconds between rounds (the retries' backoff), until a round runs nothing."""
    for _ in range(rounds):
        kit.drain()
        kit.advance(seconds=step)
    assert kit.drain() == []


def _dlq_id(engine, run_id):  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return conn.execute(text("SELECT id FROM job_run_dlq WHERE run_id = :r"), {"r": run_id}).scalar()


def _fix_the_cause(engine) -> None:  # type: ignore[no-untyped-def]
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO test.side_effect (run_id, step) VALUES ('fixed', 'charge')"))


def _invoices(engine, order):  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return conn.execute(text(
            "SELECT count(*) FROM test.side_effect s JOIN job_queue q ON q.id::text = s.run_id "
            "JOIN job_event e ON e.id = q.event_id WHERE s.step = 'invoice' AND e.data->>'order' = :o"),
            {"o": order}).scalar()


def test_resume_runs_from_the_failed_step_and_replay_from_the_start(kit: Motir) -> None:
    engine = kit.sql
    app = create_app(Settings.from_env())
    runs = {o: send_event("cb.order.paid", {"order": o, "workspace_id": "acme"}, app=app).run_ids[0]
            for o in ("A", "B", "C")}
    _until_quiet(kit)
    for run_id in runs.values():
        assert run_state(engine, run_id) == "failed"  # the charge failed for good
    entries = {o: _dlq_id(engine, r) for o, r in runs.items()}
    assert all(entries.values())
    assert count_effects(engine, runs["A"], "charge") == 2  # both attempts spent

    _fix_the_cause(engine)
    # Two operators resume A at once: the conditional UPDATE queues it once.
    barrier, results = threading.Barrier(2), []

    def resume(actor: str) -> None:
        barrier.wait()
        results.append(resume_dlq(entries["A"], actor=actor, app=app))

    threads = [threading.Thread(target=resume, args=(a,)) for a in ("ann", "bob")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.status for r in results) == ["already_resumed", "resumed"]
    assert all(r.run_id == runs["A"] for r in results)
    kit.drain()
    assert run_state(engine, runs["A"]) == "succeeded"  # the resumed run

    # Another workspace cannot see (nor resume) acme's entry.
    assert resume_as(kit.engine, Caller("eve", "globex"), entries["C"]).status == "not_found"
    # The CLI resumes C; replay of a resumed entry is refused.
    out = CliRunner().invoke(cli, ["dlq", "resume", str(entries["C"]), "--actor", "carol"])
    assert out.exit_code == 0, out.output
    assert "queued again from its failed step" in out.output
    assert replay_dlq(entries["C"], actor="x", app=app).status == "resumed"
    kit.drain()
    assert run_state(engine, runs["C"]) == "succeeded"  # C resumed

    # B is replayed: a new run, which invoices again (by design).
    replayed = replay_dlq(entries["B"], actor="dan", app=app)
    assert replayed.status == "replayed"
    kit.drain()
    assert run_state(engine, replayed.run_id) == "succeeded"  # the replay
    assert resume_dlq(entries["B"], actor="x", app=app).status == "replayed"

    # Resumed: the same run, invoice once, charge a third time, email once.
    assert _invoices(engine, "A") == 1 and _invoices(engine, "C") == 1
    assert count_effects(engine, runs["A"], "charge") == 3
    assert count_effects(engine, runs["A"], "email") == 1
    # Replayed: a second invoice for order B.
    assert _invoices(engine, "B") == 2
    with engine.connect() as conn:
        audit = conn.execute(text("SELECT run_id, resumed_run_id, resumed_by, resumed_at IS NOT NULL AS at "
                                  "FROM job_run_dlq WHERE id = :d"), {"d": entries["A"]}).one()
        run = conn.execute(text("SELECT attempts, max_attempts, result FROM job_queue WHERE id = :r"),
                           {"r": runs["A"]}).one()
        ledger = conn.execute(text("SELECT outcome FROM job_run WHERE run_id = :r ORDER BY started_at"),
                              {"r": runs["A"]}).scalars().all()
    assert audit.run_id is None and audit.resumed_run_id == runs["A"] and audit.at
    assert audit.resumed_by in ("ann", "bob")
    assert (run.attempts, run.max_attempts) == (1, 2)  # a fresh budget: the first attempt after resume
    assert run.result == {"invoice": "inv_1", "charge": "ch_1"}
    assert ledger == ["retrying", "failed", "succeeded"]


def _open(engine, job=None):  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return conn.execute(text(
            "SELECT count(*) FROM job_run_dlq WHERE replayed_at IS NULL AND dismissed_at IS NULL "
            "AND resumed_at IS NULL AND (CAST(:job AS text) IS NULL OR function_id = :job)"), {"job": job}).scalar()


def test_bulk_actions_filter_dry_run_pace_and_audit_each_entry(kit: Motir) -> None:
    import time

    from motir_celery.core.operator.bulk import DlqFilter, bulk_dlq

    engine = kit.sql
    app = create_app(Settings.from_env())
    runs = [send_event("cb.order.paid", {"order": f"a{i}", "workspace_id": "acme"}, app=app).run_ids[0]
            for i in range(8)]
    runs += [send_event("cb.order.paid", {"order": f"g{i}", "workspace_id": "globex"}, app=app).run_ids[0]
             for i in range(3)]
    runs += [send_event("test.doomed", {"workspace_id": "acme"}, app=app).run_ids[0] for _ in range(2)]
    _until_quiet(kit)
    assert _open(engine) == 13  # 13 DLQ entries

    dry = CliRunner().invoke(cli, ["dlq", "resume", "--job", "cb.fulfil", "--since", "2h", "--dry-run",
                                   "--actor", "ops"])
    assert dry.exit_code == 0, dry.output
    assert "dry run: 11 open entries would be resumed" in dry.output
    assert dry.output.count("cb.fulfil") == 5  # a sample of five
    assert _open(engine) == 13  # nothing changed
    refused = CliRunner().invoke(cli, ["dlq", "resume", "--actor", "ops"])
    assert refused.exit_code != 0 and "at least one filter" in refused.output

    _fix_the_cause(engine)
    started = time.monotonic()
    out = CliRunner().invoke(cli, ["dlq", "resume", "--job", "cb.fulfil", "--workspace", "acme",
                                   "--rate", "20/s", "--actor", "ops"])
    elapsed = time.monotonic() - started
    assert out.exit_code == 0, out.output
    assert "8 matched — resumed 8" in out.output
    assert elapsed >= 7 / 20  # paced: 8 entries at 20/s
    kit.drain()
    for run_id in runs[:8]:
        assert run_state(engine, run_id) == "succeeded"  # a resumed run

    dismissed = bulk_dlq(kit.engine, "dismiss", DlqFilter(error="DECLINED"), caller=Caller("ops", None, admin=True))
    assert dismissed.counts == {"dismissed": 3}
    # Through another workspace's eyes, acme's doomed entries do not exist.
    assert bulk_dlq(kit.engine, "replay", DlqFilter(job="test.doomed"), caller=Caller("eve", "globex"),
                    dry_run=True).matched == 0
    replayed = bulk_dlq(kit.engine, "replay", DlqFilter(job="test.doomed"), caller=Caller("ops", "acme"), rate=5)
    assert replayed.counts == {"replayed": 2}
    with engine.connect() as conn:
        audit = conn.execute(text(
            "SELECT coalesce(resumed_by, dismissed_by, replayed_by) AS who, "
            "(resumed_at IS NOT NULL)::int + (dismissed_at IS NOT NULL)::int + (replayed_at IS NOT NULL)::int AS n "
            "FROM job_run_dlq WHERE first_failed_at IS NOT NULL")).all()
    closed = [a for a in audit if a.n]
    assert len(closed) == 13 and all(a.n == 1 and a.who == "ops" for a in closed)  # one audit record per entry
    assert all(_invoices(engine, f"a{i}") == 1 for i in range(8))
