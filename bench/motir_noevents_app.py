"""The engine's default app with Celery task events off, for one comparison row.

``attach()`` turns task events on by default (``worker_send_task_events``,
``task_send_sent_event``) so Flower sees every run; this measures what that
costs a worker. ``celery -A bench.motir_noevents_app worker``.
"""

from __future__ import annotations

from motir_celery.celery_app import default_app

app = default_app()
app.conf.worker_send_task_events = False
app.conf.task_send_sent_event = False
