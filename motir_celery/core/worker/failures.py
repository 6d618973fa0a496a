"""A handler's error, made storable before it reaches a statement.

Whatever a handler raised becomes the ``error`` / ``failure`` JSON of its
attempt and DLQ entry. Postgres refuses a NUL and a lone surrogate in jsonb, and
an unbounded message would become an unbounded row and log line, so every text
is cleaned (both replaced by U+FFFD) and bounded here; ``str(exc)`` that itself
raises is replaced by its ``repr`` of the type.
"""

from __future__ import annotations

import json
import re
import traceback
from typing import Any

__all__ = ["storable_error", "describe", "bounded", "clean", "MAX_MESSAGE", "MAX_TRACEBACK"]

#: The longest stored message and log text, and the stored traceback's tail, in characters.
MAX_MESSAGE = 2000
MAX_TRACEBACK = 8000

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def clean(text: str) -> str:
    """``text`` without what jsonb refuses (NUL, lone surrogates)."""
    return _UNSTORABLE.sub("\ufffd", text)


def bounded(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` cleaned and cut to ``limit`` characters (the cut said so)."""
    if len(text) > limit:
        text = text[:limit] + f"... [{len(text) - limit} more characters]"
    return clean(text)


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 — a __str__ that raises still gets its failure stored
        return f"<{type(exc).__name__}: str() failed>"


def describe(exc: BaseException) -> str:
    """``Type: message``, bounded and clean, for a log line."""
    return bounded(f"{type(exc).__name__}: {_message(exc)}")


def storable_error(exc: BaseException) -> str:
    """The JSON stored for a failed attempt: type, bounded message, traceback tail.

    An exception may say what it stands for with ``__motir_error__()`` -> dict: its
    ``type`` and ``message`` replace the exception's own, any other JSON field is kept
    (a canvas's failure is its failed member's error, plus which member: worker/canvas.py)."""
    own = _own_error(exc)
    try:
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    except Exception:  # noqa: BLE001 — formatting calls str(exc) too
        lines = traceback.format_tb(exc.__traceback__)
    # Each line is cut first: a 10 MB message must not be copied whole into the traceback.
    tb = "".join(bounded(line, MAX_MESSAGE) for line in lines)
    stored: dict[str, Any] = {
        "type": clean(f"{type(exc).__module__}.{type(exc).__qualname__}"),
        "message": bounded(_message(exc)),
        "traceback": clean(tb[-MAX_TRACEBACK:]),
    }
    if own:
        stored.update(own)
        stored["type"], stored["message"] = clean(str(stored["type"])), bounded(str(stored["message"]))
        stored["traceback"] = clean(str(stored["traceback"])[-MAX_TRACEBACK:])
    return json.dumps(stored)


def _own_error(exc: BaseException) -> dict[str, Any] | None:
    """``exc.__motir_error__()`` when it gives a JSON-storable dict (else None: the default)."""
    said = getattr(exc, "__motir_error__", None)
    if not callable(said):
        return None
    try:
        own = said()
        json.dumps(own, allow_nan=False)
    except Exception:  # noqa: BLE001 — a broken hook must not make the settle fail
        return None
    return own if isinstance(own, dict) else None
