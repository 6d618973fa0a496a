"""``celery -A tests.chaos.app worker``: the default app with Redis transport options
from the environment, for the redelivery scenario.

``CHAOS_VISIBILITY_TIMEOUT`` (seconds): a message reserved but not acknowledged for
longer is handed to another consumer while the first may still be running it —
Redis's at-least-once — with late acks on, as a user may choose them. Restores are checked every second (instead of every 10 s).
"""

from __future__ import annotations

import os

from motir_celery.adapter.celery_app import create_app

app = create_app()
if os.environ.get("CHAOS_VISIBILITY_TIMEOUT"):
    # Late acks, as an app that chose them has: the engine's default (early acks) never
    # leaves a started run's message unacknowledged, so nothing would be redelivered.
    app.conf.update(task_acks_late=True, task_reject_on_worker_lost=True)
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ["CHAOS_VISIBILITY_TIMEOUT"]),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }
