"""The Django app: settings, Django's transactions joined, the job modules, the checks — in ``ready()``."""

from __future__ import annotations

from django.apps import AppConfig

__all__ = ["MotirConfig"]


class MotirConfig(AppConfig):
    name = "motir_celery.contrib.django"
    label = "motir"
    verbose_name = "motir-celery"

    def ready(self) -> None:
        from django.core import checks

        from motir_celery.contrib.django import conf, db
        from motir_celery.core.current import current

        conf.apply()
        # The engine the project's Celery app hosts (attach() in its celery.py, imported before the
        # apps are ready), else the default: its writes inside atomic() go on Django's connection.
        current().join_transactions(db.join)
        # Every model is loaded before any ready(), so job modules may import them; the web
        # process needs the registry too (send_event fans out to the jobs it knows).
        conf.import_jobs()
        checks.register(conf.check_database, "motir")
