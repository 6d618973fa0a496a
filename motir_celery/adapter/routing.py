"""The message of one direct call with its own ``queue=`` / ``priority=`` (``job.apply_async``).

Without either, a direct run's message is any run's (``messages.publisher``:
the job's route, the Redis lane). With one, this call's message goes through
``send_task`` with that queue and the priority spelled for the broker as
``messages`` spells a job's (RabbitMQ: as given; Redis: inverted, kombu sorts 0
first; 0 sends none). The run's row holds the priority too; the queue is this
message's only: a message the sweeper re-publishes follows the job's route.
"""

from __future__ import annotations

import uuid

from celery import Celery

from motir_celery.adapter.messages import argsrepr, publisher, routed_options
from motir_celery.core.jobs import publish_name
from motir_celery.core.publish import Publish

__all__ = ["publisher_for"]


def publisher_for(app: Celery, queue: str | None = None, priority: int | None = None) -> Publish:
    if (queue is None and priority is None) or app.conf.task_always_eager:
        return publisher(app)  # the job's own route, or Celery's eager mode (runs in this process)

    def publish(run_id: uuid.UUID, job_id: str, countdown: float = 0.0) -> None:
        options = routed_options(app, job_id)
        if queue is not None:
            options["queue"] = queue
        if priority:
            scheme = str(app.conf.broker_url or "").split("://", 1)[0]
            options["priority"] = 9 - priority if scheme.startswith(("redis", "rediss")) else priority
        app.send_task(publish_name(job_id), args=[str(run_id)], countdown=countdown or None, task_id=str(run_id),
                      argsrepr=argsrepr(job_id, run_id), **options)

    return publish
