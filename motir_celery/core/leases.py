"""The runs this process holds, and their heartbeat.

The runner registers each claimed run for as long as its handler runs; the
worker's engine thread (``adapter/worker.py``) calls ``renew_due`` about once a
second, which renews, in one fenced statement on a connection of its own, every
held run whose last renewal is a third of its lease old. A busy run pool cannot
starve it of a connection.

The bound, stated plainly: a step body that holds the GIL (a C call that never
releases it, such as a catastrophic regex) starves every thread of its process,
this one too. If it holds it past the lease, the sweeper reclaims the run; the
body's record is then refused, and the next attempt runs **that step** again,
never one before it (each is committed before the next body starts). Give such
a job a longer ``MOTIR_LEASE_SECONDS``, or run the body in a subprocess.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from motir_celery.forks import per_process
from motir_celery.store import statements
from motir_celery.store.db import side_engine
from motir_celery.store.statements import Claim

__all__ = ["hold", "renew_due", "held_count"]

log = logging.getLogger("motir_celery.leases")


@dataclass
class _Held:
    claim: Claim
    lease: float
    next_at: float  # time.monotonic() of the next renewal


class _Registry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: dict[uuid.UUID, _Held] = {}


_registry = per_process(_Registry)


@contextmanager
def hold(claim: Claim, lease_seconds: float) -> Iterator[None]:
    """Keep ``claim``'s lease renewed while the block runs."""
    registry = _registry()
    with registry.lock:
        registry.held[claim.token] = _Held(claim, lease_seconds, time.monotonic() + lease_seconds / 3)
    try:
        yield
    finally:
        with registry.lock:
            registry.held.pop(claim.token, None)


def held_count() -> int:
    return len(_registry().held)


def renew_due() -> None:
    """Renew every held lease that is due, in one statement; forget the ones refused."""
    registry = _registry()
    now = time.monotonic()
    with registry.lock:
        due = [h for h in registry.held.values() if h.next_at <= now]
    if not due:
        return
    by_lease: dict[float, list[_Held]] = {}
    for h in due:
        by_lease.setdefault(h.lease, []).append(h)
    for lease, group in by_lease.items():
        with side_engine().begin() as conn:
            still = statements.renew_leases(conn, [h.claim for h in group], lease)
        with registry.lock:
            for h in group:
                h.next_at = now + lease / 3
                if h.claim.run_id not in still and registry.held.pop(h.claim.token, None) is not None:
                    log.warning("run %s: lease lost; its next step write will stop the attempt", h.claim.run_id)
