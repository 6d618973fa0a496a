"""The project's Celery app after the cut-over: one line more, ``motir_celery.attach(app)``.

``SHOP_BEAT_EVERY`` (seconds) adds the ``beat_schedule`` entry the project had for ``add``.
"""

import os

from celery import Celery

import motir_celery

app = Celery("shop", include=["shop.tasks"])
app.conf.update(broker_url=os.environ["CELERY_BROKER_URL"], task_default_queue=os.environ["SHOP_QUEUE"])
if os.environ.get("SHOP_BEAT_EVERY"):
    app.conf.beat_schedule = {
        "add-every-tick": {"task": "shop.tasks.add", "schedule": float(os.environ["SHOP_BEAT_EVERY"]), "args": (1, 1)},
    }
motir_celery.attach(app)
