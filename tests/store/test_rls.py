"""Tenants cannot see each other (DESIGN.md invariant 8), proven under the app role.

The rows are written through the owner connection (the test login, which RLS
does not filter) and counted there first, so "zero rows" under the app role
means the policy hid them, not that they were never written. Reads and writes
then go through ``workspace_session``, which drops to ``motir_app`` for the
transaction (a test checks that this really happens), or through real logins
of this session's own that are members of ``motir_app`` / ``motir_admin`` only
(what MOTIR_APP_DATABASE_URL and MOTIR_ADMIN_DATABASE_URL log in as), for what
the grants refuse and what a self-set ``motir.system_admin`` does not open.
"""

from __future__ import annotations

import uuid
from collections import Counter
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator

import psycopg.errors
import pytest
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.pool import NullPool

from motir_celery.settings import Settings, get_settings
from motir_celery.store.db import set_workspace_context, workspace_session
from motir_celery.store.rls import ADMIN_ROLE, APP_ROLE, ENGINE_ROLE

RLS_TABLES = ("job_event", "job_queue", "job_step", "job_run", "job_run_dlq", "job_batch_item", "job_stats_rollup",
              "job_progress", "job_stream_item", "job_quota")
#: What the app role writes, it writes through the checked functions (migration 0008), never by INSERT.
CHECKED_WRITES = ("job_event", "job_queue")
A, B = "ws-a", "ws-b"
LOGINS = f"motir_t{uuid.uuid4().hex[:8]}"


def _create_login(engine: Engine, name: str, member_of: str) -> Iterator[str]:
    # Roles are cluster-wide: a login of this test session's own, dropped at the end,
    # so that concurrent sessions never see a role they did not make.
    with engine.begin() as conn:
        conn.execute(text(f'CREATE ROLE "{name}" LOGIN IN ROLE {member_of}'))
    try:
        yield name
    finally:
        with engine.begin() as conn:
            conn.execute(text(f'DROP ROLE IF EXISTS "{name}"'))


@pytest.fixture(scope="module")
def app_login(engine: Engine) -> Iterator[str]:
    """A real login that is only a member of motir_app, as MOTIR_APP_DATABASE_URL would be."""
    yield from _create_login(engine, f"{LOGINS}_app", APP_ROLE)


@pytest.fixture(scope="module")
def admin_login(engine: Engine) -> Iterator[str]:
    """A login the DBA made a member of motir_admin, as MOTIR_ADMIN_DATABASE_URL would be."""
    yield from _create_login(engine, f"{LOGINS}_admin", ADMIN_ROLE)


@contextmanager
def _login(user: str) -> Iterator[Connection]:
    """One transaction on a fresh connection as ``user`` (the server trusts local logins)."""
    url = make_url(get_settings().require_database_url()).set(username=user, password=None)
    eng = create_engine(url, poolclass=NullPool)
    try:
        with eng.connect() as conn, conn.begin():
            assert conn.execute(text("SELECT session_user")).scalar_one() == user
            yield conn
    finally:
        eng.dispose()


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
    conn.execute(text("INSERT INTO job_batch_item (run_id, position, event_id, workspace_id) VALUES (:r, 1, :ev, :ws)"),
                 {**params, "ev": event_id})
    conn.execute(text("INSERT INTO job_stats_rollup (job_id, workspace_id, succeeded_count, duration_buckets) "
                      "VALUES ('job.a', :ws, 1, ARRAY[1]::bigint[])"), params)
    conn.execute(text("INSERT INTO job_progress (run_id, workspace_id, state, meta, attempt) "
                      "VALUES (:r, :ws, 'PROGRESS', '{\"done\": 1}'::jsonb, 1)"), params)
    conn.execute(text("INSERT INTO job_stream_item (run_id, stream, position, workspace_id, item, bytes, attempt) "
                      "VALUES (:r, 'tokens', 0, :ws, '\"hello\"'::jsonb, 7, 1)"), params)
    conn.execute(text("INSERT INTO job_quota (workspace_id, weight, max_running) VALUES (:ws, 2, 3)"), params)
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
        "job_batch_item": "INSERT INTO job_batch_item (run_id, position, event_id, workspace_id) "
                          "SELECT :r, 99, event_id, :ws FROM job_queue WHERE id = :r",
        "job_stats_rollup": "INSERT INTO job_stats_rollup (job_id, workspace_id, bucket, duration_buckets) "
                            "VALUES ('job.write', :ws, now(), ARRAY[0]::bigint[])",
        "job_progress": "INSERT INTO job_progress (run_id, workspace_id, state, attempt) "
                        "VALUES (:r, :ws, 'PROGRESS', 99) ON CONFLICT DO NOTHING",
        "job_stream_item": "INSERT INTO job_stream_item (run_id, stream, position, workspace_id, item, bytes, attempt) "
                           "VALUES (:r, :step, 0, :ws, '1'::jsonb, 1, 1)",
        # a tenant never grants itself a bigger share: its quota is the operator's to write
        "job_quota": "INSERT INTO job_quota (workspace_id, weight) VALUES (:ws, 1000)",
    }[table]
    s.execute(text(sql), params)  # type: ignore[attr-defined]


