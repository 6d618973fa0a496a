"""A user's own Celery app, hosting the engine with one call (tests/test_attach.py)."""

from __future__ import annotations

import os

from celery import Celery

import motir_celery

app = Celery("userproj", broker=os.environ["CELERY_BROKER_URL"])
app.conf.task_default_queue = os.environ.get("MOTIR_QUEUE", "celery")
app.conf.task_ignore_result = True
motir_celery.attach(app)


@app.task(name="userproj.add")
def add(key: str, x: int, y: int) -> None:
    """The user's own plain task, which must keep working beside the engine's."""
    import psycopg

    with psycopg.connect(os.environ["MOTIR_DATABASE_URL"].replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute("INSERT INTO test.side_effect (run_id, step) VALUES (%s, %s)", (key, str(x + y)))
