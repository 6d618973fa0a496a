# Celery's Django layout: the app is loaded with Django.
from library.celery import app as celery_app

__all__ = ("celery_app",)
