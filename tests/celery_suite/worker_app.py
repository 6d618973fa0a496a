"""The app of the runner's worker: ``celery -A tests.celery_suite.worker_app worker -P prefork``.

It is made the way ``celery.contrib.pytest`` makes the suite's own apps -- ``TestApp`` with the
settings of Celery's ``celery_config`` fixture (``t/integration/conftest.py``: ``TEST_BROKER``,
``TEST_BACKEND``, ``result_extended``, no queue created on the fly; its Cassandra settings left
out, no Cassandra here) and logging on (its ``celery_enable_logging``) -- with the suite's tasks
imported and its class-based task registered (``celery_includes``, ``celery_class_tasks``), as
Celery's own ``celery_session_worker`` does before it starts its in-process worker.

The variant's folder is on ``PYTHONPATH`` (the runner sets it), so ``t.integration.tasks`` is
that variant's copy: Celery's, or Celery's with ``durable=True``. In the durable variant this is
also where the app is made, so this is where ``motir_celery.attach(app)`` is called.
"""

from __future__ import annotations

import os

from celery.contrib.testing.app import TestApp

from tests.celery_suite import VARIANT_VAR

app = TestApp(
    name="celery-suite",
    set_as_current=True,
    enable_logging=True,
    config={
        "broker_url": os.environ["TEST_BROKER"],
        "result_backend": os.environ["TEST_BACKEND"],
        "result_extended": True,
        "task_create_missing_queues": False,
    },
)
app.loader.import_task_module("t.integration.tasks")

from t.integration.tasks import ClassBasedAutoRetryTask  # noqa: E402  (the variant's copy, on PYTHONPATH)

app.register_task(ClassBasedAutoRetryTask)

if os.environ[VARIANT_VAR] == "durable":
    import motir_celery

    motir_celery.attach(app)
