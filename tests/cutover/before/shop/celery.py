"""The project's Celery app before the cut-over: plain Celery."""

import os

from celery import Celery

app = Celery("shop", include=["shop.tasks"])
app.conf.update(broker_url=os.environ["CELERY_BROKER_URL"], task_default_queue=os.environ["SHOP_QUEUE"])
