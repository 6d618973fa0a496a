"""The view: the order and its event in one transaction."""

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from motir_celery import send_event
from motir_celery.contrib.django.middleware import request_workspace
from orders.models import Order
from orders.tasks import receipt


class OutOfStock(Exception):
    pass


@csrf_exempt
@require_POST
def place_order(request: HttpRequest) -> JsonResponse:
    workspace = request_workspace() or "shop"
    try:
        with transaction.atomic():
            order = Order.objects.create(item=request.POST["item"], quantity=int(request.POST.get("quantity", 1)),
                                         workspace=workspace)
            # Written on Django's connection, in this transaction; published on commit.
            sent = send_event("order.placed", {"order_id": order.pk}, workspace_id=workspace)
            # A Celery-shaped call site: the same transaction, the same outbox (a workspace_id
            # keyword is the run's workspace, as data["workspace_id"] is an event's).
            handle = receipt.delay(order.pk, workspace_id=workspace)
            if order.quantity > 10:
                raise OutOfStock(order.item)  # the order, the event and both runs roll back
    except OutOfStock as exc:
        return JsonResponse({"error": f"out of stock: {exc}"}, status=409)
    return JsonResponse({"order_id": order.pk, "event_id": str(sent.event_id),
                         "run_ids": [str(r) for r in sent.run_ids], "receipt_run_id": str(handle.id)}, status=201)


def show_order(request: HttpRequest, order_id: int) -> JsonResponse:
    order = Order.objects.get(pk=order_id)
    return JsonResponse({"order_id": order.pk, "item": order.item,
                         "confirmed_at": order.confirmed_at.isoformat() if order.confirmed_at else None})
