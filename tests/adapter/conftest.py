"""Fixtures the adapter's real-worker tests share."""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import redis

from motir_celery.adapter.guard import MALFORMED_SUFFIX


@pytest.fixture
def queue(broker_url: str) -> Iterator[str]:
    """The session's queue on Redis, it and its list of moved-aside (malformed) items emptied before
    and after."""
    name = os.environ["MOTIR_QUEUE"]
    client = redis.Redis.from_url(broker_url)
    client.delete(name, name + MALFORMED_SUFFIX)
    yield name
    client.delete(name, name + MALFORMED_SUFFIX)
    client.close()
