"""A private primary with a streaming hot standby, for the tests of reads from a standby.

The primary is ``tests.chaos.harness.PrivatePostgres`` (``initdb -A trust``, whose
pg_hba.conf already lets local logins replicate; ``wal_level=replica`` and
``max_wal_senders`` are PostgreSQL 15's defaults). The standby is a
``pg_basebackup -R`` of it (``-R`` writes ``primary_conninfo`` and ``standby.signal``),
started on a port of its own with the same server options, as the same demoted user
when run as root. Neither touches the machine's shared server.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from tests.chaos.harness import PrivatePostgres

__all__ = ["PrivateStandby", "wait_replayed", "primary_lsn"]


class PrivateStandby(PrivatePostgres):
    """A hot standby of ``primary``, streaming from it; ``init()`` copies and starts it."""

    def __init__(self, primary: PrivatePostgres) -> None:
        super().__init__(settings=primary.settings)
        self.primary = primary

    def init(self) -> "PrivateStandby":
        self._run("pg_basebackup", "-D", str(self.data), "-R", "-X", "stream", "-c", "fast", "--no-sync",
                  "-d", f"host=127.0.0.1 port={self.primary.port} user=postgres application_name=standby",
                  timeout=120)
        self.start()
        return self


def _scalar(url: str, sql: str, params: dict[str, Any] | None = None) -> Any:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return conn.execute(text(sql), params or {}).scalar()
    finally:
        engine.dispose()


def primary_lsn(primary_url: str) -> str:
    """The primary's current WAL write position (every commit so far is before it)."""
    return str(_scalar(primary_url, "SELECT pg_current_wal_lsn()::text"))


def wait_replayed(standby_url: str, lsn: str, timeout: float = 15.0) -> None:
    """Until the standby has replayed the primary's WAL up to ``lsn``."""
    deadline = time.monotonic() + timeout
    while not _scalar(standby_url, "SELECT pg_last_wal_replay_lsn() >= CAST(:lsn AS pg_lsn)", {"lsn": lsn}):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the standby did not replay up to {lsn} within {timeout:.0f}s")
        time.sleep(0.02)
