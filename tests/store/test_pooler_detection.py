"""PgBouncer with no setting (issue 28): each engine finds a transaction pooler itself.

A private PgBouncer (``motir_celery/dev/private.py``) in transaction pooling with ``default_pool_size
= 1`` fronts this session's database, so every client connection shares one server session:
a statement one client prepared there is the next client's clash (``DuplicatePreparedStatement``)
or absence (``InvalidSqlStatementName``). With no setting, runs in two
threads at once (two clients) all succeed on their first attempt, because the engine's probe
(``store/pooler.py``) found the pooler at its first connection and prepares nothing; one
WARNING says so. When the probe misses it, the first refused name does the same and the
statement is sent again: still no attempt charged. A session pooler and a direct connection
keep their statements prepared; an engine's settings that turn prepared statements or the probe
off override it; ``motir doctor`` says which mode is in force.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from dataclasses import replace
from typing import Any, Iterator

import psycopg
import pytest
from click.testing import CliRunner
from sqlalchemy import make_url, text
from sqlalchemy.engine import Engine

import tests.fixtures.jobs  # noqa: F401  (test.three and its jobs)
from motir_celery.core.engine import Engine as MotirEngine
from motir_celery.dev.private import PgBouncer, pgbouncer_binary
from motir_celery.settings import Settings, reset_settings
from motir_celery.store import pooler
from motir_celery.store.db import dispose_engines
from motir_celery.testing import Held

JOB = "test.three-steps"  # tests/fixtures/jobs.py: three steps, each a committed record
#: This process's engine as a worker's: settings from the environment each test points (``_point_at``),
#: messages held (no broker in these tests).
ENGINE = MotirEngine(host=Held())


def _server(database_url: str) -> str:
    """The session's database on the server itself (in `make test-pgbouncer` the session's URL
    is already a PgBouncer's: MOTIR_DIRECT_DATABASE_URL names the server it fronts)."""
    direct = os.environ.get("MOTIR_DIRECT_DATABASE_URL")
    if not direct:
        return database_url
    return make_url(direct).set(database=make_url(database_url).database).render_as_string(hide_password=False)


def _bouncer(database_url: str, mode: str, pool_size: int) -> Iterator[PgBouncer]:
    if pgbouncer_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("pgbouncer is not installed in CI (.ci/system-packages installs it)")
        pytest.skip("pgbouncer is not installed (apt-get install pgbouncer)")
    with PgBouncer(_server(database_url), pool_size=pool_size, pool_mode=mode) as b:
        yield b


@pytest.fixture(scope="module")
def bouncer(database_url: str) -> Iterator[PgBouncer]:
    yield from _bouncer(database_url, "transaction", 1)


@pytest.fixture(scope="module")
def session_bouncer(database_url: str) -> Iterator[PgBouncer]:
    # A server session per client connection while it is open: the engine's pool, its probe's two.
    yield from _bouncer(database_url, "session", 8)


def _point_at(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("MOTIR_DATABASE_URL", url)
    for name in ("MOTIR_APP_DATABASE_URL", "MOTIR_ADMIN_DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    dispose_engines()
    reset_settings()


@pytest.fixture
def through(bouncer: PgBouncer, database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """This process's engine at the transaction pooler, with no setting."""
    url = bouncer.url(make_url(database_url).database)
    _point_at(monkeypatch, url)
    yield url
    dispose_engines()
    monkeypatch.undo()
    reset_settings()


def _queued(n: int, engine: MotirEngine = ENGINE) -> list[uuid.UUID]:
    return [next(r.run_id for r in engine.send_event("test.three", {"n": i}).runs if r.job_id == JOB)
            for i in range(n)]


def _execute_in_two_threads(run_ids: list[uuid.UUID]) -> list[str]:
    """What a worker of two processes does: two runs at once, each on its own connection."""
    states: list[str] = []
    errors: list[BaseException] = []

    def work(mine: list[uuid.UUID]) -> None:
        try:
            states.extend(ENGINE.execute(r, job_id=JOB, worker="pooler-test/1").state for r in mine)
        except BaseException as exc:  # noqa: BLE001 — reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(run_ids[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return states


def _attempts(engine: Engine, run_ids: list[uuid.UUID]) -> list[tuple[int, str, int]]:
    """(attempts charged, state, attempts in the ledger) of each run."""
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(  # type: ignore[misc]
            "SELECT q.attempts, q.state, (SELECT count(*) FROM job_run r WHERE r.run_id = q.id)"
            " FROM job_queue q WHERE q.id = ANY(:ids)"), {"ids": run_ids})]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "motir_celery.pooler" and r.levelno == logging.WARNING]


def _one_session(url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://", 1), autocommit=True,
                           prepare_threshold=None)


def _prepared_in_the_one_session(url: str) -> int:
    with _one_session(url) as conn:
        row = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
    return int(row[0]) if row else -1


def _deallocate(url: str) -> None:
    """Leave the pooler's one server session clean for the next test."""
    with _one_session(url) as conn:
        conn.execute("DEALLOCATE ALL")


