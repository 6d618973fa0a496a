"""A small library's settings: PostgreSQL, Celery (with a beat schedule), motir-celery. No MOTIR_IMPORTS:
the jobs live in loans/tasks.py, which Celery's autodiscovery finds."""

import os
from urllib.parse import parse_qs, unquote, urlsplit

from celery.schedules import crontab

_db = urlsplit(os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/library"))
_query = {k: v[-1] for k, v in parse_qs(_db.query).items()}

SECRET_KEY = "example-only-not-a-secret"
DEBUG = True
ALLOWED_HOSTS = ["testserver", "127.0.0.1", "localhost"]
ROOT_URLCONF = "library.urls"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "motir_celery.contrib.django",
    "loans",
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.path.lstrip("/"),
        "USER": unquote(_db.username or ""),
        "PASSWORD": unquote(_db.password or ""),
        "HOST": _query.get("host") or _db.hostname or "",
        "PORT": _query.get("port") or str(_db.port or ""),
    }
}

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("LIBRARY_QUEUE", "celery")
CELERY_BEAT_SCHEDULE = {
    "overdue-every-morning": {"task": "loans.tasks.flag_overdue", "schedule": crontab(hour=7, minute=0)},
}
