"""The engine's pool (store/pg.py, over psycopg_pool): what SQLAlchemy's pool promised the engine, kept without it.

Against a real Postgres: a pool of ``size + overflow`` never opens more connections under
concurrent checkouts (and none before one is asked for), and a borrower beyond that waits, then
times out with a clear error; a
connection comes back to the next borrower rolled back and out of autocommit; a transaction
commits at its block's end and rolls back on an error; ``dispose`` closes what is idle at once and
what is lent when it returns; the side pool's ping replaces a connection whose server process died.
And what the driver keeps with a connection (store/driver.py: its cursor, its loaders, its
statements prepared through libpq) goes with it, and reads every column as psycopg's cursor does.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text

from motir_celery.store import driver
from motir_celery.store.pg import Pool, PooledConnection, PoolTimeout, conninfo, hide_password
from tests.conftest import wait_for


def _pool(database_url: str, **kwargs: Any) -> Pool:
    options: dict[str, Any] = {"size": 2, "overflow": 1, "connect_args": {"application_name": "motir-pool-test"}}
    return Pool(database_url, **{**options, **kwargs})


def _pid(conn: PooledConnection) -> int:
    row = conn.raw.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


def _opened(engine: Engine, expected: int) -> bool:
    """Whether the server has ``expected`` connections of the pool's (a closed one's server process
    leaves ``pg_stat_activity`` a moment after the close: waited for)."""
    def count() -> int:
        with engine.connect() as conn:
            return int(conn.execute(text(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'motir-pool-test'"
                " AND datname = current_database()")).scalar_one())
    wait_for(lambda: count() == expected, timeout=5, what=f"{expected} connection(s) of the pool's")
    return True


def test_concurrent_borrowers_never_open_more_than_size_plus_overflow_connections(
        database_url: str, engine: Engine) -> None:
    pool = _pool(database_url, timeout=20)
    assert _opened(engine, 0)  # none before one is asked for
    peak, lent, lock = [0], [0], threading.Lock()
    start = threading.Barrier(8)

    def borrow() -> None:
        start.wait()
        for _ in range(20):
            with pool.connect() as conn:
                with lock:
                    lent[0] += 1
                    peak[0] = max(peak[0], lent[0])
                conn.raw.execute("SELECT pg_sleep(0.002)")
                with lock:
                    lent[0] -= 1

    threads = [threading.Thread(target=borrow) for _ in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert peak[0] == 3  # eight threads, three connections at most, all three used
        assert pool.checkedout() == 0
        assert _opened(engine, 3)  # kept idle (one unused for psycopg_pool's max_idle is closed)
    finally:
        pool.dispose()
    assert _opened(engine, 0)


def test_a_borrower_beyond_the_limit_waits_for_a_connection_then_times_out_clearly(database_url: str) -> None:
    pool = _pool(database_url, size=1, overflow=0, timeout=0.5)
    try:
        held = pool.connect()
        freed = threading.Timer(0.2, held.close)
        freed.start()
        began = time.monotonic()
        with pool.connect() as conn:  # waits for the one connection to come back
            assert _pid(conn) > 0 and 0.15 < time.monotonic() - began < 0.5
            with pytest.raises(PoolTimeout, match=r"no connection to .* came free in 0.5s \(1 checked out\)"):
                pool.connect()
    finally:
        pool.dispose()


def test_a_connection_comes_back_rolled_back_and_out_of_autocommit(database_url: str) -> None:
    pool = _pool(database_url, size=1, overflow=0)
    try:
        with pool.connect() as conn:
            pid = _pid(conn)
            conn.raw.execute("SELECT set_config('motir.workspace_id', 'leaked', true)")  # inside a transaction
            assert conn.in_transaction()
        with pool.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            assert _pid(conn) == pid and conn.raw.autocommit
        with pool.connect() as conn:
            assert _pid(conn) == pid and not conn.raw.autocommit
            row = conn.raw.execute("SELECT current_setting('motir.workspace_id', true)").fetchone()
            assert row is not None and row[0] in (None, "")
    finally:
        pool.dispose()


def test_a_transaction_commits_at_its_end_and_rolls_back_on_an_error(database_url: str, engine: Engine) -> None:
    pool = _pool(database_url)
    try:
        with pool.begin() as conn:
            conn.raw.execute("INSERT INTO test.side_effect (run_id, step) VALUES (gen_random_uuid()::text, 'kept')")
        with pytest.raises(psycopg.errors.DivisionByZero):
            with pool.begin() as conn:
                conn.raw.execute("INSERT INTO test.side_effect (run_id, step) VALUES (gen_random_uuid()::text, 'gone')")
                conn.raw.execute("SELECT 1 / 0")
        with pool.connect() as conn, conn.begin() as tx:
            conn.raw.execute("INSERT INTO test.side_effect (run_id, step) VALUES (gen_random_uuid()::text, 'undone')")
            tx.rollback()
        with engine.connect() as conn:
            assert conn.execute(text("SELECT step FROM test.side_effect ORDER BY step")).scalars().all() == ["kept"]
        assert pool.checkedout() == 0
    finally:
        pool.dispose()


def test_dispose_closes_idle_connections_at_once_and_lent_ones_when_they_return(
        database_url: str, engine: Engine) -> None:
    pool = _pool(database_url)
    lent = pool.connect()
    with pool.connect():
        pass
    assert _opened(engine, 2)
    pool.dispose()
    assert _opened(engine, 1) and not lent.raw.closed
    lent.close()
    assert lent.raw.closed and _opened(engine, 0)


def test_the_side_pool_pings_and_replaces_a_connection_whose_server_process_died(
        database_url: str, engine: Engine) -> None:
    pool = _pool(database_url, size=1, overflow=0, pre_ping=True)
    try:
        with pool.connect() as conn:
            doomed = _pid(conn)
        with engine.connect() as admin:
            admin.execute(text("SELECT pg_terminate_backend(:p)"), {"p": doomed})
        time.sleep(0.1)
        with pool.connect() as conn:
            assert _pid(conn) != doomed
    finally:
        pool.dispose()


def test_a_url_becomes_libpq_s_and_its_password_is_hidden_in_messages() -> None:
    url = "postgresql+psycopg://motir:s%40cret@db.example:6432/jobs?sslmode=require"
    assert conninfo(url) == "postgresql://motir:s%40cret@db.example:6432/jobs?sslmode=require"
    assert hide_password(url) == "postgresql+psycopg://motir:***@db.example:6432/jobs?sslmode=require"
    assert hide_password("postgresql://motir@db/jobs") == "postgresql://motir@db/jobs"
    with pytest.raises(ValueError, match="not a PostgreSQL URL: mysql://u:\\*\\*\\*@h/d"):
        conninfo("mysql://u:pw@h/d")


TYPED = driver.Statement("typed", "One column of each kind a statement of the engine's returns.", """
    SELECT CAST(%(id)s AS uuid) AS id, timestamptz '2026-12-02 12:00:00+00' AS at, CAST(%(data)s AS jsonb) AS data,
           CAST(%(n)s AS int) AS n, CAST(%(flag)s AS bool) AS flag, CAST(%(name)s AS text) AS name, CAST(NULL AS text) AS nothing
    """, libpq=True)


def test_a_statement_through_libpq_reads_every_column_as_psycopg_s_cursor_does(database_url: str) -> None:
    params = {"id": "6f1c2d8e-0b7a-4e3f-9a51-3c2b1d0e9f87", "data": '{"a": [1, 2]}', "n": 7, "flag": True,
              "name": "x"}
    pool = _pool(database_url, connect_args={"options": "-c TimeZone=Asia/Kolkata"})
    try:
        with pool.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")  # the libpq path's condition (the runner's)
            by_cursor = driver.first(conn, TYPED._replace(libpq=False), params)
            by_libpq = driver.through_libpq_prepared(conn.raw, TYPED, params)
    finally:
        pool.dispose()
    assert by_cursor is not None and by_libpq == [by_cursor]
    # Aware datetimes compare equal across zones: each side's must be the session's own.
    assert [row["at"].utcoffset().total_seconds() for row in (by_cursor, *by_libpq)] == [5.5 * 3600] * 2


def test_a_connection_the_pool_closes_is_not_kept_alive_by_the_driver(database_url: str) -> None:
    """The driver keeps a cursor and prepared statements with each connection; a connection the pool
    closed (one given back beyond its size) must still be freed, not held by what was kept with it."""
    pool = _pool(database_url, size=1, overflow=1)
    ping = driver.Statement("ping", "A round trip.", "SELECT 1 AS one", libpq=True)
    seen: list[weakref.ref[Any]] = []
    try:
        for _ in range(5):  # each time one connection new, and one closed on return
            with pool.connect() as first, pool.connect() as second:
                for conn in (first, second):
                    conn.execution_options(isolation_level="AUTOCOMMIT")
                    assert driver.first(conn, ping, {}) == {"one": 1}
                    seen.append(weakref.ref(conn.raw))
        gc.collect()
        alive = {id(raw): raw for raw in (ref() for ref in seen) if raw is not None}
        # the idle one, and the one closed last (forgotten when the driver next meets a new one)
        assert len(alive) <= 2 and sum(raw.closed for raw in alive.values()) <= 1, alive
    finally:
        pool.dispose()
