"""The engine's default app with one Celery setting changed, for a comparison row.

``BENCH_TASK_EVENTS=1``: task events on, as while Flower watches (``attach()`` leaves
them off, as Celery does). ``celery -A bench.motir_app worker``.
"""

from __future__ import annotations

import os

from motir_celery.adapter.celery_app import default_app

app = default_app()
if os.environ.get("BENCH_TASK_EVENTS") == "1":
    app.conf.worker_send_task_events = True
    app.conf.task_send_sent_event = True
