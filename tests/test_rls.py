"""Tenants cannot see each other (DESIGN.md invariant 8), proven under the app role.

The rows are written through the owner connection (the test login, which RLS
does not filter) and counted there first, so "zero rows" under the app role
means the policy hid them, not that they were never written. Reads and writes
then go through ``workspace_session``, which drops to ``motir_app`` for the
transaction; a test checks that this really happens.
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import replace
from typing import Iterator

import psycopg.errors
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import ProgrammingError

from motir_celery.store.db import set_workspace_context, workspace_session
from motir_celery.store.rls import APP_ROLE
from motir_celery.settings import Settings, get_settings

RLS_TABLES = ("job_event", "job_queue", "job_step", "job_run", "job_run_dlq")
A, B = "ws-a", "ws-b"


@pytest.fixture
def app_settings(database_url: str) -> Settings:
    # Same login as the engine, no app URL: workspace_session must SET LOCAL ROLE motir_app.
    return replace(get_settings(), database_url=database_url, app_database_url=None)


def _seed_workspace(conn: Connection, ws: str | None) -> uuid.UUID:
    """One row in each RLS table, all for workspace ``ws`` (None: a system row)."""
    event_id = conn.execute(
        text("INSERT INTO job_event (name, data, workspace_id) VALUES ('test.event', '{}'::jsonb, :ws) RETURNING id"),
        {"ws": ws},
    ).scalar_one()
    run_id = conn.execute(
        text(
            "INSERT INTO job_queue (job_id, event_id, event_name, workspace_id, max_attempts, retry_policy) "
            "VALUES ('job.a', :ev, 'test.event', :ws, 3, 'transient') RETURNING id"
        ),
        {"ev": event_id, "ws": ws},
    ).scalar_one()
    params = {"r": run_id, "ws": ws}
    conn.execute(text("INSERT INTO job_step (run_id, step_id, workspace_id, output, attempt, started_at) "
                      "VALUES (:r, 's1', :ws, '1'::jsonb, 1, now())"), params)
    conn.execute(text("INSERT INTO job_run (run_id, attempt, workspace_id, job_id, event_name, worker) "
                      "VALUES (:r, 1, :ws, 'job.a', 'test.event', 'w1')"), params)
    conn.execute(text("INSERT INTO job_run_dlq (run_id, workspace_id, function_id, event_name, event_data, "
                      "failure, attempts, first_failed_at) "
                      "VALUES (:r, :ws, 'job.a', 'test.event', '{}'::jsonb, '{}'::jsonb, 3, now())"), params)
    return run_id


@pytest.fixture
def seeded(engine: Engine) -> Iterator[dict[str | None, uuid.UUID]]:
    with engine.begin() as conn:
        runs = {ws: _seed_workspace(conn, ws) for ws in (A, B, None)}
    # The owner sees all three rows of every table: what follows is hidden, not missing.
    with engine.connect() as conn:
        for table in RLS_TABLES:
            seen = Counter(conn.execute(text(f"SELECT workspace_id FROM {table}")).scalars())
            assert seen == Counter({A: 1, B: 1, None: 1}), (table, seen)
    yield runs


def _workspaces(session_or_conn: object, table: str) -> Counter[str | None]:
    return Counter(session_or_conn.execute(text(f"SELECT workspace_id FROM {table}")).scalars())  # type: ignore[attr-defined]


def test_workspace_session_runs_as_the_app_role_that_rls_binds(app_settings: Settings, engine: Engine) -> None:
    with workspace_session(A, settings=app_settings) as s:
        user, bypass, ws, admin = s.execute(text(
            "SELECT current_user, r.rolbypassrls OR r.rolsuper, current_setting('motir.workspace_id', true), "
            "current_setting('motir.system_admin', true) FROM pg_roles r WHERE r.rolname = current_user"
        )).one()
    assert (user, bypass, ws, admin) == (APP_ROLE, False, A, "false")
    # The owner login, which RLS does not filter (ENABLE, not FORCE), is another role.
    with engine.connect() as conn:
        assert conn.execute(text("SELECT current_user")).scalar_one() != APP_ROLE


def test_every_table_with_a_workspace_column_has_row_level_security(engine: Engine) -> None:
    with engine.connect() as conn:
        with_column = set(conn.execute(text(
            "SELECT table_name FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND column_name = 'workspace_id'"
        )).scalars())
        enabled = dict(conn.execute(text(
            "SELECT relname, relrowsecurity FROM pg_class "
            "WHERE relnamespace = current_schema()::regnamespace AND relkind = 'r'"
        )).all())
    assert with_column == set(RLS_TABLES)
    assert {t: enabled[t] for t in RLS_TABLES} == {t: True for t in RLS_TABLES}


def test_workspace_a_reads_none_of_workspace_b_rows_in_any_table(seeded: object, app_settings: Settings) -> None:
    for table in RLS_TABLES:
        with workspace_session(A, settings=app_settings) as s:
            assert _workspaces(s, table) == Counter({A: 1}), table
            hidden = s.execute(text(f"SELECT count(*) FROM {table} WHERE workspace_id = :b"), {"b": B}).scalar_one()
            assert hidden == 0, table
        with workspace_session(B, settings=app_settings) as s:
            assert _workspaces(s, table) == Counter({B: 1}), table


def test_system_rows_are_invisible_without_system_admin_and_visible_with_it(
    seeded: object, app_settings: Settings
) -> None:
    system = "SELECT count(*) FROM {} WHERE workspace_id IS NULL"
    for table in RLS_TABLES:
        with workspace_session(None, settings=app_settings) as s:
            assert _workspaces(s, table) == Counter(), table
        with workspace_session(A, settings=app_settings) as s:
            assert s.execute(text(system.format(table))).scalar_one() == 0, table
        with workspace_session(A, admin=True, settings=app_settings) as s:
            assert s.execute(text(system.format(table))).scalar_one() == 1, table


def test_system_admin_is_the_cross_workspace_escape_hatch(seeded: object, app_settings: Settings) -> None:
    # Seed 001: system_admin is the admin tooling's way across workspaces, system rows included.
    for table in RLS_TABLES:
        with workspace_session(None, admin=True, settings=app_settings) as s:
            assert _workspaces(s, table) == Counter({A: 1, B: 1, None: 1}), table


def _insert_one(s: object, table: str, ws: str | None, run_id: uuid.UUID) -> None:
    """An INSERT of one row into ``table`` for workspace ``ws`` (child rows hang off ``run_id``)."""
    params = {"ws": ws, "r": run_id, "step": f"s-{uuid.uuid4().hex[:6]}"}
    sql = {
        "job_event": "INSERT INTO job_event (name, data, workspace_id) VALUES ('test.write', '{}'::jsonb, :ws)",
        "job_queue": "INSERT INTO job_queue (job_id, event_name, workspace_id, max_attempts, retry_policy) "
                     "VALUES ('job.write', 'test.write', :ws, 3, 'transient')",
        "job_step": "INSERT INTO job_step (run_id, step_id, workspace_id, output, attempt, started_at) "
                    "VALUES (:r, :step, :ws, '1'::jsonb, 1, now())",
        "job_run": "INSERT INTO job_run (run_id, attempt, workspace_id, job_id, event_name, worker, outcome) "
                   "VALUES (:r, 99, :ws, 'job.a', 'test.event', 'w1', 'succeeded')",
        "job_run_dlq": "INSERT INTO job_run_dlq (workspace_id, function_id, event_name, event_data, failure, "
                       "attempts, first_failed_at) "
                       "VALUES (:ws, 'job.a', 'test.event', '{}'::jsonb, '{}'::jsonb, 3, now())",
    }[table]
    s.execute(text(sql), params)  # type: ignore[attr-defined]


def test_app_role_may_write_its_own_workspace(
    seeded: dict[str | None, uuid.UUID], app_settings: Settings, engine: Engine
) -> None:
    # The control for the refusals below: the grants (identity sequence included) let the app role write.
    for table in RLS_TABLES:
        with workspace_session(A, settings=app_settings) as s:
            _insert_one(s, table, A, seeded[A])
        with engine.connect() as conn:
            assert _workspaces(conn, table)[A] == 2, table


@pytest.mark.parametrize("target", [B, None], ids=["other-workspace", "system-row"])
def test_insert_into_another_workspace_is_refused(
    target: str | None, seeded: dict[str | None, uuid.UUID], app_settings: Settings, engine: Engine
) -> None:
    for table in RLS_TABLES:
        with pytest.raises(ProgrammingError) as err:
            with workspace_session(A, settings=app_settings) as s:
                # Child rows even point at the target's own run: A's context still refuses them.
                _insert_one(s, table, target, seeded[target])
        assert isinstance(err.value.orig, psycopg.errors.InsufficientPrivilege), table
        assert "row-level security" in str(err.value.orig), table
        with engine.connect() as conn:
            assert _workspaces(conn, table) == Counter({A: 1, B: 1, None: 1}), table


def test_update_and_delete_of_workspace_b_rows_from_a_change_nothing(
    seeded: object, app_settings: Settings, engine: Engine
) -> None:
    for table in RLS_TABLES:
        with workspace_session(A, settings=app_settings) as s:
            updated = s.execute(text(f"UPDATE {table} SET workspace_id = workspace_id WHERE workspace_id = :b"),
                                {"b": B})
            deleted = s.execute(text(f"DELETE FROM {table} WHERE workspace_id IS DISTINCT FROM :a"), {"a": A})
            assert (updated.rowcount, deleted.rowcount) == (0, 0), table
            # A's own row is writable: the zeros above are the policy, not missing grants.
            assert s.execute(text(f"UPDATE {table} SET workspace_id = workspace_id")).rowcount == 1, table
        with engine.connect() as conn:
            assert _workspaces(conn, table) == Counter({A: 1, B: 1, None: 1}), table


def test_moving_a_row_into_another_workspace_is_refused(
    seeded: object, app_settings: Settings, engine: Engine
) -> None:
    for table in RLS_TABLES:
        with pytest.raises(ProgrammingError) as err:
            with workspace_session(A, settings=app_settings) as s:
                s.execute(text(f"UPDATE {table} SET workspace_id = :b WHERE workspace_id = :a"), {"a": A, "b": B})
        assert "row-level security" in str(err.value.orig), table
        with engine.connect() as conn:
            assert _workspaces(conn, table) == Counter({A: 1, B: 1, None: 1}), table


@pytest.mark.parametrize("end", ["commit", "rollback"])
@pytest.mark.parametrize("admin", [False, True], ids=["workspace", "admin"])
def test_workspace_context_does_not_survive_into_the_next_transaction_on_a_pooled_connection(
    end: str, admin: bool, seeded: object, database_url: str
) -> None:
    pool = create_engine(database_url, pool_size=1, max_overflow=0)
    try:
        with pool.connect() as conn:
            with conn.begin() as tx:
                pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
                conn.execute(text(f"SET LOCAL ROLE {APP_ROLE}"))
                set_workspace_context(conn, A, admin=admin)
                # Control: the context is in force inside its transaction.
                assert conn.execute(text("SELECT current_setting('motir.workspace_id', true)")).scalar_one() == A
                assert _workspaces(conn, "job_queue") == (
                    Counter({A: 1, B: 1, None: 1}) if admin else Counter({A: 1})
                )
                tx.commit() if end == "commit" else tx.rollback()
        with pool.connect() as conn:  # the pool's only connection, handed out again
            assert conn.execute(text("SELECT pg_backend_pid()")).scalar_one() == pid
            ws, adm, user = conn.execute(text(
                "SELECT current_setting('motir.workspace_id', true), "
                "current_setting('motir.system_admin', true), current_user"
            )).one()
            assert ws in (None, "") and adm in (None, "", "false")
            assert user != APP_ROLE
            conn.execute(text(f"SET LOCAL ROLE {APP_ROLE}"))
            assert _workspaces(conn, "job_queue") == Counter()
            conn.rollback()
    finally:
        pool.dispose()


def test_workspace_session_context_ends_with_its_transaction(seeded: object, app_settings: Settings) -> None:
    from motir_celery.store.db import get_engine

    eng = get_engine(app_settings.database_url, settings=app_settings)
    with workspace_session(A, admin=True, settings=app_settings) as s:
        pid = s.execute(text("SELECT pg_backend_pid()")).scalar_one()
    # Hold pooled connections until the one workspace_session used comes back out.
    held: list[Connection] = []
    try:
        for _ in range(eng.pool.size() * 2 + 1):
            conn = eng.connect()
            held.append(conn)
            if conn.execute(text("SELECT pg_backend_pid()")).scalar_one() == pid:
                break
        else:
            pytest.fail("the workspace_session connection never came back from the pool; the test proves nothing")
        assert conn.execute(text("SELECT current_setting('motir.workspace_id', true)")).scalar_one() in (None, "")
        assert conn.execute(text("SELECT current_setting('motir.system_admin', true)")).scalar_one() in (None, "", "false")
        assert conn.execute(text("SELECT current_user")).scalar_one() != APP_ROLE
        conn.execute(text(f"SET LOCAL ROLE {APP_ROLE}"))
        assert _workspaces(conn, "job_event") == Counter()
        conn.rollback()
    finally:
        for c in held:
            c.close()
