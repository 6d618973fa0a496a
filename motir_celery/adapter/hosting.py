"""Which engine each Celery app hosts: what the adapter's parts ask to find the engine of the app
they serve (a task's run, the worker's side duties, the result backend, the beat).

``attach(app)`` records it (``adapter/celery_app.py``); an app that never attached answers with
the current engine (``core/current.py``), as a Celery app without our tasks has no other.
"""

from __future__ import annotations

import weakref

from celery import Celery

from motir_celery.core.current import current
from motir_celery.core.engine import Engine

__all__ = ["host", "engine_of", "hosts"]

_engines: "weakref.WeakKeyDictionary[Celery, Engine]" = weakref.WeakKeyDictionary()


def host(app: Celery, engine: Engine) -> None:
    """``app`` hosts ``engine`` from now on."""
    _engines[app] = engine


def hosts(app: Celery) -> Engine | None:
    """The engine ``app`` was attached to, or None."""
    return _engines.get(app)


def engine_of(app: Celery) -> Engine:
    """The engine ``app`` hosts; the current one for an app that never attached."""
    found = _engines.get(app)
    return found if found is not None else current()
