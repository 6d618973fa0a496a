"""Fifty jobs subscribed to one event, for the fan-out section.

Imported by the bench driver only (workers never see these jobs: the section
measures ``send_event``, which writes the event and its 50 runs and publishes
50 messages; the section purges them afterwards).
"""

from __future__ import annotations

from typing import Any

from motir_celery import define_job

SUBSCRIBERS = 50
EVENT = "bench.fanout"


def _make(i: int) -> None:
    def handler(event: Any, step: Any) -> None:
        return None

    handler.__name__ = handler.__qualname__ = f"fanout_{i:02d}"
    define_job(f"bench.fanout.{i:02d}", event=EVENT, retry_policy="transient")(handler)


for _i in range(SUBSCRIBERS):
    _make(_i)
