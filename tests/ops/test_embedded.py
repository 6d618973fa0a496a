"""The embedded fallback: with no service URLs set, `python -m motir_celery.dev.embedded env`
starts Postgres and Redis that outlive it, and prints URLs that really work.

Every call runs the CLI in a subprocess, as the Makefile does, with
MOTIR_DATABASE_URL and CELERY_BROKER_URL removed and MOTIR_DATA_DIR in a temp folder,
so these tests never touch the services the rest of the suite uses.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from kombu import Connection
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

SERVICE_VARS = ("MOTIR_DATABASE_URL", "CELERY_BROKER_URL")


def embedded(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "motir_celery.dev.embedded", command],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def exports_of(stdout: str) -> dict[str, str]:
    """Parse the `export NAME=value` lines the way the shell's `eval` would."""
    exports = {}
    for line in stdout.splitlines():
        keyword, assignment = shlex.split(line)
        assert keyword == "export", line
        name, _, value = assignment.partition("=")
        exports[name] = value
    return exports


def select_one(database_url: str) -> int:
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT 1")).scalar_one())
    finally:
        engine.dispose()


def ping(broker_url: str) -> bool:
    client = redis.Redis.from_url(broker_url, socket_timeout=5)
    try:
        return bool(client.ping())
    finally:
        client.close()


@pytest.fixture(scope="module")
def clean_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    env = {name: value for name, value in os.environ.items() if name not in SERVICE_VARS}
    env["MOTIR_DATA_DIR"] = str(tmp_path_factory.mktemp("motir"))
    yield env
    embedded("stop", env)


@pytest.fixture(scope="module")
def urls(clean_env: dict[str, str]) -> dict[str, str]:
    result = embedded("env", clean_env)
    assert result.returncode == 0, result.stderr
    return exports_of(result.stdout)


def test_env_exports_both_urls_when_neither_is_set(urls: dict[str, str]) -> None:
    assert set(urls) == set(SERVICE_VARS)
    assert urls["MOTIR_DATABASE_URL"].startswith("postgresql+psycopg://postgres@/motir?host=")
    assert urls["CELERY_BROKER_URL"].startswith("redis://127.0.0.1:")


def test_postgres_outlives_the_env_process_and_answers_select_1(urls: dict[str, str]) -> None:
    assert select_one(urls["MOTIR_DATABASE_URL"]) == 1


def test_redis_outlives_the_env_process_and_answers_ping(urls: dict[str, str]) -> None:
    assert ping(urls["CELERY_BROKER_URL"])


def test_the_redis_url_works_as_a_kombu_broker(urls: dict[str, str]) -> None:
    with Connection(urls["CELERY_BROKER_URL"]) as conn:
        queue = conn.SimpleQueue("motir-embedded-test")
        queue.put({"hello": "broker"})
        message = queue.get(timeout=5)
        message.ack()
        queue.close()
    assert message.payload == {"hello": "broker"}


def test_a_second_env_reuses_the_running_services_and_prints_the_same_urls(
    clean_env: dict[str, str], urls: dict[str, str]
) -> None:
    again = embedded("env", clean_env)
    assert again.returncode == 0, again.stderr
    assert exports_of(again.stdout) == urls


def test_env_starts_only_the_service_whose_variable_is_unset(tmp_path: Path, clean_env: dict[str, str]) -> None:
    env = {**clean_env, "MOTIR_DATA_DIR": str(tmp_path), "MOTIR_DATABASE_URL": "postgresql+psycopg://elsewhere/db"}
    try:
        result = embedded("env", env)
        assert result.returncode == 0, result.stderr
        assert list(exports_of(result.stdout)) == ["CELERY_BROKER_URL"]
        assert not (tmp_path / "pg").exists()
    finally:
        embedded("stop", env)


def test_env_prints_nothing_and_starts_nothing_when_both_are_set(tmp_path: Path, clean_env: dict[str, str]) -> None:
    env = {**clean_env, "MOTIR_DATA_DIR": str(tmp_path / "unused"), "MOTIR_DATABASE_URL": "x", "CELERY_BROKER_URL": "y"}
    result = embedded("env", env)
    assert (result.returncode, result.stdout) == (0, "")
    assert not (tmp_path / "unused").exists()


def test_stop_shuts_both_down_and_env_restarts_them_on_the_same_urls(
    clean_env: dict[str, str], urls: dict[str, str]
) -> None:
    stopped = embedded("stop", clean_env)
    assert stopped.returncode == 0, stopped.stderr
    assert "postgres" in stopped.stderr and "redis" in stopped.stderr
    with pytest.raises(OperationalError):
        select_one(urls["MOTIR_DATABASE_URL"])
    with pytest.raises(redis.ConnectionError):
        ping(urls["CELERY_BROKER_URL"])

    restarted = embedded("env", clean_env)  # leaves the module's services up, whatever the test order
    assert restarted.returncode == 0, restarted.stderr
    assert exports_of(restarted.stdout) == urls
    assert select_one(urls["MOTIR_DATABASE_URL"]) == 1


def test_a_service_that_cannot_start_is_named_and_exits_non_zero(tmp_path: Path, clean_env: dict[str, str]) -> None:
    (tmp_path / "redis").write_text("a file where the redis folder should be")
    env = {**clean_env, "MOTIR_DATA_DIR": str(tmp_path), "MOTIR_DATABASE_URL": "postgresql+psycopg://elsewhere/db"}
    result = embedded("env", env)
    assert result.returncode != 0
    assert result.stdout == ""
    assert "embedded redis" in result.stderr


KIT_TEST = "def test_the_kit(motir):\n    assert motir.drain() == []\n"


def kit_session(folder: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A user's pytest run of one test that asks for the kit (motir_celery.testing's plugin)."""
    (folder / "test_kit.py").write_text(KIT_TEST)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_kit.py"],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=240)


def test_a_pytest_run_stops_the_embedded_postgres_it_started_and_starts_no_redis(
    tmp_path: Path, clean_env: dict[str, str]
) -> None:
    data = tmp_path / "motir"
    env = {**clean_env, "MOTIR_DATA_DIR": str(data)}
    try:
        done = kit_session(tmp_path, env)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "1 passed" in done.stdout
        assert (data / "pg").is_dir() and not (data / "pg" / "postmaster.pid").exists()   # started, then stopped
        assert not (data / "redis").exists()                                              # the kit needs no broker
    finally:
        embedded("stop", env)


def test_a_pytest_run_leaves_the_embedded_postgres_it_found_running(
    tmp_path: Path, clean_env: dict[str, str], urls: dict[str, str]
) -> None:
    done = kit_session(tmp_path, clean_env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert select_one(urls["MOTIR_DATABASE_URL"]) == 1
