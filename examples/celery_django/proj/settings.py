"""The project's settings after the cut-over: PostgreSQL (motir-celery keeps its runs there)
and motir-celery's Django app; Celery's settings as they were, less the result backend."""

import os
from urllib.parse import parse_qs, unquote, urlsplit

# A libpq URL: postgresql://user@host:5432/db, or a socket folder as ?host=/run/postgresql.
_db = urlsplit(os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/demo"))
_query = {k: v[-1] for k, v in parse_qs(_db.query).items()}

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-a-secret")
DEBUG = True
ALLOWED_HOSTS: list[str] = []
ROOT_URLCONF = "proj.urls"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "motir_celery.contrib.django",   # cut-over: .delay() / .delay_on_commit() inside atomic() join its transaction
    "demoapp",
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

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "amqp://guest:guest@localhost")
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_SERIALIZER = "json"
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("CELERY_TASK_DEFAULT_QUEUE", "celery")
# CELERY_RESULT_BACKEND: gone — a durable job's result is its run's row, and AsyncResult(id)
# reads it there (the backend motir_celery.attach installs). Kept, it would still hold the
# results of the plain tasks, and runs would still be answered from Postgres.
