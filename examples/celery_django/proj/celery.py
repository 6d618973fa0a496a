import os

from celery import Celery

import motir_celery  # cut-over: new

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")

app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
motir_celery.attach(app)  # cut-over: new — durable jobs are tasks of this app, under their Celery names


@app.task(bind=True, ignore_result=True)
def debug_task(self):
    # A plain Celery task: it stays one, on the same app and workers.
    print(f"Request: {self.request!r}")
