"""Settings, read from the environment and validated (docs/settings.md is their table).

Every setting has one environment variable. A malformed value is an error that names the
variable, so a typo in a deployment fails at start-up, not at the first run that needs the
value. The engine reads them where it is built (core/engine.py), once per process unless
``reset_settings()`` says the environment changed.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Mapping

from motir_celery.errors import ConfigurationError

__all__ = ["Settings", "get_settings", "reset_settings"]


@dataclass(frozen=True)
class Settings:
    """What an engine is configured with: the ``MOTIR_*`` environment (``from_env``; the table of
    docs/settings.md), and the few fields below the line that a program sets (a test, a benchmark)
    but no environment variable does."""

    #: Engine connection (dispatcher, claim, step writes, sweeper). In
    #: production this logs in as the engine role; in development it is
    #: whatever owns the database.
    database_url: str | None = None
    #: Connection for RLS-enforced reads (CLI, dashboard, user code). Unset:
    #: the engine URL is reused and each transaction does SET LOCAL ROLE to
    #: ``motir_app``, which needs membership in that role.
    app_database_url: str | None = None
    #: Connection that owns the schema, for ``motir migrate``. Unset: the engine URL.
    migrate_database_url: str | None = None
    broker_url: str | None = None
    result_backend: str | None = None
    #: Celery queue of the default app (routing per job: Celery's task_routes).
    queue: str = "celery"
    #: Modules that define jobs, imported by workers, beat and the CLI.
    imports: tuple[str, ...] = ()
    #: How long a claim holds a run without a heartbeat.
    lease_seconds: float = 60.0
    #: Sweeper period (reclaim expired leases, re-publish lost messages).
    sweep_interval: float = 10.0
    #: A due queued run whose message is older than this is re-published.
    republish_after: float = 60.0
    #: Largest accepted JSON payload (event data, step output), in bytes.
    max_payload_bytes: int = 1_000_000
    #: The most one run's streams may hold: the items' JSON, and 64 bytes more for each (its
    #: row). A write past it raises ``StreamFull`` and stores nothing (core/worker/streams.py).
    max_stream_bytes: int = 50_000_000
    pool_size: int = 5
    #: Publish run messages under the alias ``motir.<job_id>`` instead of the job's Celery name
    #: (core/jobs.py), routed as the Celery name is: for a rolling cut-over, while workers of the
    #: code before it (plain Celery tasks of those names) still consume (docs/migrating.md).
    publish_alias: bool = False
    #: The result backend (``AsyncResult(id)``) answers for a run of any workspace, through the
    #: engine login: for an operator's process such as Flower only. Off: it reads in the caller's
    #: workspace (``in_workspace``; system runs outside one), as a result handle does.
    results_any_workspace: bool = False
    #: Connection for admin reads (``workspace_session(..., admin=True)``: the CLI's
    #: reads, the dashboard's admins, metrics): a login that is a member of
    #: ``motir_admin``, the only role for which ``motir.system_admin`` counts
    #: (docs/security.md). Unset without an app URL (development): the engine URL
    #: with SET LOCAL ROLE motir_admin.
    admin_database_url: str | None = None
    extra: Mapping[str, str] = field(default_factory=dict)

    # --- set by a program, never by the environment ---------------------------------------
    #: How long one attempt's lease is renewed at most, for a job with no ``time_limit=`` (nor a
    #: worker time limit): past it, a process wedged with its run alive loses it.
    max_hold_seconds: float = 3600.0
    #: Server-side prepared statements for the hot statements (store/driver.py), unless
    #: ``detect_pooler`` finds a transaction pooler (PgBouncer in transaction mode) in front of the
    #: URL at an engine's first connection (store/pooler.py). A benchmark turns them off to
    #: measure them; a test of the pooler's detection turns the probe off.
    prepared_statements: bool = True
    detect_pooler: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        return cls(
            database_url=_url(env, "MOTIR_DATABASE_URL"),
            app_database_url=_url(env, "MOTIR_APP_DATABASE_URL"),
            admin_database_url=_url(env, "MOTIR_ADMIN_DATABASE_URL"),
            migrate_database_url=_url(env, "MOTIR_MIGRATE_DATABASE_URL"),
            broker_url=env.get("CELERY_BROKER_URL") or None,
            result_backend=env.get("CELERY_RESULT_BACKEND") or None,
            queue=env.get("MOTIR_QUEUE", "").strip() or "celery",
            imports=tuple(m.strip() for m in env.get("MOTIR_IMPORTS", "").split(",") if m.strip()),
            lease_seconds=_positive(env, "MOTIR_LEASE_SECONDS", 60.0),
            sweep_interval=_positive(env, "MOTIR_SWEEP_INTERVAL", 10.0),
            republish_after=_positive(env, "MOTIR_REPUBLISH_AFTER", 60.0),
            max_payload_bytes=_count(env, "MOTIR_MAX_PAYLOAD_BYTES", 1_000_000),
            max_stream_bytes=_count(env, "MOTIR_MAX_STREAM_BYTES", 50_000_000),
            pool_size=_count(env, "MOTIR_POOL_SIZE", 5),
            publish_alias=_flag(env, "MOTIR_PUBLISH_ALIAS", False),
            results_any_workspace=_flag(env, "MOTIR_RESULTS_ANY_WORKSPACE", False),
        )

    def require_database_url(self) -> str:
        if not self.database_url:
            raise ConfigurationError(
                "MOTIR_DATABASE_URL is not set: point it at Postgres "
                "(postgresql+psycopg://user@host/db), or run through `make run` / "
                "`python -m motir_celery.dev.embedded` to start an embedded one"
            )
        return self.database_url


def _url(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    if "://" not in value:
        raise ConfigurationError(f"{name}={value!r} is not a URL (expected postgresql+psycopg://...)")
    scheme = value.split("://", 1)[0]
    if not scheme.startswith("postgres"):
        raise ConfigurationError(f"{name} must be a PostgreSQL URL, got scheme {scheme!r}")
    # psycopg 3 is the driver; a bare postgresql:// would make SQLAlchemy look for psycopg2.
    if scheme in ("postgres", "postgresql"):
        value = "postgresql+psycopg://" + value.split("://", 1)[1]
    return value


def _positive(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigurationError(f"{name}={raw!r} is not a number") from None
    # NaN compares false with everything and would pass `<= 0`; Postgres then
    # refuses make_interval(secs => NaN or inf) at the first claim, not at start-up.
    if not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"{name}={raw!r} must be a finite number greater than zero")
    return value


def _count(env: Mapping[str, str], name: str, default: int) -> int:
    value = _positive(env, name, default)
    # int() would truncate silently: MOTIR_POOL_SIZE=0.5 would become 0, "no limit" to SQLAlchemy.
    if value != int(value):
        raise ConfigurationError(f"{name}={env.get(name, '').strip()!r} must be a whole number")
    return int(value)


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"{name}={raw!r} is not a boolean (1/0, true/false, yes/no, on/off)")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings.from_env()


def reset_settings() -> None:
    """Forget the cached settings (tests, and processes that change their env)."""
    get_settings.cache_clear()
