"""Which engine a Celery app hosts: what the adapter's parts ask to find the engine of the app
they serve (a task's run, the worker's side duties, the result backend, the beat).

The app carries it (``app.motir_engine``, set by ``attach``); an app that never attached answers
with the current engine (``core/current.py``), as a Celery app without our tasks has no other.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from motir_celery.core.current import current
from motir_celery.core.engine import Engine

__all__ = ["host", "engine_of", "hosts", "ATTRIBUTE"]

#: The attribute of a Celery app that holds the engine it hosts.
ATTRIBUTE = "motir_engine"


def host(app: Celery, engine: Engine) -> None:
    """``app`` hosts ``engine`` from now on."""
    setattr(app, ATTRIBUTE, engine)


def hosts(app: Any) -> Engine | None:
    """The engine ``app`` was attached to, or None."""
    found = getattr(app, ATTRIBUTE, None)
    return found if isinstance(found, Engine) else None


def engine_of(app: Any) -> Engine:
    """The engine ``app`` hosts; the current one for an app that never attached."""
    found = hosts(app)
    return found if found is not None else current()
