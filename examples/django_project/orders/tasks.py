"""The durable jobs: confirm an order, render its receipt. Celery's autodiscovery finds this module
(``app.autodiscover_tasks()`` in shop/celery.py), and so do the operator tools and the web process."""

from typing import Any

from django.utils import timezone

from motir_celery import define_job
from orders.models import Order


def _confirm(order_id: int) -> str:
    # A side effect, so inside step.run: done once per run, even if the run is retried.
    Order.objects.filter(pk=order_id, confirmed_at__isnull=True).update(confirmed_at=timezone.now())
    return timezone.now().isoformat()


@define_job("orders.receipt", retry_policy="transient")
def receipt(step: Any, order_id: int, workspace_id: str) -> str:
    """A direct job, started like a Celery task: ``receipt.delay(order.pk)``."""
    order = Order.objects.get(pk=order_id)  # committed with the run: always there
    return step.run("render", lambda: f"receipt: {order.quantity} x {order.item}")


@define_job("orders.confirm", event="order.placed", retry_policy="transient")
def confirm(event: Any, step: Any) -> dict[str, Any]:
    # The order was committed with the event that started this run: it is always there.
    order = Order.objects.get(pk=event.data["order_id"])
    confirmed = step.run("confirm", _confirm, order.pk)
    return {"order_id": order.pk, "item": order.item, "quantity": order.quantity, "confirmed_at": confirmed}
