import os

from celery import Celery

import motir_celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "library.settings")

app = Celery("library")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()          # loans/tasks.py: the workers, and motir's operator tools, find it
motir_celery.attach(app)