def _enqueue(s: object, ws: str | None) -> None:
    """What send_event(session=...) sends for the app role: an event and its one run, checked."""
    s.execute(text(  # type: ignore[attr-defined]
        "SELECT * FROM motir_enqueue_event('test.write', '{}'::jsonb, :ws, NULL, NULL, ARRAY['job.write'], "
        "ARRAY[3], ARRAY['transient'], ARRAY[0]::smallint[], ARRAY[NULL]::text[], ARRAY[NULL]::text[], "
        "ARRAY[NULL]::text[])"), {"ws": ws})


def test_app_role_writes_events_and_runs_of_its_own_workspace_through_the_checked_function(
    seeded: dict[str | None, uuid.UUID], app_settings: Settings, engine: Engine
) -> None:
    # The control for the refusals below: what send_event(session=...) writes, the app role may write.
    with workspace_session(A, settings=app_settings) as s:
        _enqueue(s, A)
    with engine.connect() as conn:
        for table in CHECKED_WRITES:
            assert _workspaces(conn, table)[A] == 2, table


@pytest.mark.parametrize("table", RLS_TABLES)
def test_app_role_cannot_insert_into_any_table(
    table: str, seeded: dict[str | None, uuid.UUID], app_settings: Settings, engine: Engine
) -> None:
    with pytest.raises(ProgrammingError) as err:
        with workspace_session(A, settings=app_settings) as s:
            _insert_one(s, table, A, seeded[A])
    assert isinstance(err.value.orig, psycopg.errors.InsufficientPrivilege), table
    assert "permission denied" in str(err.value.orig), table
    with engine.connect() as conn:
        assert _workspaces(conn, table) == Counter({A: 1, B: 1, None: 1}), table


@pytest.mark.parametrize("target", [B, None], ids=["other-workspace", "system-row"])
def test_a_checked_write_into_another_workspace_is_refused(
    target: str | None, seeded: dict[str | None, uuid.UUID], app_settings: Settings, engine: Engine
) -> None:
    with pytest.raises(ProgrammingError) as err:
        with workspace_session(A, settings=app_settings) as s:
            _enqueue(s, target)
    assert isinstance(err.value.orig, psycopg.errors.InsufficientPrivilege)
    assert "motir: an event of workspace" in str(err.value.orig)
    with engine.connect() as conn:
        for table in CHECKED_WRITES:
            assert _workspaces(conn, table) == Counter({A: 1, B: 1, None: 1}), table


WRITES = {
    "update": "UPDATE {table} SET workspace_id = workspace_id WHERE workspace_id = :a",
    "delete": "DELETE FROM {table} WHERE workspace_id = :a",
    "move": "UPDATE {table} SET workspace_id = :b WHERE workspace_id = :a",
    "truncate": "TRUNCATE {table} CASCADE",
}


