# Celery's Django layout: the app is loaded with Django, so send_event publishes through it.
from shop.celery import app as celery_app

__all__ = ["celery_app"]
