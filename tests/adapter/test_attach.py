"""The engine hosted on a user's own Celery app (`motir_celery.attach(app)`)."""

from __future__ import annotations

from sqlalchemy import text

import tests.fixtures.jobs  # noqa: F401  (the job modules, as MOTIR_IMPORTS gives them to the worker)
from tests.conftest import celery_worker, count_effects, run_state, wait_for


def test_attach_hosts_jobs_on_the_users_app_beside_its_own_tasks(engine, broker_url, tmp_path):  # type: ignore[no-untyped-def]
    from motir_celery import send_event
    from tests.fixtures import user_app

    assert "motir.test.three-steps" in user_app.app.tasks  # jobs became tasks of the user's app
    # Celery's early acks (Postgres makes runs happen), and as few reserved messages as Celery allows.
    assert user_app.app.conf.task_acks_late is False and user_app.app.conf.worker_prefetch_multiplier == 1
    assert user_app.app.tasks["motir.test.three-steps"].acks_late is False
    with celery_worker(tmp_path, broker=broker_url, app="tests.fixtures.user_app"):
        (run_id,) = send_event("test.three", {}).run_ids  # publishes through the attached app
        user_app.add.delay("plain", 2, 3)
        wait_for(lambda: run_state(engine, run_id) == "succeeded", what="the job on the user's worker")
        wait_for(lambda: count_effects(engine, "plain", "5") == 1, what="the user's own task")
    with engine.connect() as conn:
        worker = conn.execute(text("SELECT worker FROM job_run WHERE run_id = :r"), {"r": run_id}).scalar()
    assert worker


def test_an_app_that_chose_late_acks_keeps_them_for_our_tasks_too() -> None:
    from celery import Celery

    from motir_celery import attach
    from motir_celery.core.current import make_current, peek

    app = Celery("late", broker="memory://", set_as_current=False)
    app.conf.update(task_acks_late=True, worker_prefetch_multiplier=4)
    publishing_through = peek()
    try:
        attach(app)
        assert app.tasks["motir.test.three-steps"].acks_late is True
        assert app.conf.worker_prefetch_multiplier == 4  # the user's setting, not ours
    finally:
        make_current(publishing_through)  # attach() made this memory:// app's engine current
