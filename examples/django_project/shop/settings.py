"""The example's settings: a minimal Django project on PostgreSQL, with motir-celery."""

import os
from urllib.parse import parse_qs, unquote, urlsplit

# DATABASE_URL as libpq spells it: a TCP host (postgresql://user@host:5432/db) or a Unix
# socket folder in the query (postgresql://user@/db?host=/run/pg&port=5432, as the embedded
# Postgres of `make test` gives it). A host or port in the query is used when present.
_db = urlsplit(os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/shop"))
_query = {k: v[-1] for k, v in parse_qs(_db.query).items()}

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-a-secret")
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
ROOT_URLCONF = "shop.urls"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    # Settings, the transaction hook (send_event inside atomic() writes on Django's
    # connection, publishes on commit), the job modules, manage.py motir / motir_migrate.
    "motir_celery.contrib.django",
    "orders",
]

MIDDLEWARE = [
    # Puts the request's workspace on the transactions motir writes in (RLS).
    "motir_celery.contrib.django.middleware.WorkspaceMiddleware",
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

# Celery, as its Django layout reads it (namespace "CELERY").
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("MOTIR_QUEUE", "celery")
CELERY_TASK_IGNORE_RESULT = True

# motir-celery: any MOTIR_* setting of docs/settings.md. MOTIR_DATABASE_URL is left out: it is
# derived from DATABASES["default"] (set it for an engine login of its own). No MOTIR_IMPORTS: the
# jobs live in orders/tasks.py, which Celery's autodiscovery finds, as motir's Django app does.
MOTIR_QUEUE = CELERY_TASK_DEFAULT_QUEUE
# Whose workspace a request writes in: here a header, for the example only — derive it
# from the authenticated user in a real project.
MOTIR_WORKSPACE_FROM_REQUEST = "shop.tenancy.workspace_of"
