"""Example jobs: what ``make run`` (``python -m motir_celery.dev.demo``) runs on a real worker.

One job, three steps, three orders that show the three endings:

* order 1001 — every step succeeds on the first attempt;
* order 1002 — the card processor times out on the first attempt; the retry
  resumes at ``charge-card``: ``reserve-stock`` is *not* run again (memoized);
* order 1003 — the card is declined: ``NonRetriableError`` sends the run
  straight to the dead-letter queue, where ``motir dlq replay`` can retry it.

Start a worker on them with ``MOTIR_IMPORTS=motir_celery.dev.examples``.
"""

from __future__ import annotations

import time
from typing import Any

from motir_celery import NonRetriableError, RetryPolicy, define_job

#: Short, constant backoff so the demo finishes in seconds (production: "transient").
DEMO_RETRY = RetryPolicy(max_attempts=3, backoff=0.5, factor=1.0, jitter=0.0, name="demo")


def reserve_stock(order_id: int, items: list[str]) -> dict[str, Any]:
    time.sleep(0.05)  # a call to the inventory service
    return {"order_id": order_id, "reserved": items}


def charge_card(order_id: int, amount: float, *, attempt: int, behaviour: str) -> dict[str, Any]:
    time.sleep(0.1)  # a call to the payment provider
    if behaviour == "declined":
        raise NonRetriableError(f"card declined for order {order_id}: retrying will not help")
    if behaviour == "flaky" and attempt == 1:
        raise TimeoutError("payment provider timed out")
    return {"order_id": order_id, "charged": amount, "charge_id": f"ch_{order_id}_{attempt}"}


def send_receipt(order_id: int, charge_id: str) -> str:
    time.sleep(0.02)  # a call to the mailer
    return f"receipt for order {order_id} ({charge_id}) sent"


@define_job("examples.fulfil-order", event="order.paid", retry_policy=DEMO_RETRY)
def fulfil_order(event: Any, step: Any) -> dict[str, Any]:
    order = event.data
    stock = step.run("reserve-stock", reserve_stock, order["order_id"], order["items"])
    charge = step.run("charge-card", charge_card, order["order_id"], order["amount"],
                      attempt=event.attempt, behaviour=order.get("behaviour", "ok"))
    receipt = step.run("send-receipt", send_receipt, order["order_id"], charge["charge_id"])
    return {"reserved": stock["reserved"], "charge_id": charge["charge_id"], "receipt": receipt}
