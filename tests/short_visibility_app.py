"""``celery -A tests.short_visibility_app worker``: the default app, with Redis's
visibility timeout cut to 1 s (restores checked every second), so a message still
unacknowledged after a second is handed out again."""

from __future__ import annotations

from motir_celery.adapter.celery_app import create_app

app = create_app()
app.conf.broker_transport_options = {"visibility_timeout": 1.0, "unacked_restore_interval": 1,
                                     "unacked_restore_throttle": 1}
