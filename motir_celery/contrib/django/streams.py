"""A run's stream as server-sent events from a Django view.

::

    from motir_celery.contrib.django.streams import stream_response

    def tokens(request, run_id):
        return stream_response(request, run_id, "tokens", workspace_id=request.user.profile.workspace_id)

The response follows the stream (contrib/sse.py: one ``item`` event per item, its id its position,
then ``end``), reading in ``workspace_id`` only under row-level security: a run of another
workspace is a 404. Under ASGI (``async def`` views, Django 4.2+) it streams from an async iterator
and holds no thread; under WSGI it holds one worker thread while it follows. A browser that
reconnects goes on past its ``Last-Event-ID``.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from django.http import Http404, StreamingHttpResponse

from motir_celery.contrib import sse
from motir_celery.core.current import current
from motir_celery.core.producer.streams import RunNotFound

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine

__all__ = ["stream_response"]


def stream_response(request: Any, run_id: uuid.UUID | str, stream: str, *, workspace_id: str | None,
                    after: int = -1, timeout: float | None = None, asynchronous: bool | None = None,
                    engine: Engine | None = None) -> StreamingHttpResponse:
    """A ``text/event-stream`` response following run ``run_id``'s ``stream``; ``Http404`` when the run
    is not the workspace's. ``asynchronous``: an async iterator (ASGI); default: when the request is
    an ASGI one."""
    try:
        reader = (engine or current()).stream(run_id, stream, workspace_id=workspace_id)
        reader.read(limit=1)
    except (RunNotFound, ValueError):
        raise Http404("no such run") from None
    start = sse.cursor(request.headers.get("Last-Event-ID"), after)
    if asynchronous is None:
        asynchronous = type(request).__name__ == "ASGIRequest"
    body = sse.aevents(reader, start, timeout=timeout) if asynchronous else sse.events(reader, start, timeout=timeout)
    response = StreamingHttpResponse(body, content_type=sse.MEDIA_TYPE)
    for name, value in sse.HEADERS.items():
        response[name] = value
    return response
