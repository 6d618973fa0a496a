"""Configuration from the environment: a malformed value is an error naming its variable."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from motir_celery.errors import ConfigurationError
from motir_celery.settings import Settings

PG = "postgresql+psycopg://u@db:5432/motir"


@pytest.mark.parametrize("raw", ["abc", "30s", "0", "-5", "nan", "inf", "-inf"])
def test_malformed_lease_seconds_is_an_error_naming_the_variable(raw: str) -> None:
    with pytest.raises(ConfigurationError, match="MOTIR_LEASE_SECONDS"):
        Settings.from_env({"MOTIR_LEASE_SECONDS": raw})


@pytest.mark.parametrize("name", ["MOTIR_SWEEP_INTERVAL", "MOTIR_REPUBLISH_AFTER", "MOTIR_MAX_PAYLOAD_BYTES",
                                  "MOTIR_POOL_SIZE"])
def test_every_numeric_setting_names_itself_when_malformed(name: str) -> None:
    with pytest.raises(ConfigurationError, match=name):
        Settings.from_env({name: "many"})


@pytest.mark.parametrize("name", ["MOTIR_POOL_SIZE", "MOTIR_MAX_PAYLOAD_BYTES"])
@pytest.mark.parametrize("raw", ["0.5", "2.5"])
def test_a_fractional_count_is_an_error_not_silently_truncated(name: str, raw: str) -> None:
    # int("0.5") would have been 0, and SQLAlchemy reads pool_size=0 as "no limit".
    with pytest.raises(ConfigurationError, match=name):
        Settings.from_env({name: raw})


def test_well_formed_numbers_are_read() -> None:
    s = Settings.from_env({"MOTIR_LEASE_SECONDS": " 2.5 ", "MOTIR_POOL_SIZE": "8", "MOTIR_MAX_PAYLOAD_BYTES": "1e6"})
    assert (s.lease_seconds, s.pool_size, s.max_payload_bytes) == (2.5, 8, 1_000_000)
    assert Settings.from_env({}).lease_seconds == 60.0


@pytest.mark.parametrize("name", ["MOTIR_DATABASE_URL", "MOTIR_APP_DATABASE_URL", "MOTIR_MIGRATE_DATABASE_URL"])
@pytest.mark.parametrize("raw", ["localhost:5432/motir", "mysql://u@db/motir", "redis://localhost:6379/0"])
def test_malformed_database_url_is_an_error_naming_the_variable(name: str, raw: str) -> None:
    with pytest.raises(ConfigurationError, match=name):
        Settings.from_env({name: raw})


@pytest.mark.parametrize("raw", ["postgres://u@db:5432/motir", "postgresql://u@db:5432/motir", PG])
def test_database_url_is_normalised_to_the_psycopg_driver(raw: str) -> None:
    assert Settings.from_env({"MOTIR_DATABASE_URL": raw}).database_url == PG


def test_a_missing_database_url_is_an_error_naming_the_variable_when_needed() -> None:
    settings = Settings.from_env({"MOTIR_DATABASE_URL": "  "})
    assert settings.database_url is None
    with pytest.raises(ConfigurationError, match="MOTIR_DATABASE_URL"):
        settings.require_database_url()


# --- every name the package reads, against docs/settings.md --------------------------------------

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"MOTIR_[A-Z0-9_]+")


def names_read(text: str) -> set[str]:
    """The ``MOTIR_*`` names a module reads: string literals that are a name and nothing else
    (``env.get("MOTIR_X")``, ``getattr(settings, "MOTIR_X")``), not names quoted in messages."""
    return {node.value for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value)}


def documented() -> dict[str, set[str]]:
    """docs/settings.md's names by section (``## For users``, ...)."""
    sections: dict[str, set[str]] = {}
    current = ""
    for line in (ROOT / "docs" / "settings.md").read_text().splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
        elif line.startswith("|"):
            sections.setdefault(current, set()).update(NAME.findall(line.split("|")[1]))
    return sections


def test_names_read_finds_a_name_read_and_not_one_quoted() -> None:
    assert names_read('import os\nos.environ.get("MOTIR_X")\nraise ValueError("MOTIR_Y is not set")') == {"MOTIR_X"}


def test_every_motir_name_the_package_reads_is_in_the_settings_table_and_at_most_20_are_for_users() -> None:
    read = {name for path in (ROOT / "motir_celery").rglob("*.py") for name in names_read(path.read_text())}
    assert {"MOTIR_DATABASE_URL", "MOTIR_IMPORTS", "MOTIR_DASHBOARD_AUTH"} <= read  # the scan sees them
    docs = documented()
    for_users = docs["For users"]
    kept = for_users | docs["Inputs of one command, and development"]
    assert read - kept == set(), "read by the package, not in docs/settings.md's tables"
    assert kept - read == set(), "in docs/settings.md's tables, not read by the package"
    assert read & docs["Names that are gone"] == set(), "a name docs/settings.md says is gone is read"
    assert len(for_users) <= 20, sorted(for_users)


def test_the_switches_that_are_gone_change_nothing() -> None:
    gone = {"MOTIR_CLAIM_ASYNC_COMMIT": "0", "MOTIR_SETTLE_ASYNC_COMMIT": "0", "MOTIR_DIRECT_PUBLISH": "0",
            "MOTIR_REDIS_ACK_EMULATION": "1", "MOTIR_PREPARED_STATEMENTS": "0", "MOTIR_MAX_HOLD_SECONDS": "5"}
    assert Settings.from_env(gone) == Settings.from_env({})
