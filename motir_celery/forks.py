"""One fork-safety helper for the state a process must not share with its parent.

Celery's prefork pool forks worker children from a process that may already
hold a lease registry, an engine thread or a client; none of them is valid in
the child (threads do not survive a fork; a lock may have been held at that
instant). ``per_process(factory)`` gives a getter that makes one value per
process, on first use, and forgets the parent's in a forked child — without
touching it, since the parent still owns whatever it holds (``inherited``
keeps it referenced, so the garbage collector does not close it either).
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Generic, TypeVar

__all__ = ["per_process", "PerProcess"]

T = TypeVar("T")

#: Values made in a parent process, kept referenced in the child and never used.
inherited: list[object] = []


class PerProcess(Generic[T]):
    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._value: T | None = None
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def __call__(self) -> T:
        value = self._value
        if value is None:
            with self._lock:
                if self._value is None:
                    self._value = self._factory()
                value = self._value
        return value

    def peek(self) -> T | None:
        """This process's value if it was made, without making it."""
        return self._value

    def _forget(self) -> None:
        if self._value is not None:
            inherited.append(self._value)
        self._value = None
        self._lock = threading.Lock()


def per_process(factory: Callable[[], T]) -> PerProcess[T]:
    """A getter of one ``factory()`` per process (see the module docstring)."""
    return PerProcess(factory)
