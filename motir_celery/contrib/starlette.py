"""A run's stream as server-sent events from a Starlette (or FastAPI) app.

::

    from motir_celery.contrib.starlette import stream_response

    async def tokens(request):
        workspace = request.state.workspace            # whoever the caller is, in your app
        return stream_response(request, request.path_params["run_id"], "tokens", workspace_id=workspace)

The response follows the stream (contrib/sse.py: one ``item`` event per item, its id its position,
then ``end``), reading in ``workspace_id`` only under row-level security: a run of another
workspace is a 404, as one that does not exist. A browser that reconnects goes on past its
``Last-Event-ID``.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from starlette.responses import PlainTextResponse, Response, StreamingResponse

from motir_celery.contrib import sse
from motir_celery.core.current import current
from motir_celery.core.producer.streams import RunNotFound

if TYPE_CHECKING:
    from starlette.requests import Request

    from motir_celery.core.engine import Engine

__all__ = ["stream_response"]


def stream_response(request: Request, run_id: uuid.UUID | str, stream: str, *, workspace_id: str | None,
                    after: int = -1, timeout: float | None = None, engine: Engine | None = None) -> Response:
    """A ``text/event-stream`` response following run ``run_id``'s ``stream`` (a 404 when the run is
    not the workspace's)."""
    try:
        reader = (engine or current()).stream(run_id, stream, workspace_id=workspace_id)
        reader.read(limit=1)  # found in this workspace, or a 404 now rather than an empty stream
    except (RunNotFound, ValueError):
        return PlainTextResponse("no such run", status_code=404)
    start = sse.cursor(request.headers.get("last-event-id"), after)
    return StreamingResponse(sse.aevents(reader, start, timeout=timeout), media_type=sse.MEDIA_TYPE,
                             headers=sse.HEADERS)
