"""The project's tasks: one left as a plain Celery task, one turned into a durable job.

``send_newsletter`` stays a Celery task: nothing about it changes. ``fulfil_order``
was a Celery task (its old version is in README.md); it is now a direct durable
job — a decorator change and ``step.run`` around each side effect. Its callers
did not change: ``fulfil_order.delay(order_id)``.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task

from examples.plain_celery import services
from motir_celery import RetryPolicy, define_job


@shared_task
def send_newsletter(issue: int) -> None:
    services.send_newsletter(issue)


# Was: @app.task(bind=True, autoretry_for=(GatewayTimeout,), retry_backoff=2, max_retries=4)
@define_job("shop.fulfil-order", retry_policy=RetryPolicy(max_attempts=5, backoff=2, factor=2, max_backoff=60))
def fulfil_order(step: Any, order_id: int, notify: bool = True) -> dict[str, Any]:
    order = step.run("load", services.load_order, order_id)
    # A retry resumes here: "load" is not run again. The charge carries a key of its own,
    # so even a charge interrupted between the gateway's answer and its record is safe.
    charge = step.run("charge", services.charge_card, order_id, order["total_cents"],
                      idempotency_key=f"{step.run_id}:charge")
    tracking = step.run("ship", services.book_shipment, order_id)
    if notify:
        step.run("receipt", services.send_receipt, order["email"], charge["charge_id"])
    return {"order_id": order_id, "charge_id": charge["charge_id"], "tracking": tracking}
