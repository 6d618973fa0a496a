"""Who goes next (core/admission.py), decided in Postgres: the gate, the dispatcher's choice, quotas.

In-process against the real database: the engine holds its messages (``Held``) so each test sees
exactly which runs were sent and in which order. A run *finishes* here by an UPDATE of its row —
what matters to admission is only that it left the in-flight set — and the dispatcher is then
asked for the next run, as a worker's runner asks it when an attempt ends. The same properties
with real workers and a real broker: tests/adapter/test_fair_share.py.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine as SAEngine
from sqlalchemy.exc import ProgrammingError

import tests.fixtures.jobs  # noqa: F401  (registers the test jobs)
from motir_celery.core import admission
from motir_celery.core.engine import Engine
from motir_celery.settings import get_settings
from motir_celery.store.db import workspace_session
from motir_celery.store.sql import admission as admission_sql
from motir_celery.store.sql import reads as reads_sql
from motir_celery.store.sql import worker as worker_sql
from motir_celery.testing import Held
from tests.fixtures.engines import holding

A, B, C = "ws-a", "ws-b", "ws-c"


def admission_on(engine: SAEngine, limit: int) -> None:
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO job_admission (name, max_in_flight) VALUES ('fleet', :n) "
                          "ON CONFLICT (name) DO UPDATE SET max_in_flight = :n"), {"n": limit})


def quota(engine: SAEngine, ws: str | None, *, weight: int = 1, cap: int | None = None) -> None:
    """An operator's ``motir quota set`` (engine role)."""
    with holding().pool().begin() as tx:
        admission_sql.set_quota(tx, ws, weight=weight, max_running=cap, clear_cap=cap is None, actor="test")


def send(eng: Engine, ws: str | None, n: int = 1, *, priority: int | None = None) -> list[uuid.UUID]:
    return [run_id for _ in range(n)
            for run_id in eng.send_event("test.three", {}, workspace_id=ws, priority=priority).run_ids]


def held(engine: SAEngine) -> set[uuid.UUID]:
    with engine.connect() as conn:
        return set(conn.execute(text("SELECT id FROM job_queue WHERE dispatched_at = 'infinity'")).scalars())


def workspace_of(engine: SAEngine, run_id: uuid.UUID) -> str | None:
    with engine.connect() as conn:
        return conn.execute(text("SELECT workspace_id FROM job_queue WHERE id = :r"), {"r": run_id}).scalar()


def finish(engine: SAEngine, run_id: uuid.UUID) -> None:
    """The run leaves the in-flight set (as a settle does)."""
    with engine.begin() as conn:
        conn.execute(text("UPDATE job_queue SET state = 'succeeded', finished_at = now() WHERE id = :r"),
                     {"r": run_id})


def sent_ids(published: Held) -> list[uuid.UUID]:
    return [run_id for run_id, _, _ in published]


# --- the gate ---------------------------------------------------------------------------------


