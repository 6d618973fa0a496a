"""The services a run needs, checked before anything starts; a missing one is named, never skipped.

* **Redis** (``CELERY_BROKER_URL``, a ``redis://`` URL). Celery's tests talk to it directly too:
  ``get_redis_connection()`` in its ``tasks.py`` reads ``REDIS_HOST`` / ``REDIS_PORT`` (always
  database 0, no password) for the keys its tasks write (``redis-echo``, ``redis-count``, ...),
  and some tests count the server's pub/sub channels (``PUBSUB CHANNELS`` is server-wide: run the
  suite on a Redis nobody else is using, as ``make celery-suite``'s embedded one). Each variant
  has a broker and a result-backend database of its own (:data:`DATABASES`), emptied before it
  runs, so nothing one variant left behind reaches the other's worker.
* **Postgres** (``MOTIR_DATABASE_URL``), for the durable variant only: a database of its own,
  created and migrated before the variant and dropped after it.
"""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final, Iterator
from urllib.parse import urlsplit

import redis
from sqlalchemy import create_engine, make_url, text

#: Redis databases of each variant: (broker, result backend). Celery's own test keys live in db 0.
DATABASES: Final = {"plain": (10, 11), "durable": (12, 13)}
#: Held while the new database is migrated: the first migration on a server creates the
#: cluster-wide roles (the same key tests/conftest.py holds for the same reason).
MIGRATE_LOCK: Final = 0x6D6F746972


class ServiceError(Exception):
    """A service is missing or unusable; the message names it."""


@dataclass(frozen=True)
class Redis:
    host: str
    port: int

    def url(self, db: int) -> str:
        return f"redis://{self.host}:{self.port}/{db}"

    def flush(self, *dbs: int) -> None:
        for db in dbs:
            redis.Redis(self.host, self.port, db=db).flushdb()


def redis_from_env() -> Redis:
    url = os.environ.get("CELERY_BROKER_URL", "").strip()
    if not url:
        raise ServiceError("Redis: CELERY_BROKER_URL is not set (make celery-suite starts an embedded Redis "
                           "when it is unset)")
    parts = urlsplit(url)
    if parts.scheme != "redis":
        raise ServiceError(f"Redis: CELERY_BROKER_URL={url} is not a redis:// URL; Celery's integration tests "
                           "read and write Redis themselves, so the suite runs on Redis only")
    if parts.password:
        raise ServiceError("Redis: CELERY_BROKER_URL has a password; Celery's tests connect with none "
                           "(REDIS_HOST / REDIS_PORT only)")
    found = Redis(parts.hostname or "localhost", parts.port or 6379)
    try:
        client = redis.Redis(found.host, found.port, socket_connect_timeout=5)
        client.ping()
        count = int(str(client.config_get("databases")["databases"]))
    except redis.RedisError as exc:
        raise ServiceError(f"Redis at {found.host}:{found.port} (CELERY_BROKER_URL) does not answer: {exc}") from exc
    needed = max(db for pair in DATABASES.values() for db in pair) + 1
    if count < needed:
        raise ServiceError(f"Redis at {found.host}:{found.port} has {count} databases; the suite uses up to db "
                           f"{needed - 1}")
    return found


def database_server_from_env() -> str:
    url = os.environ.get("MOTIR_DATABASE_URL", "").strip()
    if not url:
        raise ServiceError("Postgres: MOTIR_DATABASE_URL is not set; the durable variant needs it "
                           "(make celery-suite starts an embedded Postgres when it is unset)")
    return url


@contextmanager
def fresh_database(server_url: str) -> Iterator[str]:
    """A new, migrated database on ``server_url``'s server, dropped on exit; yields its URL."""
    from motir_celery.store.migrate import upgrade

    server = make_url(server_url)
    name = f"motir_celery_suite_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # noqa: BLE001  (any driver error: the server is the problem)
        admin.dispose()
        raise ServiceError(f"Postgres at {server.render_as_string()} (MOTIR_DATABASE_URL): cannot create a "
                           f"database: {exc}") from exc
    url = server.set(database=name).render_as_string(hide_password=False)
    try:
        with admin.connect() as lock:
            lock.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATE_LOCK})
            try:
                upgrade(url)
            finally:
                lock.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATE_LOCK})
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
