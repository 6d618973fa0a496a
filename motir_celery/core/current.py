"""The current engine: the one lookup from code that has no engine handed to it.

``job.delay()``, ``job.s()`` and a result handle made without one ask ``current()``, as
Celery's ``shared_task`` asks for the current app. The engine is built elsewhere and made
current there: by ``attach(app)`` / ``create_app()`` (adapter), by the test kit for a
test's duration, and — when no code made one — by the default factory the package's face
names (``motir_celery/__init__.py``: an engine whose Celery app is built from the
environment on its first message). Everything else is handed the engine it works for.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

from motir_celery.errors import ConfigurationError

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine

__all__ = ["current", "default", "peek", "make_current", "use_default"]


class _Lookup:
    """The engine made current, the default one, and how to build it (a holder: no ``global`` rebinding)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.engine: Engine | None = None
        self.default: Engine | None = None
        self.factory: Callable[[], Engine] | None = None


_lookup = _Lookup()


def current() -> Engine:
    """The engine made current; the default one if none was."""
    engine = _lookup.engine
    return engine if engine is not None else default()


def default() -> Engine:
    """The default engine, built on first use: what ``current()`` is when no engine was made current,
    and the engine whose Celery app ``celery -A motir_celery`` runs."""
    engine = _lookup.default
    if engine is not None:
        return engine
    with _lookup.lock:
        if _lookup.default is None:
            if _lookup.factory is None:
                raise ConfigurationError("no motir engine: import motir_celery, or attach(app) a Celery app")
            _lookup.default = _lookup.factory()
        return _lookup.default


def peek() -> Engine | None:
    """The engine made current, if one was (None: ``current()`` is the default)."""
    return _lookup.engine


def make_current(engine: Engine | None) -> Engine | None:
    """Make ``engine`` current; returns the engine made current before, for a caller that restores it.
    None: the default again — built anew on its next use, from the environment as it is then."""
    with _lookup.lock:
        before, _lookup.engine = _lookup.engine, engine
        if engine is None:
            _lookup.default = None
    return before


def use_default(factory: Callable[[], Engine]) -> None:
    """How the default engine is built."""
    with _lookup.lock:
        _lookup.factory = factory