@pytest.mark.parametrize("write", list(WRITES))
@pytest.mark.parametrize("table", RLS_TABLES)
def test_app_role_cannot_update_or_delete_even_its_own_rows(
    table: str, write: str, seeded: object, app_login: str, engine: Engine
) -> None:
    # A real login of motir_app (not the owner dropping a role), in its own workspace,
    # where RLS would let it see the row: the grant is what refuses.
    with _login(app_login) as conn:
        set_workspace_context(conn, A)
        assert _workspaces(conn, table) == Counter({A: 1}), table  # visible: only the grant says no
        with pytest.raises(ProgrammingError) as err:
            conn.execute(text(WRITES[write].format(table=table)), {"a": A, "b": B})
        assert isinstance(err.value.orig, psycopg.errors.InsufficientPrivilege), (table, write)
    with engine.connect() as conn:
        assert _workspaces(conn, table) == Counter({A: 1, B: 1, None: 1}), table


def test_replay_audit_cannot_be_changed_by_the_app_role(seeded: object, app_login: str, engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text("UPDATE job_run_dlq SET replayed_at = now(), replayed_by = 'alice' WHERE workspace_id = :a"),
                     {"a": A})
    for sql in ("UPDATE job_run_dlq SET replayed_by = 'mallory' WHERE workspace_id = :a",
                "UPDATE job_run_dlq SET replayed_at = NULL, replayed_by = NULL WHERE workspace_id = :a",
                "DELETE FROM job_run_dlq WHERE workspace_id = :a"):
        with _login(app_login) as conn:
            set_workspace_context(conn, A)
            with pytest.raises(ProgrammingError) as err:
                conn.execute(text(sql), {"a": A})
            assert isinstance(err.value.orig, psycopg.errors.InsufficientPrivilege), sql
    with engine.connect() as conn:
        assert conn.execute(text("SELECT replayed_by FROM job_run_dlq WHERE workspace_id = :a"),
                            {"a": A}).scalar_one() == "alice"


def test_app_role_setting_system_admin_itself_sees_no_foreign_rows(seeded: object, app_login: str) -> None:
    for table in RLS_TABLES:
        with _login(app_login) as conn:
            conn.execute(text("SELECT set_config('motir.workspace_id', :a, true), "
                              "set_config('motir.system_admin', 'true', true)"), {"a": A})
            assert conn.execute(text("SELECT current_setting('motir.system_admin')")).scalar_one() == "true"
            assert _workspaces(conn, table) == Counter({A: 1}), table  # no B row, no system row
        with _login(app_login) as conn:
            conn.execute(text("SELECT set_config('motir.system_admin', 'true', true)"))
            assert _workspaces(conn, table) == Counter(), table


def test_admin_role_member_with_system_admin_sees_every_row(seeded: object, admin_login: str) -> None:
    for table in RLS_TABLES:
        with _login(admin_login) as conn:
            set_workspace_context(conn, None, admin=True)
            assert _workspaces(conn, table) == Counter({A: 1, B: 1, None: 1}), table
        with _login(admin_login) as conn:  # the same login without the GUC: just a workspace reader
            set_workspace_context(conn, A)
            assert _workspaces(conn, table) == Counter({A: 1}), table


def test_admin_role_member_cannot_write_history_either(seeded: object, admin_login: str, engine: Engine) -> None:
    for table in RLS_TABLES:
        with _login(admin_login) as conn:
            set_workspace_context(conn, None, admin=True)
            with pytest.raises(ProgrammingError) as err:
                conn.execute(text(f"DELETE FROM {table}"))
            assert isinstance(err.value.orig, psycopg.errors.InsufficientPrivilege), table
    with engine.connect() as conn:
        assert _workspaces(conn, "job_step") == Counter({A: 1, B: 1, None: 1})


