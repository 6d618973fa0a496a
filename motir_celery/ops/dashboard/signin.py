"""The mechanics of a sign-in under attack: a failure back-off per key, and a bounded pool of verifier threads.

``Backoff`` counts the failed sign-ins of a key (a client address, a user name)
and says how long the key waits after its last failure before its next attempt:
nothing for the first ``free`` failures, then ``base`` seconds doubling up to
``cap``; one failure is forgotten per full ``forget_every`` seconds without one. It holds at most
``max_keys`` keys (the least recently failed go first), so an attacker cycling
addresses or names cannot grow it without limit.

``VerifierPool`` runs password verifications (argon2/scrypt, ~100 ms of CPU) on
a few threads, off the event loop, with a bounded wait list ordered by priority
(a client's failure count: a clean client goes first). When it is full a new
attempt is refused with ``Saturated`` — or, if it is cleaner than the worst one
waiting, that one is. ``auth.py`` wires both into basic mode; the model and its
numbers are in docs/security.md (*Sign-in under attack*).

In-process state on the monotonic clock: one dashboard process decides for
itself, and nothing here is compared with the database's time.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Generic, Hashable, TypeVar

__all__ = ["Backoff", "VerifierPool", "Saturated"]

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


@dataclass
class _Failures:
    count: int
    last: float  # monotonic time of the last failure


class Backoff(Generic[K]):
    """Failures per key and the wait they impose; thread-safe."""

    def __init__(self, *, free: int, base: float, cap: float, forget_every: float, max_keys: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if free < 1 or base <= 0 or cap < base or forget_every <= 0 or max_keys < 1:
            raise ValueError("Backoff: free >= 1, 0 < base <= cap, forget_every > 0, max_keys >= 1")
        self.free, self.base, self.cap, self.forget_every, self.max_keys = free, base, cap, forget_every, max_keys
        self._clock = clock
        self._keys: OrderedDict[K, _Failures] = OrderedDict()  # least recently failed first
        self._lock = threading.Lock()

    def _count(self, entry: _Failures, now: float) -> int:
        """The failures still remembered: one forgotten per full quiet ``forget_every``."""
        return max(0, entry.count - int((now - entry.last) // self.forget_every))

    def delay(self, count: int) -> float:
        """How long after its last failure a key with ``count`` failures waits."""
        if count < self.free:
            return 0.0
        return min(self.cap, self.base * 2.0 ** min(count - self.free, 32))

    def wait(self, key: K) -> float:
        """Seconds until ``key`` may try again (0: now)."""
        with self._lock:
            entry = self._keys.get(key)
            if entry is None:
                return 0.0
            return max(0.0, entry.last + self.delay(entry.count) - self._clock())

    def failures(self, key: K) -> int:
        """The failures ``key`` has now (after forgetting)."""
        with self._lock:
            entry = self._keys.get(key)
            return 0 if entry is None else self._count(entry, self._clock())

    def fail(self, key: K) -> tuple[float, bool]:
        """Count one failure of ``key``: (its wait now, whether this failure started its back-off)."""
        with self._lock:
            now = self._clock()
            entry = self._keys.pop(key, None)
            before = 0 if entry is None else self._count(entry, now)
            entry = _Failures(min(before + 1, self.free + 64), now)
            self._keys[key] = entry
            self._evict(now)
            return self.delay(entry.count), before < self.free <= entry.count

    def settle(self, key: K) -> float:
        """The failure counted ahead of a verification was answered now: the wait runs from here (a slow
        verification must not use up the wait before the client hears of it). Returns the wait."""
        with self._lock:
            entry = self._keys.get(key)
            if entry is None:
                return 0.0
            entry.last = self._clock()
            return self.delay(entry.count)

    def refund(self, key: K) -> None:
        """Take back one failure counted ahead of a verification that then succeeded."""
        with self._lock:
            entry = self._keys.get(key)
            if entry is None:
                return
            entry.count -= 1
            if entry.count <= 0:
                del self._keys[key]

    def _evict(self, now: float) -> None:
        # Forgotten keys at the front go for free; past the bound, the least recently failed.
        while self._keys:
            key, oldest = next(iter(self._keys.items()))
            if len(self._keys) <= self.max_keys and self._count(oldest, now) > 0:
                return
            del self._keys[key]

    def __len__(self) -> int:
        return len(self._keys)


class Saturated(Exception):
    """The pool's threads are busy and its wait list is full (or this attempt was pushed out of it)."""


@dataclass(order=True)
class _Job:
    priority: float
    seq: int
    work: Callable[[], object] = None  # type: ignore[assignment]
    future: Future[object] = None  # type: ignore[assignment]


class VerifierPool:
    """``threads`` verifier threads and at most ``waiting`` jobs waiting for one, lowest priority first."""

    def __init__(self, threads: int, waiting: int, *, name: str = "motir-signin") -> None:
        if threads < 1 or waiting < 0:
            raise ValueError("VerifierPool: threads >= 1, waiting >= 0")
        self.threads, self.waiting, self._name = threads, waiting, name
        self._heap: list[_Job] = []
        self._busy = 0
        self._started = False
        self._seq = itertools.count()
        self._cond = threading.Condition()

    @property
    def capacity(self) -> int:
        return self.threads + self.waiting

    def load(self) -> int:
        """Jobs running or waiting now."""
        with self._cond:
            return self._busy + len(self._heap)

    def submit(self, work: Callable[[], T], priority: float = 0.0) -> Future[T]:
        """Queue ``work``; ``Saturated`` at once if there is no room for it (never an unbounded wait)."""
        future: Future[T] = Future()
        job = _Job(priority, next(self._seq), work, future)  # type: ignore[arg-type]
        with self._cond:
            if not self._started:
                self._start()
            free_threads = self.threads - self._busy
            if len(self._heap) >= self.waiting + max(free_threads, 0):
                worst = max(self._heap) if self._heap else None
                if worst is None or worst.priority <= priority:
                    raise Saturated()
                self._heap.remove(worst)  # a dirtier attempt waiting gives its place to a cleaner one
                heapq.heapify(self._heap)
                worst.future.set_exception(Saturated())
            heapq.heappush(self._heap, job)
            self._cond.notify()
        return future

    def _start(self) -> None:
        for number in range(self.threads):
            threading.Thread(target=self._worker, name=f"{self._name}-{number}", daemon=True).start()
        self._started = True

    def _worker(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                job = heapq.heappop(self._heap)
                self._busy += 1
            if not job.future.set_running_or_notify_cancel():
                with self._cond:
                    self._busy -= 1
                continue
            result: object = None
            error: BaseException | None = None
            try:
                result = job.work()
            except BaseException as exc:  # noqa: BLE001 — handed to the waiting request
                error = exc
            # The thread is free before its answer is: the request that waited for it may send the
            # next one at once, and must find room.
            with self._cond:
                self._busy -= 1
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)

