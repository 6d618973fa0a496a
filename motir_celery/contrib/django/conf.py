"""Django's settings onto motir's.

Every setting of ``settings.py`` whose name starts with ``MOTIR_`` — and
``CELERY_BROKER_URL`` / ``CELERY_RESULT_BACKEND``, the names Celery's Django layout
already uses — is written into this process's environment under the same name,
and motir's settings are read again (``settings.reset_settings``). The environment
stays motir's one source: a worker, beat, the CLI and a subprocess of this one all
read the same values. **A Django setting wins over the variable** (``settings.py``
is the project's configuration; it can read the environment itself). Lists and
tuples are joined with commas (``MOTIR_IMPORTS = ["shop.jobs"]``), booleans become
``1``/``0``.

``MOTIR_DATABASE_URL`` unset (in both): derived from ``DATABASES[MOTIR_DATABASE_ALIAS]``
(default ``"default"``), so motir's engine and Django's connection reach the same
database. ``manage.py check`` warns (``motir.W001``) when they do not.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qs, quote, urlencode, urlsplit

from motir_celery.core.current import current
from motir_celery.errors import ConfigurationError
from motir_celery.settings import reset_settings

__all__ = ["apply", "alias", "database_url_of", "import_jobs", "check_database"]

_CELERY_NAMES = ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")
#: Settings of this integration itself (not motir's Settings): left out of the environment.
_OWN = ("MOTIR_DATABASE_ALIAS", "MOTIR_WORKSPACE_FROM_REQUEST")
#: OPTIONS of Django's PostgreSQL backend that are not libpq parameters.
_DJANGO_ONLY_OPTIONS = frozenset({"pool", "server_side_binding", "assume_role", "isolation_level",
                                  "prepare_threshold", "cursor_factory", "context"})


def alias() -> str:
    """The Django database motir's rows live in (``MOTIR_DATABASE_ALIAS``, default ``"default"``)."""
    from django.conf import settings

    return str(getattr(settings, "MOTIR_DATABASE_ALIAS", "default"))


def _as_env(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, (str, int, float)):
        return str(value)
    raise ConfigurationError(f"Django setting {name} must be a string, number, boolean or list, "
                             f"got {type(value).__name__}")


def apply() -> None:
    """Write the Django settings into the environment and read motir's settings again."""
    from django.conf import settings

    for name in dir(settings):
        if (name.startswith("MOTIR_") and name not in _OWN) or name in _CELERY_NAMES:
            value = getattr(settings, name)
            if value is not None:
                os.environ[name] = _as_env(name, value)
    if not os.environ.get("MOTIR_DATABASE_URL", "").strip():
        os.environ["MOTIR_DATABASE_URL"] = database_url_of(alias())
    reset_settings()


def database_url_of(db_alias: str) -> str:
    """A ``postgresql+psycopg://`` URL for Django's database ``db_alias``."""
    from django.conf import settings

    try:
        db = settings.DATABASES[db_alias]
    except KeyError:
        raise ConfigurationError(f"MOTIR_DATABASE_ALIAS={db_alias!r} is not in DATABASES") from None
    if "postgresql" not in db.get("ENGINE", ""):
        raise ConfigurationError(f"DATABASES[{db_alias!r}] is {db.get('ENGINE')!r}: motir-celery needs PostgreSQL "
                                 "(django.db.backends.postgresql)")
    query = {str(k): str(v) for k, v in (db.get("OPTIONS") or {}).items()
             if k not in _DJANGO_ONLY_OPTIONS and isinstance(v, (str, int)) and not isinstance(v, bool)}
    host = db.get("HOST") or ""
    if host.startswith("/"):  # a socket directory: libpq takes it as a parameter
        query["host"], host = host, ""
    login = quote(db.get("USER") or "", safe="")
    if login and db.get("PASSWORD"):
        login += ":" + quote(db["PASSWORD"], safe="")
    where = (login + "@" if login else "") + (f"[{host}]" if ":" in host else host)
    if db.get("PORT"):
        where += f":{int(db['PORT'])}"
    name = "/" + quote(db["NAME"], safe="") if db.get("NAME") else ""
    return f"postgresql+psycopg://{where}{name}" + (f"?{urlencode(query)}" if query else "")


#: The module of each installed app that Celery's autodiscovery imports (``app.autodiscover_tasks()``).
TASKS_MODULE = "tasks"


def import_jobs() -> None:
    """Import the engine's own jobs, each installed app's ``tasks`` module as Celery's autodiscovery
    finds it (``find_related_module``: a missing module is skipped, an error inside one is raised),
    then ``MOTIR_IMPORTS`` (modules autodiscovery cannot see), from the current folder too."""
    from celery.loaders.base import find_related_module
    from celery.utils.imports import import_from_cwd
    from django.apps import apps

    import_from_cwd("motir_celery.core.system_jobs")
    for config in apps.get_app_configs():
        find_related_module(config.name, TASKS_MODULE)
    for module in current().settings.imports:
        import_from_cwd(module)


def _where(url: str) -> tuple[object, int, str | None]:
    """(host or socket directory, port, database) a URL reaches."""
    parts = urlsplit(url)
    socket = next(iter(parse_qs(parts.query).get("host") or []), None)
    return parts.hostname or socket, parts.port or 5432, parts.path.lstrip("/") or None


def check_database(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """``manage.py check``: motir's engine and Django's connection must reach one database,
    or a send_event inside ``atomic()`` and the worker that runs it see different tables."""
    from django.core.checks import Warning

    try:
        motir = current().settings.require_database_url()
        django = database_url_of(alias())
    except ConfigurationError as exc:
        return [Warning(str(exc), id="motir.W002")]
    if _where(motir) != _where(django):
        return [Warning(
            f"MOTIR_DATABASE_URL reaches {_where(motir)}, DATABASES[{alias()!r}] reaches {_where(django)}",
            hint="motir writes on Django's connection inside transaction.atomic() and on MOTIR_DATABASE_URL "
                 "elsewhere (workers too): point both at the same database",
            id="motir.W001")]
    return []