def test_runs_behind_a_transaction_pooler_with_no_setting_all_succeed_first_time_and_one_warning_says_why(
        through: str, engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="motir_celery.pooler")
    runs = _queued(6)
    assert _execute_in_two_threads(runs) == ["succeeded"] * 6
    assert _attempts(engine, runs) == [(1, "succeeded", 1)] * 6  # no attempt charged by the pooler
    (warning,) = _warnings(caplog)
    assert "transaction pooler" in warning and "shared one server session" in warning
    assert "no setting" in warning and "prepared statement" not in warning  # (the log scan's words)
    assert pooler.mode(ENGINE.pool()) == "unprepared (a transaction pooler was found)"
    dispose_engines()
    assert _prepared_in_the_one_session(through) == 0


def test_a_pooler_the_probe_missed_is_found_by_its_first_refused_name_and_no_attempt_is_charged(
        through: str, engine: Engine, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.WARNING, logger="motir_celery.pooler")
    monkeypatch.setattr(pooler, "probe", lambda *a, **k: False)  # as when other clients kept every session busy
    runs = _queued(6)
    assert _execute_in_two_threads(runs) == ["succeeded"] * 6
    assert _attempts(engine, runs) == [(1, "succeeded", 1)] * 6
    (warning,) = _warnings(caplog)
    assert "refused for a name the pooler gave another client" in warning
    assert pooler.mode(ENGINE.pool()) == "unprepared (a transaction pooler was found)"
    dispose_engines()
    _deallocate(through)  # what the connections prepared before the first refusal


@pytest.mark.parametrize("where", ["session pooler", "direct"])
def test_a_session_pooler_and_a_direct_connection_keep_statements_prepared(
        where: str, session_bouncer: PgBouncer, database_url: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="motir_celery.pooler")
    url = session_bouncer.url(make_url(database_url).database) if where == "session pooler" else _server(database_url)
    _point_at(monkeypatch, url)
    try:
        (run_id,) = _queued(1)
        assert ENGINE.execute(run_id, job_id=JOB, worker="pooler-test/1").state == "succeeded"
        assert pooler.mode(ENGINE.pool()) == "prepared (no transaction pooler found)"
        with ENGINE.pool().connect() as conn:  # the pool's one connection, the run's: its statements stay
            row = conn.raw.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
            assert row is not None and row[0] >= 3
        assert _warnings(caplog) == []
    finally:
        dispose_engines()


@pytest.mark.parametrize("setting, mode", [({"prepared_statements": False}, "unprepared (prepared_statements=False)"),
                                           ({"detect_pooler": False}, "prepared (detect_pooler=False)")],
                         ids=["prepared_statements=False", "detect_pooler=False"])
def test_the_engines_settings_override_the_probe(setting: dict[str, bool], mode: str, bouncer: PgBouncer,
                                                 database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: Any, **kwargs: Any) -> bool:
        raise AssertionError(f"probed though the engine's settings say {setting}")

    monkeypatch.setattr(pooler, "probe", never)
    url = bouncer.url(make_url(database_url).database)
    _point_at(monkeypatch, url)
    told = MotirEngine(replace(Settings.from_env(), **setting), host=Held())  # (its pool is made first, here)
    try:
        (run_id,) = _queued(1, told)  # one client at a time: detect_pooler=False works here too, by luck
        assert told.execute(run_id, job_id=JOB, worker="pooler-test/1").state == "succeeded"
        assert pooler.mode(told.pool()) == mode
    finally:
        dispose_engines()
        _deallocate(url)


def test_async_producers_behind_a_transaction_pooler_need_no_setting(through: str) -> None:
    import asyncio

    async def send() -> list[Any]:
        return [await ENGINE.send_event_async("test.three", {"n": i}) for i in range(8)]

    assert len(asyncio.run(send())) == 8  # psycopg would prepare the fifth of each: refused here


def test_doctor_says_which_statement_mode_is_in_force(through: str, database_url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from motir_celery.ops.cli import main

    def checks() -> dict[str, Any]:
        result = CliRunner().invoke(main, ["doctor", "--timeout", "2", "--json"], catch_exceptions=False)
        return {c["name"]: c for c in json.loads(result.stdout)["checks"]}

    behind = checks()
    assert "a transaction pooler was found (no setting needed)" in behind["database"]["detail"]
    assert behind["pooler"]["status"] == "OK", behind["pooler"]
    _point_at(monkeypatch, _server(database_url))
    assert "statements prepared: no transaction pooler found" in checks()["database"]["detail"]


def test_a_probe_still_waiting_for_a_server_session_after_its_time_takes_it_for_a_transaction_pooler() -> None:
    # A server that takes the connection and never answers: the probe's connections wait, as for a
    # busy pooler's session. Nothing prepared is correct behind any pooler; prepared is not.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        assert pooler.probe(f"host=127.0.0.1 port={port} user=postgres dbname=motir", timeout=0.5) is True
