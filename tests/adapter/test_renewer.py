"""The renewer's reads (adapter/renewer.py): it reads its holders' lines a period at a time, never later.

A hold read in a later read than the one it was written before is taken as written at the
previous read, so its renewal is never due later than if it had been read at once; a hold and
its release read together leave nothing in the ledger; a release read later drops its hold. No
database: nothing is due within the test.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from typing import Iterator

import pytest

from motir_celery.adapter.renewer import Renewer
from motir_celery.core.engine import Engine
from motir_celery.core.worker.leases import Lease
from motir_celery.settings import Settings
from motir_celery.testing import Held
from tests.conftest import wait_for


@pytest.fixture
def renewer() -> Iterator[Renewer]:
    directory = tempfile.mkdtemp(prefix="motir-t-")  # short: a Unix socket's path has ~100 bytes at most
    found = Renewer(os.path.join(directory, "socket"), os.getpid(), Engine(Settings(lease_seconds=30.0), host=Held()))
    threading.Thread(target=found.serve, kwargs={"watch_parent": False}, daemon=True).start()
    try:
        yield found
    finally:
        found.close_sockets()
        shutil.rmtree(directory, ignore_errors=True)


def _lease(now: float) -> Lease:
    return Lease(uuid.uuid4(), uuid.uuid4(), 30.0, now + 10.0, now + 3600.0, "default_hold=3600s")


def test_a_hold_is_renewed_no_later_than_written_and_one_released_in_the_same_read_is_not_kept(
        renewer: Renewer) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as holder:
        holder.connect(renewer.path)
        now = time.monotonic()
        kept, brief = _lease(now), _lease(now)
        time.sleep(0.2)  # a read period or two go by: the renewer reads whatever is waiting, when it reads
        written = time.monotonic()
        holder.sendall((f"P {os.getpid()}\n" + kept.line(written) + brief.line(written)
                        + f"R {brief.token}\n").encode("ascii"))
        wait_for(lambda: kept.token in renewer.ledger.leases, timeout=5, what="the hold read")
        read = renewer.ledger.leases[kept.token]
        # Its first renewal is due 10 s after the line was written at the latest (told "in 10 s").
        next_in = float(kept.line(written).split()[4])  # as the line tells it (ms)
        assert read.next_at <= written + next_in, read.next_at - written - next_in
        assert brief.token not in renewer.ledger.leases
        holder.sendall(f"R {kept.token}\n".encode("ascii"))
        wait_for(lambda: kept.token not in renewer.ledger.leases, timeout=5, what="the release read")
