"""Waking stream followers: one LISTEN connection per process and URL, shared by every follower.

A writer of progress or stream items notifies its run's channel at commit (store/sql/worker.py,
``pg_notify``); a follower (core/producer/streams.py) waits on ``Listener.follow(run_id)``, which
wakes it when a notification for that run arrives. One thread and one connection serve all the
followers of a process: it LISTENs on a run's channel while somebody here follows it
(``motir_listen``, migration 0019), and waits on its socket and on a pipe that tells it of new
followers, never on a timer.

Not behind a transaction pooler: LISTEN is the state of a server session, which PgBouncer in
transaction mode hands to another client after each transaction, so a notification would reach
nobody, or someone else. There the follower polls instead (core/producer/streams.py asks
``pooler.found`` of the engine it reads through). And a follower never relies on a notification
alone: it reads again at least every ``FALLBACK`` seconds, so a notification lost with a broken
listener connection (or a pooler nobody detected) costs latency, never an item.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import uuid
from typing import Any, Callable

import psycopg

from motir_celery.store.pg import BorrowedConnection
from motir_celery.store.sql import reads

__all__ = ["Listener", "Following", "FALLBACK"]

log = logging.getLogger("motir_celery.listen")

#: A listening follower reads again after this many seconds without a notification.
FALLBACK = 1.0
#: How long ``follow`` waits for its LISTEN to be in force before it goes on (polling meanwhile).
SUBSCRIBE_WAIT = 2.0


class _Follow:
    """One run followed in this process: who to wake, and whether its LISTEN is in force."""

    def __init__(self) -> None:
        self.wakers: list[Callable[[], None]] = []
        self.listening = threading.Event()


class Listener:
    """The LISTEN connection of one process to one URL (``store/db.py`` makes one per process)."""

    def __init__(self, conninfo: str, connect_args: dict[str, Any]) -> None:
        self.conninfo = conninfo
        self.connect_args = dict(connect_args)
        self._lock = threading.Lock()
        self._runs: dict[uuid.UUID, _Follow] = {}
        self._changed: set[uuid.UUID] = set()  # runs to LISTEN to or UNLISTEN, for the thread
        self._thread: threading.Thread | None = None
        self._pipe: tuple[int, int] | None = None
        self._closed = False
        #: The last failure of the listener connection (None: it works, or has not been tried).
        self.failure: str | None = None

    def follow(self, run_id: uuid.UUID, wake: Callable[[], None]) -> Following:
        """Call ``wake()`` (from the listener's thread) whenever ``run_id``'s channel is notified,
        until the handle is closed. ``handle.listening``: the LISTEN is in force."""
        with self._lock:
            entry = self._runs.get(run_id)
            if entry is None:
                entry = self._runs[run_id] = _Follow()
                self._changed.add(run_id)
            entry.wakers.append(wake)
            self._start()
        self._poke()
        entry.listening.wait(SUBSCRIBE_WAIT)
        return Following(self, run_id, wake, entry)

    def leave(self, run_id: uuid.UUID, wake: Callable[[], None]) -> None:
        with self._lock:
            entry = self._runs.get(run_id)
            if entry is None:
                return
            if wake in entry.wakers:
                entry.wakers.remove(wake)
            if not entry.wakers:
                del self._runs[run_id]
                self._changed.add(run_id)
        self._poke()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._poke()

    # --- the thread -------------------------------------------------------------------------

    def _start(self) -> None:
        """Under the lock: the thread, if it is not running."""
        if self._thread is not None and self._thread.is_alive():
            return
        if self._pipe is None:
            self._pipe = os.pipe()
            os.set_blocking(self._pipe[0], False)
        self._changed.update(self._runs)  # a new connection listens to nothing yet
        self._thread = threading.Thread(target=self._run, name="motir-listener", daemon=True)
        self._thread.start()

    def _poke(self) -> None:
        if self._pipe is not None:
            try:
                os.write(self._pipe[1], b"x")
            except OSError:  # the pipe is full: the thread will wake anyway
                pass

    def _run(self) -> None:
        try:
            with psycopg.connect(self.conninfo, **{**self.connect_args, "autocommit": True,
                                                    "prepare_threshold": None}) as raw:
                raw.add_notify_handler(lambda n: self._notified(n.channel))
                self.failure = None
                self._serve(raw)
        except Exception as exc:  # noqa: BLE001 — followers fall back to reading every FALLBACK
            self.failure = f"{type(exc).__name__}: {exc}"
            log.warning("the stream listener's connection failed (%s); followers poll until it is back",
                        self.failure)
        finally:
            with self._lock:
                entries = list(self._runs.values())
                self._thread = None
            for entry in entries:
                entry.listening.clear()
                for wake in list(entry.wakers):
                    _wake(wake)  # read again now, then poll

    def _serve(self, raw: psycopg.Connection[Any]) -> None:
        conn = BorrowedConnection(raw)
        assert self._pipe is not None
        pipe = self._pipe[0]
        while True:
            with self._lock:
                if self._closed:
                    return
                changed, self._changed = self._changed, set()
                wanted = {run_id: self._runs.get(run_id) for run_id in changed}
            for run_id, entry in wanted.items():
                reads.listen_run(conn, run_id, listen=entry is not None)
                if entry is not None:
                    entry.listening.set()
            ready, _, _ = select.select([raw.fileno(), pipe], [], [], 60.0)
            if pipe in ready:
                try:
                    os.read(pipe, 4096)
                except BlockingIOError:
                    pass
            if raw.fileno() in ready or not ready:
                raw.pgconn.consume_input()
                if raw.pgconn.status != psycopg.pq.ConnStatus.OK:
                    raise psycopg.OperationalError("the listener's connection was lost")
                while (n := raw.pgconn.notifies()) is not None:
                    self._notified(n.relname.decode())

    def _notified(self, channel: str) -> None:
        try:
            run_id = uuid.UUID(hex=channel.removeprefix("motir_s_"))
        except ValueError:
            return
        with self._lock:
            entry = self._runs.get(run_id)
            wakers = list(entry.wakers) if entry is not None else []
        for wake in wakers:
            _wake(wake)


class Following:
    """A follow of one run: ``listening`` while its LISTEN is in force; ``close()`` ends it."""

    def __init__(self, listener: Listener, run_id: uuid.UUID, wake: Callable[[], None], entry: _Follow) -> None:
        self.listener, self.run_id, self.wake, self.entry = listener, run_id, wake, entry

    @property
    def listening(self) -> bool:
        return self.entry.listening.is_set()

    def close(self) -> None:
        self.listener.leave(self.run_id, self.wake)

    def __enter__(self) -> Following:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wake(wake: Callable[[], None]) -> None:
    """Wake one follower; one that cannot be woken any more (its event loop closed) is its own affair."""
    try:
        wake()
    except Exception as exc:  # noqa: BLE001 — the listener serves the other followers all the same
        log.debug("a stream follower could not be woken: %s", exc)
