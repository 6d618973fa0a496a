"""The project's Celery app — as it was, plus one line: ``motir_celery.attach(app)``.

Run a worker from the repository root:

    celery -A examples.plain_celery.app worker -l INFO

``MOTIR_DATABASE_URL`` (Postgres, migrated with ``motir migrate``) and
``CELERY_BROKER_URL`` come from the environment.
"""

from __future__ import annotations

import os

from celery import Celery

import motir_celery

app = Celery("shop", include=["examples.plain_celery.tasks"])
app.conf.update(
    broker_url=os.environ.get("CELERY_BROKER_URL", "redis://localhost:6379/0"),
    task_default_queue=os.environ.get("SHOP_QUEUE", "celery"),
)

# The one new line: durable jobs become tasks of this app (motir.<job_id>), its
# workers run the sweeper, and job.delay() publishes through it.
motir_celery.attach(app)
