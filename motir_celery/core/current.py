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

__all__ = ["current", "peek", "make_current", "use_default"]


class _Lookup:
    """The current engine, and how to build the default one (a holder: no ``global`` rebinding)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.engine: Engine | None = None
        self.default: Callable[[], Engine] | None = None


_lookup = _Lookup()


def current() -> Engine:
    """The current engine; the default one, built now, if none was made current."""
    engine = _lookup.engine
    if engine is not None:
        return engine
    with _lookup.lock:
        if _lookup.engine is None:
            if _lookup.default is None:
                raise ConfigurationError("no motir engine: import motir_celery, or attach(app) a Celery app")
            _lookup.engine = _lookup.default()
        return _lookup.engine


def peek() -> Engine | None:
    """The current engine if one is, without building the default."""
    return _lookup.engine


def make_current(engine: Engine | None) -> Engine | None:
    """Make ``engine`` current (None: the default is built again on the next ``current()``);
    returns the engine current before, for a caller that restores it."""
    with _lookup.lock:
        before, _lookup.engine = _lookup.engine, engine
    return before


def use_default(factory: Callable[[], Engine]) -> None:
    """How ``current()`` builds an engine when none was made current."""
    with _lookup.lock:
        _lookup.default = factory