@pytest.mark.parametrize("role", [ENGINE_ROLE, ADMIN_ROLE, "postgres"])
def test_app_login_cannot_set_itself_a_stronger_role(role: str, app_login: str) -> None:
    with _login(app_login) as conn:
        with pytest.raises(ProgrammingError) as err:
            conn.execute(text(f'SET LOCAL ROLE "{role}"'))
        assert isinstance(err.value.orig, psycopg.errors.InsufficientPrivilege), role
    with _login(app_login) as conn:  # RESET ROLE: back to the login itself, which is only an app reader
        conn.execute(text("RESET ROLE"))
        conn.execute(text("SELECT set_config('motir.system_admin', 'true', true)"))
        assert conn.execute(text("SELECT count(*) FROM job_queue")).scalar_one() == 0


def test_send_event_in_an_app_role_transaction_wakes_its_own_workspace_waiters_only(
    app_settings: Settings, engine: Engine
) -> None:
    from motir_celery.core.engine import Engine as MotirEngine
    from motir_celery.testing import Held

    waiting = {}
    with engine.begin() as conn:
        for ws in (A, B):
            waiting[ws] = conn.execute(text(
                "INSERT INTO job_queue (job_id, event_name, workspace_id, max_attempts, retry_policy, run_at, "
                "wait_event, wait_path, wait_value) VALUES ('job.w', 'test.start', :ws, 3, 'transient', "
                "now() + interval '1 day', 'test.done', ARRAY['order'], '7') RETURNING id"), {"ws": ws}).scalar_one()
    with workspace_session(A, settings=app_settings) as s:
        assert s.execute(text("SELECT current_user")).scalar_one() == APP_ROLE
        result = MotirEngine(app_settings, host=Held()).send_event("test.done", {"order": 7}, workspace_id=A,
                                                                  session=s, jobs=[])
    assert [r.run_id for r in result.woken] == [waiting[A]]
    with engine.connect() as conn:
        due = dict(conn.execute(text("SELECT workspace_id, run_at <= now() FROM job_queue WHERE job_id = 'job.w'")).all())
    assert due == {A: True, B: False}


@pytest.mark.parametrize("prefix, role", [("motir_write_", ENGINE_ROLE), ("motir_enqueue_", APP_ROLE)],
                         ids=["writers", "checked"])
def test_owners_rights_functions_are_executable_by_their_one_role_only(prefix: str, role: str, engine: Engine) -> None:
    with engine.connect() as conn:
        found = conn.execute(text(
            "SELECT p.proname, p.prosecdef, array_agg(coalesce(r.rolname, 'PUBLIC') ORDER BY 1) "
            "FROM pg_proc p CROSS JOIN LATERAL aclexplode(p.proacl) a LEFT JOIN pg_roles r ON r.oid = a.grantee "
            "WHERE p.proname LIKE :prefix AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner "
            "GROUP BY 1, 2"), {"prefix": prefix + "%"}).all()
    # event, events, direct (0008) and gather (0012: debounce= / batch=)
    assert len(found) == 4 and all(definer and grantees == [role] for _, definer, grantees in found), found


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
                conn.execute(text(f"SET LOCAL ROLE {ADMIN_ROLE if admin else APP_ROLE}"))
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
            assert user not in (APP_ROLE, ADMIN_ROLE)
            conn.execute(text(f"SET LOCAL ROLE {APP_ROLE}"))
            assert _workspaces(conn, "job_queue") == Counter()
            conn.rollback()
    finally:
        pool.dispose()


def test_workspace_session_context_ends_with_its_transaction(seeded: object, app_settings: Settings) -> None:
    from motir_celery.store.db import get_engine

    eng = get_engine(app_settings, app_settings.database_url)
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
        assert conn.execute(text("SELECT current_user")).scalar_one() not in (APP_ROLE, ADMIN_ROLE)
        conn.execute(text(f"SET LOCAL ROLE {APP_ROLE}"))
        assert _workspaces(conn, "job_event") == Counter()
        conn.rollback()
    finally:
        for c in held:
            c.close()
