"""Configuration from the environment: a malformed value is an error naming its variable."""

from __future__ import annotations

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


@pytest.mark.parametrize("raw", ["motir-app", "1role", 'x"; DROP TABLE job_queue; --'])
def test_a_role_name_that_is_not_a_plain_identifier_is_refused(raw: str) -> None:
    # The role is interpolated into SET LOCAL ROLE; only plain identifiers may get there.
    with pytest.raises(ConfigurationError, match="MOTIR_APP_ROLE"):
        Settings.from_env({"MOTIR_APP_ROLE": raw})
