"""The shop's own tests, written with motir-celery's pytest plugin: no worker, no broker.

Run from the repository root: ``python -m pytest examples/plain_celery/tests``. The
``motir`` fixture (installed with the package) gives a migrated Postgres database —
``MOTIR_DATABASE_URL``'s server, or the embedded one — and runs the jobs in this
process through the engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.plain_celery import app as shop_app
from examples.plain_celery.tasks import fulfil_order


@pytest.fixture(autouse=True)
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """What the stand-in services did, one line per call (services.py)."""
    path = tmp_path / "ledger.txt"
    monkeypatch.setenv("SHOP_LEDGER", str(path))
    return path


def lines(ledger: Path) -> list[str]:
    return ledger.read_text().splitlines() if ledger.exists() else []


def test_a_gateway_timeout_retries_the_charge_not_the_whole_order(motir, ledger: Path) -> None:  # type: ignore[no-untyped-def]
    handle = motir.run(fulfil_order, 42)
    motir.drain()                  # attempt 1: the order is loaded, then the gateway times out
    motir.advance(seconds=3)       # the retry policy's first backoff: 2 s, ±25 % jitter
    motir.drain()                  # attempt 2: the stored "load" is not run again
    assert handle.get()["tracking"] == "TRACK-42"
    assert [line.split(" key=")[0] for line in lines(ledger)] == [
        "load 42", "charge-timeout 42", "charge 42 1042", "ship 42", "receipt customer42@example.com ch_42"]


def test_a_worker_killed_right_after_the_charge_never_charges_twice(motir, ledger: Path) -> None:  # type: ignore[no-untyped-def]
    ledger.with_suffix(".timeout-7").touch()   # this order's gateway answers at once
    motir.crash_after("charge")                # the worker dies between the charge's record and the shipment
    handle = motir.run(fulfil_order, 7)
    motir.drain()
    assert handle.get()["charge_id"] == "ch_7"
    assert sum(line.startswith("charge 7") for line in lines(ledger)) == 1
    assert motir.steps(handle) == ["load", "charge", "ship", "receipt"]


def test_in_celerys_eager_mode_delay_runs_at_once(motir, ledger: Path) -> None:  # type: ignore[no-untyped-def]
    ledger.with_suffix(".timeout-3").touch()
    shop_app.app.conf.task_always_eager = True  # what a Celery project's test settings say
    try:
        handle = fulfil_order.delay(3, notify=False)
    finally:
        shop_app.app.conf.task_always_eager = False
    assert handle.get(timeout=0)["tracking"] == "TRACK-3"   # ran, through the engine, before delay() returned
    assert motir.steps(handle) == ["load", "charge", "ship"]
