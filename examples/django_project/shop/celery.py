"""Celery's usual Django layout, plus one line: ``motir_celery.attach(app)``."""

import os

from celery import Celery

import motir_celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")

app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Each installed app's tasks module (orders/tasks.py), imported once Django is set up, so a job
# module may import models: the worker finds the jobs this way, the web process and manage.py
# motir through motir's Django app.
app.autodiscover_tasks()
motir_celery.attach(app)


@app.task(name="shop.ping")
def ping() -> str:
    """A plain Celery task beside the durable jobs."""
    return "pong"
