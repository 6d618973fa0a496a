"""The Django app: settings, the transaction hook, the job modules, the checks — in ``ready()``."""

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
        from motir_celery.core.producer import events

        conf.apply()
        events.join_transactions(db.join)
        # Every model is loaded before any ready(), so job modules may import them; the web
        # process needs the registry too (send_event fans out to the jobs it knows).
        conf.import_jobs()
        checks.register(conf.check_database, "motir")
