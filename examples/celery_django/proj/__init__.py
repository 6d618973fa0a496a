# The Celery app is loaded with Django, so the tasks' shared app is this one.
from .celery import app as celery_app

__all__ = ("celery_app",)
