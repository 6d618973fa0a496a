"""A team's Celery task made durable by ``durable=True`` (adapter/tasks.py), beside a direct job of the
same body: ``celery -A bench.durable_app worker``. Both run the three functions plain Celery runs
(``bench.plain_app``), with no steps, so the sides differ by their machinery alone.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

import motir_celery
from bench.functions import charge, notify, reserve
from motir_celery import define_job

app = Celery("bench_durable", broker=os.environ["CELERY_BROKER_URL"], set_as_current=False)
app.conf.update(
    # What plain Celery's side has (bench/plain_app.py): early acks, one reserved message, no results.
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    task_default_queue=os.environ.get("MOTIR_QUEUE", "bench-durable"),
    broker_connection_retry_on_startup=True,
)
if os.environ.get("BENCH_NO_ACK_EMULATION") == "1":
    # The transport setting motir-celery's own app makes (celery_app.create_app), as plain Celery's
    # side has it under the same variable (bench/plain_app.py).
    app.conf.broker_transport_options = {"ack_emulation": False}
motir_celery.attach(app)


@app.task(name="bench.durable", durable=True)
def durable(n: int) -> Any:
    a = reserve(n)
    b = charge(a["reserved"])
    return notify(b["charged"])


@define_job("bench.direct", bind=False, name="bench.direct_job")
def direct(n: int) -> Any:
    a = reserve(n)
    b = charge(a["reserved"])
    return notify(b["charged"])