def test_with_admission_off_every_run_is_published_at_once_and_off_is_learned_once(
        engine: SAEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """No 'fleet' row: the behaviour before admission, and after the first publish of a process no
    statement of admission's at all until OFF_RECHECK_SECONDS have passed."""
    locks: list[int] = []
    real = admission_sql.lock_admission
    monkeypatch.setattr(admission_sql, "lock_admission", lambda conn: locks.append(1) or real(conn))
    published = Held()
    eng = holding(published)
    runs = send(eng, A, 5)
    assert sent_ids(published) == runs and held(engine) == set()
    assert len(locks) == 1      # the first publish read that admission is off; the four after it nothing


def test_under_the_limit_runs_are_published_at_once_over_it_they_are_held_unpublished(engine: SAEngine) -> None:
    admission_on(engine, 3)
    published = Held()
    runs = send(holding(published), A, 5)
    assert sent_ids(published) == runs[:3]
    assert held(engine) == set(runs[3:])


def test_a_held_runs_stale_message_is_refused_by_the_claim_and_it_runs_once_sent(engine: SAEngine) -> None:
    """A duplicate of an older message for a run admission holds claims nothing: the run is sent
    (and claimed) when it is its turn, never twice."""
    admission_on(engine, 1)
    published = Held()
    eng = holding(published)
    first, second = send(eng, A, 2)
    assert held(engine) == {second}
    with eng.pool().begin() as tx:
        stale = worker_sql.claim(tx, second, job_id="test.three-steps", worker="w", lease_seconds=30,
                                 async_commit=False)
    assert stale is None
    finish(engine, first)
    assert eng.admission.dispatch() == 1 and sent_ids(published) == [first, second]
    with eng.pool().begin() as tx:
        claimed = worker_sql.claim(tx, second, job_id="test.three-steps", worker="w", lease_seconds=30,
                                   async_commit=False)
    assert claimed is not None


def test_a_newcomer_waits_behind_the_held_runs_even_when_a_slot_is_free(engine: SAEngine) -> None:
    """The order is the dispatcher's, not arrival: with runs held, a new run is held too, and the
    gate hands the free slot to the first in order at once."""
    admission_on(engine, 2)
    published = Held()
    eng = holding(published)
    a1, a2, a3 = send(eng, A, 3)
    finish(engine, a1)                       # a slot frees; nobody has dispatched yet
    (urgent,) = send(eng, B, priority=9)     # held, then sent at once: more urgent than a3
    assert sent_ids(published) == [a1, a2, urgent]
    assert held(engine) == {a3}


# --- the dispatcher's choice ------------------------------------------------------------------


def test_a_burst_of_one_workspace_does_not_starve_the_next_one(engine: SAEngine) -> None:
    """A sends 40, then B sends 4. Equal weights: while B waits, every other slot that frees is
    B's, so B's 4 are all sent within the next 8 (FIFO: after A's 36 held runs)."""
    admission_on(engine, 4)
    published = Held()
    eng = holding(published)
    a_runs = send(eng, A, 40)
    b_runs = send(eng, B, 4)
    assert set(b_runs) <= held(engine)
    in_flight = list(sent_ids(published))
    for _ in range(8):
        finish(engine, in_flight.pop(0))
        assert eng.admission.dispatch(limit=1) == 1
        in_flight.append(sent_ids(published)[-1])
    assert set(b_runs) <= set(sent_ids(published)), "B's runs waited behind A's backlog"
    assert len(set(a_runs) & set(sent_ids(published))) == 4 + 4


def test_an_urgent_run_sent_after_a_backlog_is_the_next_one_sent(engine: SAEngine) -> None:
    """Priority first, across workspaces: 9 is more urgent than 0 (the one direction, everywhere)."""
    admission_on(engine, 2)
    published = Held()
    eng = holding(published)
    backlog = send(eng, A, 30) + send(eng, B, 30)
    (urgent,) = send(eng, A, priority=9)
    finish(engine, backlog[0])
    eng.admission.dispatch(limit=1)
    assert sent_ids(published)[-1] == urgent


def test_weights_three_to_one_share_the_slots_three_to_one(engine: SAEngine) -> None:
    admission_on(engine, 8)
    quota(engine, A, weight=3)
    quota(engine, B, weight=1)
    published = Held()
    eng = holding(published)
    for _ in range(50):                      # interleaved backlogs, deep enough for 400 choices
        send(eng, A, 10)
        send(eng, B, 10)
    in_flight = list(sent_ids(published))
    counted: Counter[str | None] = Counter()
    for _ in range(400):                     # the oldest in flight finishes; the next is chosen
        finish(engine, in_flight.pop(0))
        assert eng.admission.dispatch(limit=1) == 1
        chosen = sent_ids(published)[-1]
        in_flight.append(chosen)
        counted[workspace_of(engine, chosen)] += 1
    assert counted[A] / counted[B] == pytest.approx(3.0, rel=0.10), counted


def test_a_workspace_at_its_cap_waits_and_raising_the_cap_takes_effect_on_the_next_choice(
        engine: SAEngine) -> None:
    admission_on(engine, 10)
    quota(engine, C, cap=2)
    published = Held()
    eng = holding(published)
    c_runs = send(eng, C, 6)
    assert sent_ids(published) == c_runs[:2] and held(engine) == set(c_runs[2:])
    assert eng.admission.dispatch() == 0     # the fleet has room; C is at its cap
    quota(engine, C, cap=3)                  # live: no deploy, no restart
    assert eng.admission.dispatch() == 1 and sent_ids(published)[-1] == c_runs[2]
    finish(engine, c_runs[0])
    assert eng.admission.dispatch() == 1 and sent_ids(published)[-1] == c_runs[3]


def test_system_runs_are_one_more_workspace(engine: SAEngine) -> None:
    """The system runs (no workspace) share the slots as a workspace of their own: with one of A's
    runs in flight and none of theirs, the slot that frees is theirs, though A's are older."""
    admission_on(engine, 2)
    published = Held()
    eng = holding(published)
    a_runs = send(eng, A, 4)
    system = send(eng, None, 1)
    finish(engine, a_runs[0])
    eng.admission.dispatch(limit=1)
    assert sent_ids(published)[-1] == system[0]


def test_a_run_chosen_whose_publisher_died_is_sent_again_by_the_sweeper(engine: SAEngine) -> None:
    """Nothing lost: the choice commits 'sent' before the message leaves; a process that dies in
    between leaves a queued run whose message is missing, which the sweeper re-publishes."""
    admission_on(engine, 1)
    published = Held()
    settings = replace(get_settings(), republish_after=0.3)
    eng = holding(published, settings)
    first, second = send(eng, A, 2)
    finish(engine, first)
    with eng.pool().begin() as tx:           # the dispatcher's choice, committed; then it dies
        chosen = admission_sql.choose_next(tx, limit=1)
    assert chosen is not None and chosen.run_id == second and second not in sent_ids(published)
    time.sleep(0.5)
    assert eng.sweep().republished == 1
    assert sent_ids(published)[-1] == second


def test_turning_admission_off_sends_every_held_run(engine: SAEngine) -> None:
    admission_on(engine, 1)
    published = Held()
    eng = holding(published)
    runs = send(eng, A, 4)
    with eng.pool().begin() as tx:
        released = admission_sql.admission_off(tx)
    assert {r for r, _ in released} == set(runs[1:]) and held(engine) == set()


# --- quotas as rows, under row-level security --------------------------------------------------


def test_a_tenant_reads_its_own_quota_and_load_and_cannot_write_it(engine: SAEngine, database_url: str) -> None:
    admission_on(engine, 2)
    quota(engine, A, weight=2, cap=1)
    quota(engine, B, weight=5, cap=4)
    eng = holding(Held())
    send(eng, A, 3)
    app = replace(get_settings(), database_url=database_url, app_database_url=None)
    with workspace_session(A, settings=app) as s:
        conn: Any = s.connection()
        status = reads_sql.quota_status(conn, A)
        assert (status["weight"], status["max_running"], status["in_flight"], status["held"]) == (2, 1, 1, 2)
        peek = reads_sql.quota_status(conn, B)       # another tenant's: RLS shows nothing of it
        assert (peek["weight"], peek["max_running"], peek["in_flight"]) == (None, None, 0)
    with pytest.raises(ProgrammingError, match="permission denied"):
        with workspace_session(A, settings=app) as s:
            s.execute(text("UPDATE job_quota SET weight = 1000 WHERE workspace_id = :ws"), {"ws": A})


def test_the_dispatch_batch_is_bounded() -> None:
    assert admission.DISPATCH_BATCH >= 100 and admission.OFF_RECHECK_SECONDS <= 10


def test_a_decision_that_waited_for_the_lock_counts_what_was_sent_while_it_waited(engine: SAEngine) -> None:
    """A gate whose transaction began before another decision committed (as one that waited for
    the lock has) still counts the run that decision sent: "sent" is compared with the decision
    statement's start, not with its transaction's now(), which is earlier than the other's stamp.
    Found by the chaos soak (scenario 12): a workspace capped at 2 had 3 running."""
    admission_on(engine, 10)
    quota(engine, C, cap=2)
    published = Held()
    eng = holding(published)
    c1, c2, c3 = send(eng, C, 3)
    assert sent_ids(published) == [c1, c2] and held(engine) == {c3}
    finish(engine, c1)                                  # C: c2 in flight, c3 held
    with eng.pool().begin() as late:
        admission_sql.fleet(late)                       # this transaction's now() is fixed here
        time.sleep(0.05)
        assert eng.admission.dispatch() == 1            # another decision sends c3: C has 2 in flight
        with engine.begin() as conn:                    # a new run of C, committed, not decided yet
            c4 = conn.execute(text(
                "INSERT INTO job_queue (job_id, event_name, workspace_id, max_attempts, retry_policy) "
                "VALUES ('test.three-steps', 'test.three', :ws, 3, 'transient') RETURNING id"), {"ws": C}).scalar_one()
        assert admission_sql.lock_admission(late) == 10
        decided = admission_sql.admit(late, [c4], limit=10)
    assert [(d.run_id, d.admitted) for d in decided] == [(c4, False)]   # C is at its cap: held
