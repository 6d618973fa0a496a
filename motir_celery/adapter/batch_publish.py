"""The messages of a batch (``send_events``) in one Redis round trip.

``messages.publisher`` sends one message per call: on the plain-Redis lane one LPUSH
with its reply (~0.4-0.6 ms), which for a batch of 100 events is most of the time
the batch takes. ``publish_many`` renders each message exactly as that lane does
(``RedisLane``'s plan for the job) and pipelines the LPUSHes: one round trip.
Whatever the lane would not take (not eligible, an eta, sent from a task, no plan
yet) goes through the single publisher, unchanged. If the pipeline fails, every
message of it goes through the single publisher — a message that did reach Redis
is then sent twice, which the claim makes harmless (a duplicate claims nothing).
"""

from __future__ import annotations

import logging
import uuid
from typing import Callable, Sequence

from celery import Celery, signals

from motir_celery.adapter.messages import publisher, redis_lane

__all__ = ["publish_many", "PublishMany"]

log = logging.getLogger("motir_celery.adapter.messages")

#: publish_many(app)([(run_id, job_id), ...]) — every run due now, after the commit.
PublishMany = Callable[[Sequence[tuple[uuid.UUID, str]]], None]


def publish_many(app: Celery) -> PublishMany:
    single = publisher(app)

    def many(runs: Sequence[tuple[uuid.UUID, str]]) -> None:
        lane = redis_lane(app)
        eligible = (lane is not None and not lane.sent_events and not signals.before_task_publish.receivers
                    and not signals.after_task_publish.receivers
                    and not (app.current_task is not None and app.current_worker_task is not None))
        rest: list[tuple[uuid.UUID, str]] = []
        piped: list[tuple[uuid.UUID, str]] = []
        if eligible and lane is not None:
            pipe = lane.client.pipeline(transaction=False)
            for run_id, job_id in runs:
                plan = lane.plan_of(job_id)
                if plan is None:
                    rest.append((run_id, job_id))  # send_task (and, the first time, its queue declaration)
                    continue
                pipe.lpush(plan.key, plan.render(run_id, app.thread_oid))
                piped.append((run_id, job_id))
            if piped:
                try:
                    pipe.execute()
                except Exception as exc:  # noqa: BLE001 — send_task, with its retries, decides
                    log.warning("pipelining %d run messages to Redis failed (%s); publishing through send_task",
                                len(piped), exc)
                    rest = piped + rest
        else:
            rest = list(runs)
        for run_id, job_id in rest:
            single(run_id, job_id, 0.0)

    return many
