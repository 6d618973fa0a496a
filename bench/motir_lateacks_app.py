"""The engine's default app with late acknowledgements, as an app that chose them
has (``task_acks_late``, ``task_reject_on_worker_lost``): ``python -m bench.cycle
--late-acks`` compares the pool child's cycle with the default, early acks."""

from __future__ import annotations

from motir_celery.adapter.celery_app import default_app

app = default_app()
app.conf.task_acks_late = True
app.conf.task_reject_on_worker_lost = True
