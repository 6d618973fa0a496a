"""The project's tasks after the cut-over: the decorators changed, the bodies did not.

``add`` keeps its Celery name, ``shop.tasks.add`` (module.function), so every message,
route and beat entry that names it reaches the durable job. ``slow_add`` is a job of the
test's own: a first attempt that waits before its step (the worker is killed there).
"""

import time

from motir_celery import define_job
from tests.fixtures.jobs import record


@define_job("shop.add", bind=False, retry_policy="none")
def add(x, y):
    return x + y


@define_job("shop.slow-add", retry_policy="transient")
def slow_add(step, x, y):
    if step.attempt == 1:
        time.sleep(60)  # killed here: after the adoption and the claim, before the first step
    return step.run("add", lambda: (record(step, "add"), x + y)[1])
