"""The engine's default app with Celery task events on, for one comparison row.

``attach()`` leaves task events off, as Celery does; Flower switches them on in
the workers it watches (``enable_events``), and ``-E`` keeps them on. This
measures what they cost a worker: ``celery -A bench.motir_events_app worker``.
"""

from __future__ import annotations

from motir_celery.adapter.celery_app import default_app

app = default_app()
app.conf.worker_send_task_events = True
app.conf.task_send_sent_event = True
