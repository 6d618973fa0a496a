"""The holders' protocol: what a process tells the worker's lease renewer of each hold, it reads back.

A hold is one line of space-separated fields (core/worker/leases.py, ``Lease.line`` and ``parse``);
a field with a blank in it would make the renewer refuse every hold of that kind, and the holding
processes renew their leases themselves (what a body holding the GIL then costs them). No
database: the lines only.
"""

from __future__ import annotations

import time
import uuid

import pytest

from motir_celery import define_job
from motir_celery.core.engine import Engine
from motir_celery.core.worker.leases import Lease, parse
from motir_celery.settings import Settings
from motir_celery.testing import Held


@define_job("test.leases.limited", time_limit=600)
def limited(step: object) -> None:
    return None


@define_job("test.leases.unlimited")
def unlimited(step: object) -> None:
    return None


@pytest.mark.parametrize(("job", "worker_limit", "bound"), [
    ("test.leases.limited", None, "time_limit=600"),
    ("test.leases.unlimited", 900.0, "task_time_limit=900"),
    ("test.leases.unlimited", None, "default_hold=3600s"),
])
def test_every_kind_of_bound_is_told_in_a_line_the_renewer_reads_back(job: str, worker_limit: float | None,
                                                                       bound: str) -> None:
    engine = Engine(Settings(lease_seconds=30.0), host=Held())
    engine.leases.use_renewer(None, time_limit=worker_limit)
    seconds, why = engine.leases.bound(job)
    assert why == bound
    now = time.monotonic()
    lease = Lease(uuid.uuid4(), uuid.uuid4(), 30.0, now + 10.0, now + seconds, why)
    read = parse(lease.line(now), now)
    assert isinstance(read, Lease)
    assert (read.run_id, read.token, read.seconds, read.bound) == (lease.run_id, lease.token, 30.0, bound)
    assert read.until == pytest.approx(lease.until, abs=0.01)


def test_a_line_that_is_not_the_protocol_is_refused() -> None:
    with pytest.raises(ValueError):
        parse(f"H {uuid.uuid4()} {uuid.uuid4()} 30.0 10.000 3600.000 at most 3600 s\n", time.monotonic())
