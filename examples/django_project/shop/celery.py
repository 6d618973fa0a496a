"""Celery's usual Django layout, plus one line: ``motir_celery.attach(app)``."""

import os

from celery import Celery

import motir_celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")

app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
# The job modules come from MOTIR_IMPORTS (settings.py); attach() imports them when
# Celery imports its own (after django.setup()), so they may import models and tasks.
motir_celery.attach(app)


@app.task(name="shop.ping")
def ping() -> str:
    """A plain Celery task beside the durable jobs."""
    return "pong"
