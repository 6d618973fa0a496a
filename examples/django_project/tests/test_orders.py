"""The shop's tests under pytest-django with motir-celery's pytest plugin: Django's test client, the
kit, eager mode; no worker, no broker, no conftest (pytest.ini names the settings, that is all).

The database is Django's test database (``test_`` + ``DATABASES["default"]["NAME"]``), created and
migrated by pytest-django — motir's tables with Django's — and dropped at the end; the engine
follows it. ``motir`` makes a test transactional (the kit's runs commit, as a worker's would).
"""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from orders.models import Order
from shop.celery import app


@pytest.fixture
def client() -> Client:
    return Client(HTTP_X_SHOP_TENANT="acme")


def test_an_order_placed_is_confirmed_by_its_durable_job(motir: Any, client: Any) -> None:
    placed = client.post("/orders/", {"item": "teapot", "quantity": 2})
    assert placed.status_code == 201, placed.content
    order_id = placed.json()["order_id"]
    assert [job for _, job, _ in motir.published] == ["orders.confirm", "orders.receipt"]  # on commit
    motir.drain()
    assert Order.objects.get(pk=order_id).confirmed_at is not None
    assert client.get(f"/orders/{order_id}/").json()["confirmed_at"] is not None


def test_an_order_rolled_back_leaves_no_run(motir: Any, client: Any) -> None:
    refused = client.post("/orders/", {"item": "piano", "quantity": 11})
    assert refused.status_code == 409
    assert motir.published == [] and motir.drain() == []
    assert not Order.objects.filter(item="piano").exists()


def test_the_confirmation_survives_a_worker_killed_after_it(motir: Any, client: Any) -> None:
    motir.crash_after("confirm")
    order_id = client.post("/orders/", {"item": "kettle"}).json()["order_id"]
    motir.drain()   # attempt 1 dies after "confirm"; attempt 2 finds it stored and finishes
    assert Order.objects.get(pk=order_id).confirmed_at is not None
    assert [o.state for _, o in motir.outcomes].count("crashed") == 1
    assert sorted(o.state for _, o in motir.outcomes) == ["crashed", "succeeded", "succeeded"]  # + the receipt


def test_celery_eager_mode_runs_the_jobs_in_the_request(motir: Any, client: Any) -> None:
    app.conf.task_always_eager = True   # CELERY_TASK_ALWAYS_EAGER = True in a test settings module
    try:
        order_id = client.post("/orders/", {"item": "mug"}).json()["order_id"]
    finally:
        app.conf.task_always_eager = False
    assert Order.objects.get(pk=order_id).confirmed_at is not None   # confirmed before the response
    assert motir.drain() == []
