"""Scenario 3, shortened: a private Redis restarted mid-workload, its messages dropped.

Regressions kept here:

* ``send_event`` used to raise when the broker refused the publish that follows
  its commit, so a caller was told "failed" for an event that was recorded (and,
  retrying without an idempotency key, would have created it twice). The feeder
  counts such events (``raised_after_commit``): a problem, so ``assert_ok`` fails.
* ``create_app(settings)`` used to publish to ``$CELERY_BROKER_URL`` whatever
  ``settings.broker_url`` said (Celery reads the variable before its own config).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import redis

from motir_celery.adapter.celery_app import create_app
from motir_celery.adapter.messages import engine_of
from motir_celery.dev.private import PrivateRedis
from motir_celery.settings import Settings
from tests.chaos.scenarios import Base, broker_restart


def test_redis_restart_without_persistence_loses_no_run(chaos: Base) -> None:
    result = broker_restart(chaos, broker="redis", runs=100, workers=2, rate=20, restarts=1, down_for=3.0)
    print(result.summary())
    result.assert_ok()
    assert result.runs == 100 and result.succeeded == 100


def test_an_app_built_from_settings_publishes_to_their_broker_not_the_environment_s(
        tmp_path: Path, database_url: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    ours = PrivateRedis(tmp_path / "redis").start()
    try:
        monkeypatch.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:1/0")  # nothing listens there
        # The database too: a publish asks admission first (no job_admission row: sent at once).
        settings = Settings(database_url=database_url, broker_url=ours.url, queue=f"chaos-{uuid.uuid4().hex[:6]}")
        engine_of(create_app(settings)).publish(uuid.uuid4(), "chaos.work", 0.0)
        assert redis.Redis.from_url(ours.url).llen(settings.queue) == 1
    finally:
        ours.close()
