"""What the schema this process talks to has: code may reach a host before its migration runs.

A rolling deploy upgrades code and schema at different moments (docs/operations.md,
"Deploy order": migrate first). When the code arrives first, what needs a newer
revision falls back to what the previous release did, with one WARNING per process
naming the migration to run, instead of failing every call:

* ``sweep_slot`` (0007, ``job_sweep``): without it every worker sweeps on its own;
* ``checked_enqueue`` (0008, ``motir_direct_run``): without it a direct run is
  written by one statement of its own (``DIRECT_RUN_BEFORE_0008``), as before;
* ``flow_control`` (0012, ``motir_gather``, ``job_stats_rollup``): without it the sweep
  folds no stats, purge deletes without folding, and throttle= / debounce= / batch= are
  not applied (each run runs as a plain one).

The answer is cached per process and database URL for ``TTL`` seconds, so a schema
migrated while workers run is picked up within that time. Supported: schemas from
0006 on.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from motir_celery.forks import per_process
from motir_celery.store.driver import first
from motir_celery.store.pg import PooledConnection
from motir_celery.store.sql import catalog

if TYPE_CHECKING:
    from motir_celery.store.driver import Conn

__all__ = ["Features", "features", "TTL", "forget"]

log = logging.getLogger("motir_celery.store.schema")

#: Seconds a probe's answer is kept.
TTL = 30.0

_MIGRATION = {"sweep_slot": ("0007", "every worker sweeps on its own"),
              "checked_enqueue": ("0008", "direct runs are written as before 0008"),
              "flow_control": ("0012", "no stats are folded and throttle=, debounce= and batch= are not applied")}


@dataclass(frozen=True)
class Features:
    sweep_slot: bool = True
    checked_enqueue: bool = True
    flow_control: bool = True


class _Cache:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_url: dict[str, tuple[float, Features]] = {}
        self.warned: set[str] = set()


_cache = per_process(_Cache)


def features(conn: Conn) -> Features:
    """The features of the schema ``conn`` is on (cached ``TTL`` seconds per URL)."""
    cache = _cache()
    if isinstance(conn, PooledConnection):  # the engine's own (its URL), or one Django lends (its DSN)
        key = conn.engine.url if conn.engine is not None else conn.raw.info.dsn
    else:
        key = str(conn.engine.url)
    now = time.monotonic()
    hit = cache.by_url.get(key)
    if hit is not None and hit[0] > now:
        return hit[1]
    row = first(conn, catalog.SCHEMA_FEATURES, {})
    found = Features(**row) if row is not None else Features()
    with cache.lock:
        cache.by_url[key] = (now + TTL, found)
        for name, (revision, fallback) in _MIGRATION.items():
            if not getattr(found, name) and name not in cache.warned:
                cache.warned.add(name)
                log.warning("the schema is behind this code: migration %s has not run (motir migrate); "
                            "until it does, %s", revision, fallback)
    return found


def forget() -> None:
    """Probe again on the next call (tests; after ``motir migrate`` in this process)."""
    cache = _cache()
    with cache.lock:
        cache.by_url.clear()
        cache.warned.clear()
