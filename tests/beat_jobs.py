"""Cron jobs for the scheduled-job tests (MOTIR_IMPORTS=tests.beat_jobs for beats and workers).

Their schedules use croniter's sixth field, seconds, so a test watches dozens of
slots go by in a minute. Beats only enqueue; the handlers matter only where a
worker is started too.
"""

from __future__ import annotations

from typing import Any

from motir_celery import NonRetriableError, define_job

#: Default policies: latest slot only, overlapping runs allowed.
EVERY_2S = "test.cron.every-2s"
#: catchup=: every slot of the last 30 s, so a stalled beat loses none.
EVERY_3S_CATCHUP = "test.cron.every-3s-catchup"
#: overlap="skip": while one run is queued or running, later slots are skipped.
EVERY_1S_SKIP = "test.cron.every-1s-skip"
#: Fails at once: its scheduled run lands in the DLQ.
FAILING = "test.cron.failing"


@define_job(EVERY_2S, cron="* * * * * */2")
def every_2s(event: Any, step: Any) -> Any:
    return event.data


@define_job(EVERY_3S_CATCHUP, cron="* * * * * */3", catchup=30)
def every_3s_catchup(event: Any, step: Any) -> Any:
    return event.data


@define_job(EVERY_1S_SKIP, cron="* * * * * *", overlap="skip")
def every_1s_skip(event: Any, step: Any) -> Any:
    return event.data


@define_job(FAILING, cron="0 0 1 1 *", retry_policy="none")
def failing(event: Any, step: Any) -> Any:
    raise NonRetriableError(f"scheduled failure for slot {event.data['scheduled_for']}")


def __getattr__(name: str) -> Any:
    # `celery -A tests.beat_jobs beat`: a user's own app, built on first access only
    # (workers import this module for its jobs and never touch `app`).
    if name == "app":
        return _user_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _user_app() -> Any:
    """An app as a user would write it: its own beat_schedule entry, then attach()."""
    import os

    from celery import Celery

    from motir_celery import attach

    app = Celery("user-app", set_as_current=False)
    queue = os.environ.get("MOTIR_QUEUE", "celery")
    app.conf.update(
        broker_url=os.environ["CELERY_BROKER_URL"],
        task_default_queue=queue,
        beat_schedule={
            # Sent by name to a queue nobody consumes: the test reads beat's log.
            "user-heartbeat": {"task": "user.heartbeat", "schedule": 1.0, "options": {"queue": f"{queue}.user"}},
        },
    )
    return attach(app)
