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
        from django.db.backends.signals import connection_created
        from django.db.models.signals import post_migrate

        from motir_celery.contrib.django import conf, db, testdb
        from motir_celery.core.current import current

        conf.apply()
        # The engine the project's Celery app hosts (attach() in its celery.py, imported before the
        # apps are ready), else the default: its writes inside atomic() go on Django's connection,
        # and inside a TestCase's own transaction on the test's connection (testdb.py).
        current().join_transactions(db.join)
        current().lend_connections(testdb.lend)
        # Django's test database: followed, migrated, flushed and dropped with it (testdb.py).
        testdb.start()
        connection_created.connect(testdb.follow, dispatch_uid="motir.testdb.follow")
        post_migrate.connect(testdb.migrate_or_flush, sender=self, dispatch_uid="motir.testdb.migrate")
        # Every model is loaded before any ready(), so job modules may import them; the web
        # process needs the registry too (send_event fans out to the jobs it knows), and so do
        # the operator tools: each installed app's tasks module, as Celery's autodiscovery finds
        # them, then MOTIR_IMPORTS.
        conf.import_jobs()
        checks.register(conf.check_database, "motir")
