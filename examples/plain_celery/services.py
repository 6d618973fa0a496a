"""Stand-ins for the shop's real services (database, payment gateway, carrier, mail).

Each call appends one line to the ledger file (``SHOP_LEDGER``), so the test can
count what really happened. The payment gateway times out on the first charge
of every order, as real ones do now and then.
"""

from __future__ import annotations

import os
from pathlib import Path


class GatewayTimeout(Exception):
    """The payment gateway did not answer in time (worth a retry)."""


def _ledger() -> Path:
    return Path(os.environ.get("SHOP_LEDGER", "/tmp/shop-ledger.txt"))


def _write(line: str) -> None:
    with _ledger().open("a") as fh:
        fh.write(line + "\n")


def load_order(order_id: int) -> dict[str, object]:
    _write(f"load {order_id}")
    return {"id": order_id, "total_cents": 1000 + order_id, "email": f"customer{order_id}@example.com"}


def charge_card(order_id: int, cents: int, *, idempotency_key: str) -> dict[str, object]:
    try:  # O_EXCL: of two runs charging the same order at once, only the first times out
        _ledger().with_suffix(f".timeout-{order_id}").touch(exist_ok=False)
    except FileExistsError:
        pass
    else:
        _write(f"charge-timeout {order_id}")
        raise GatewayTimeout(f"gateway timed out charging order {order_id}")
    _write(f"charge {order_id} {cents} key={idempotency_key}")
    return {"charge_id": f"ch_{order_id}", "cents": cents}


def book_shipment(order_id: int) -> str:
    _write(f"ship {order_id}")
    return f"TRACK-{order_id}"


def send_receipt(email: str, charge_id: str) -> None:
    _write(f"receipt {email} {charge_id}")


def send_newsletter(issue: int) -> None:
    _write(f"newsletter {issue}")
