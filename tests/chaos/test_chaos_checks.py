"""The invariant checks themselves: a chaos suite whose checks cannot fail proves nothing.

Runs are created through ``send_event`` and then forged into each broken state by
SQL; ``check`` must count every one, and nothing in the healthy control run.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text

import tests.chaos.jobs  # noqa: F401  (the chaos event jobs, for send_event's fan-out)
from tests.chaos.harness import ChaosEnv, check, reset_tables
from tests.chaos.scenarios import SUBSCRIBERS
from tests.fixtures.engines import holding


def _runs(env: ChaosEnv, n: int) -> list[tuple[str, str]]:
    quiet = holding(settings=env.settings())
    out = []
    for i in range(n):
        result = quiet.send_event("chaos.work", {"i": i}, workspace_id="ws-a")
        out += [(str(r.run_id), r.job_id) for r in result.runs]
    return out


def test_check_counts_every_kind_of_violation_and_nothing_else(database_url: str, tmp_path: Path) -> None:
    reset_tables(database_url)
    env = ChaosEnv(database_url, "redis://127.0.0.1:1/0", tmp_path)
    all_runs = _runs(env, 6)
    runs = [r for r, job in all_runs if job == "chaos.work"]
    healthy, twice, after_store, interrupted, queued, failed_no_dlq = runs
    eng = env.engine()

    def attempt(conn, run: str, n: int, outcome: str) -> None:  # type: ignore[no-untyped-def]
        conn.execute(text("INSERT INTO job_run (run_id, attempt, workspace_id, job_id, event_name, worker, outcome,"
                          " started_at, finished_at) VALUES (:r, :n, 'ws-a', 'chaos.work', 'chaos.work', 'w', :o,"
                          " now() - interval '1 minute', now() - interval '50 seconds')"),
                     {"r": run, "n": n, "o": outcome})

    def stored(conn, run: str, step: str, by: int, at: str) -> None:  # type: ignore[no-untyped-def]
        conn.execute(text("INSERT INTO job_step (run_id, step_id, workspace_id, output, attempt, started_at,"
                          " completed_at) VALUES (:r, :s, 'ws-a', '1', :a, now() - interval '1 minute',"
                          " now() - CAST(:at AS interval))"), {"r": run, "s": step, "a": by, "at": at})

    def executed(conn, run: str, step: str, by: int, at: str) -> None:  # type: ignore[no-untyped-def]
        conn.execute(text("INSERT INTO test.side_effect (run_id, step, attempt, pid, at)"
                          " VALUES (:r, :s, :a, 1, now() - CAST(:at AS interval))"),
                     {"r": run, "s": step, "a": by, "at": at})

    with eng.begin() as conn:
        conn.execute(text("UPDATE job_queue SET state = 'succeeded', attempts = 1, finished_at = now()"))
        for run in (healthy, twice, after_store):
            attempt(conn, run, 1, "succeeded")
        for run, job in all_runs:
            if job == "chaos.audit":
                conn.execute(text("INSERT INTO job_run (run_id, attempt, workspace_id, job_id, event_name, worker,"
                                  " outcome) VALUES (:r, 1, 'ws-a', 'chaos.audit', 'chaos.work', 'w', 'succeeded')"),
                             {"r": run})
        executed(conn, healthy, "s0", 1, "30 seconds")
        stored(conn, healthy, "s0", 1, "29 seconds")
        # one attempt executed a body twice
        executed(conn, twice, "s0", 1, "30 seconds")
        executed(conn, twice, "s0", 1, "29 seconds")
        stored(conn, twice, "s0", 1, "28 seconds")
        # a body that started after its result was stored (by another attempt)
        conn.execute(text("UPDATE job_queue SET attempts = 2 WHERE id = :r"), {"r": after_store})
        attempt(conn, after_store, 2, "lost")
        executed(conn, after_store, "s0", 1, "30 seconds")
        stored(conn, after_store, "s0", 1, "29 seconds")
        executed(conn, after_store, "s0", 2, "20 seconds")
        # allowed: interrupted in attempt 1, executed again and stored by attempt 2; attempt 1
        # was frozen between the body's call and its ledger line, which it writes after the store
        conn.execute(text("UPDATE job_queue SET attempts = 2 WHERE id = :r"), {"r": interrupted})
        attempt(conn, interrupted, 1, "lost")
        attempt(conn, interrupted, 2, "succeeded")
        executed(conn, interrupted, "s0", 1, "10 seconds")
        executed(conn, interrupted, "s0", 2, "20 seconds")
        stored(conn, interrupted, "s0", 2, "19 seconds")
        # never finished, with a lease long expired: lost, stuck, and its attempt is a ledger row
        conn.execute(text("UPDATE job_queue SET state = 'running', finished_at = NULL, claim_token = gen_random_uuid(),"
                          " lease_expires_at = now() - interval '1 minute' WHERE id = :r"), {"r": queued})
        attempt(conn, queued, 1, "running")
        # failed, but no DLQ row; and its attempt was left 'running' (half-settled)
        conn.execute(text("UPDATE job_queue SET state = 'failed' WHERE id = :r"), {"r": failed_no_dlq})
        attempt(conn, failed_no_dlq, 1, "running")
        # an (event, job) pair whose run vanished: a run not created is a lost run too
        conn.execute(text("DELETE FROM job_queue WHERE job_id = 'chaos.audit' AND event_id = "
                          "(SELECT event_id FROM job_queue WHERE id = :r)"), {"r": healthy})
    c = check(env, subscribers=SUBSCRIBERS)
    assert c.dup_steps == 2, c  # `twice` (1 beyond) + `after_store` (started after the store)
    assert c.lost == 3, c  # `queued` (not final) + `failed_no_dlq` + the deleted audit run
    assert c.stuck == 1, c
    assert c.half_settled == 1, c  # `failed_no_dlq`'s attempt still running
    assert c.reexecuted_steps == 3, c  # twice, after_store, interrupted
    assert c.cross_tenant == 0 and c.dup_runs == 0


def test_the_cross_tenant_check_sees_a_leak_when_there_is_one(database_url: str, tmp_path: Path,
                                                               monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from motir_celery.store import db
    from tests.chaos.harness import cross_tenant_rows

    reset_tables(database_url)
    env = ChaosEnv(database_url, "redis://127.0.0.1:1/0", tmp_path)
    quiet = holding(settings=env.settings())
    for ws in ("ws-a", "ws-b"):
        quiet.send_event("chaos.work", {}, workspace_id=ws)
    assert cross_tenant_rows(env) == 0
    real = db.workspace_session
    # admin=True is the cross-workspace escape hatch: a reader that (wrongly) had it sees B's rows.
    monkeypatch.setattr(db, "workspace_session", lambda ws, **kw: real(ws, admin=True, **kw))
    assert cross_tenant_rows(env) > 0
