"""Send a step's held record when its handler is inside a longer body.

``Step`` holds a finished step's record for up to ``steps.MAX_LAG``, so that the
records of fast steps travel together, in the next record or in the settle
(docs/jobs.md, "Steps"). The handler is the one that sends them,
at its next step boundary; but a body that takes longer than ``MAX_LAG`` would
keep the records of the steps before it in this process's memory for as long as
it runs, where a crash of the worker loses them. This thread sends them instead,
``MAX_LAG`` after the oldest of them finished, while the body runs.

One daemon thread per process, started on first use and again in a forked child
(threads do not survive a fork). A handler arms it when it starts holding records
(the first record held since the last send), which wakes the thread only when it
was idle or due later; nothing disarms it: a thread that wakes to find the records
gone (the handler sent them itself) goes back to sleep.
REJECTED: a ``threading.Timer`` per record (a thread start per step) and SIGALRM
(Celery's time limits and user code may own it).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import threading
import time
from typing import Protocol

__all__ = ["Holder", "arm"]

log = logging.getLogger(__name__)


class Holder(Protocol):
    def send_held(self) -> None:
        """Send the records held, if any; called on the flusher's thread."""


class _Flusher:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the two fields below
        self._due: list[tuple[float, int, Holder]] = []  # a heap: (monotonic deadline, tiebreak, holder)
        self._asleep_until = math.inf  # when the thread wakes next on its own
        # Released to wake the thread early: a plain lock used as a binary semaphore,
        # cheaper than a Condition on this per-run path.
        self._wake = threading.Lock()
        self._wake.acquire()
        self._order = itertools.count()
        self.pid = os.getpid()
        threading.Thread(target=self._loop, name="motir-step-flusher", daemon=True).start()

    def arm(self, holder: Holder, deadline: float) -> None:
        with self._lock:
            heapq.heappush(self._due, (deadline, next(self._order), holder))
            wake = deadline < self._asleep_until
            if wake:
                self._asleep_until = deadline
        if wake:
            try:
                self._wake.release()
            except RuntimeError:
                pass  # released already, not yet taken: the thread is about to look

    def _loop(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                due = []
                while self._due and self._due[0][0] <= now:
                    due.append(heapq.heappop(self._due)[2])
                self._asleep_until = self._due[0][0] if self._due else math.inf
                timeout = self._asleep_until - now if self._due else -1
            for holder in due:
                try:
                    holder.send_held()
                except Exception:  # noqa: BLE001 — the holder keeps the error for its own thread
                    log.exception("step flusher: sending held step records failed")
            if not due:
                self._wake.acquire(timeout=timeout)


_flusher: _Flusher | None = None
_lock = threading.Lock()


def arm(holder: Holder, deadline: float) -> None:
    """Call ``holder.send_held()`` on this process's flusher thread at ``deadline``
    (``time.monotonic()``), unless the holder has sent its records by then."""
    global _flusher
    flusher = _flusher
    if flusher is None or flusher.pid != os.getpid():
        with _lock:
            if _flusher is None or _flusher.pid != os.getpid():
                _flusher = _Flusher()
            flusher = _flusher
    flusher.arm(holder, deadline)
