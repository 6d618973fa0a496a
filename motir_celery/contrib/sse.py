"""Server-sent events of a run's stream: the frames a browser's ``EventSource`` reads.

``events(reader, after)`` / ``aevents(reader, after)`` turn a ``StreamReader``'s follow
(core/producer/streams.py) into ``text/event-stream`` frames: one ``item`` event per item, its
``id`` the item's position (a browser that reconnects sends it back as ``Last-Event-ID``, and is
given only what is past it: no item twice), then one ``end`` event once the run has finished and
every item was sent. The helpers of ``contrib/starlette.py`` and ``contrib/django/streams.py`` wrap
them in their framework's streaming response; the dashboard's run page uses ``frame``.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Iterator

from motir_celery.core.producer.streams import StreamReader

__all__ = ["frame", "events", "aevents", "cursor", "MEDIA_TYPE", "HEADERS"]

MEDIA_TYPE = "text/event-stream"
#: Headers of an event stream: never cached, never buffered by a proxy (nginx reads the last).
HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


def frame(event: str, data: Any, *, id: int | str | None = None) -> bytes:
    """One event: its name, its data as one line of JSON, and its id when given."""
    head = f"id: {id}\n" if id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'), default=str)}\n\n".encode()


def cursor(last_event_id: str | None, after: int = -1) -> int:
    """Where to go on from: a reconnecting browser's ``Last-Event-ID`` (a position), else ``after``."""
    if last_event_id and last_event_id.strip().lstrip("-").isdigit():
        return max(int(last_event_id.strip()), after)
    return after


def events(reader: StreamReader, after: int = -1, *, timeout: float | None = None) -> Iterator[bytes]:
    """The frames of ``reader``'s items past ``after``, as they are written, then ``end``."""
    yield b": motir stream\n\n"  # a comment: the response starts at once
    for item in reader.follow(after, timeout=timeout):
        yield frame("item", {"position": item.position, "value": item.value}, id=item.position)
    yield frame("end", {"run_id": str(reader.run_id), "stream": reader.name})


async def aevents(reader: StreamReader, after: int = -1, *, timeout: float | None = None) -> AsyncIterator[bytes]:
    """``events`` for an asyncio server (never blocking its loop)."""
    yield b": motir stream\n\n"
    async for item in reader.afollow(after, timeout=timeout):
        yield frame("item", {"position": item.position, "value": item.value}, id=item.position)
    yield frame("end", {"run_id": str(reader.run_id), "stream": reader.name})
