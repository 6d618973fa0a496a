"""The shop's tests with motir-celery's pytest plugin: Django's test client, no worker, no broker.

Django is set up by the session fixture (conftest.py) once the kit's database exists,
so the models are taken from the ``Order`` fixture rather than imported at the top.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def client() -> Any:
    from django.test import Client

    return Client(HTTP_X_SHOP_TENANT="acme")


@pytest.fixture
def Order() -> Any:  # noqa: N802  (the model class)
    from orders.models import Order

    return Order


def test_an_order_placed_is_confirmed_by_its_durable_job(motir: Any, client: Any, Order: Any) -> None:
    placed = client.post("/orders/", {"item": "teapot", "quantity": 2})
    assert placed.status_code == 201, placed.content
    order_id = placed.json()["order_id"]
    assert [job for _, job, _ in motir.published] == ["orders.confirm", "orders.receipt"]  # on commit
    motir.drain()
    assert Order.objects.get(pk=order_id).confirmed_at is not None
    assert client.get(f"/orders/{order_id}/").json()["confirmed_at"] is not None


def test_an_order_rolled_back_leaves_no_run(motir: Any, client: Any, Order: Any) -> None:
    refused = client.post("/orders/", {"item": "piano", "quantity": 11})
    assert refused.status_code == 409
    assert motir.published == [] and motir.drain() == []
    assert not Order.objects.filter(item="piano").exists()


def test_the_confirmation_survives_a_worker_killed_after_it(motir: Any, client: Any, Order: Any) -> None:
    motir.crash_after("confirm")
    order_id = client.post("/orders/", {"item": "kettle"}).json()["order_id"]
    motir.drain()   # attempt 1 dies after "confirm"; attempt 2 finds it stored and finishes
    assert Order.objects.get(pk=order_id).confirmed_at is not None
    assert [o.state for _, o in motir.outcomes].count("crashed") == 1
    assert sorted(o.state for _, o in motir.outcomes) == ["crashed", "succeeded", "succeeded"]  # + the receipt


def test_celery_eager_mode_runs_the_jobs_in_the_request(motir: Any, client: Any, Order: Any) -> None:
    from shop.celery import app

    app.conf.task_always_eager = True   # CELERY_TASK_ALWAYS_EAGER = True in a test settings module
    try:
        order_id = client.post("/orders/", {"item": "mug"}).json()["order_id"]
    finally:
        app.conf.task_always_eager = False
    assert Order.objects.get(pk=order_id).confirmed_at is not None   # confirmed before the response
    assert motir.drain() == []
