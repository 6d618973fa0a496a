"""Progress and streams of a run, the reader's side: ``RunHandle.progress``, ``RunHandle.stream(name)``.

``StreamReader`` reads one stream of one run, from any process:

* ``read(after=-1, offset=0, limit=1000)``: the items past position ``after`` (or skipping the first
  ``offset`` of them), in order, as ``StreamItem(position, value, attempt)``;
* ``follow(after=-1)`` (also ``iter(reader)``): every item past ``after`` as it is written, until the
  run has finished and every item is read; ``afollow`` (``async for``) the same for asyncio code.
  A follower keeps its cursor (the last position it gave) and asks only for what is past it, so it
  gives each position once, in order — through a crash and the re-run too (core/worker/streams.py
  says exactly what a reader sees when a re-run writes other items than the first run did).

Reads are the result handle's: in the reader's workspace under the app role with row-level
security (a system run's through the engine login), the statement naming the workspace too; another
workspace's run is not found (``RunNotFound``), never its items.

**Following.** A follower waits for its run's notifications (store/listen.py: one LISTEN
connection per process, on the engine's URL) and reads again when one comes, or after
``FALLBACK`` seconds at the latest. Behind a transaction pooler (PgBouncer in transaction mode,
found by the engine's probe), where LISTEN cannot work, it polls: every ``FIRST_POLL`` seconds,
×1.5 while nothing comes, at most ``MAX_POLL`` apart. A finished run, once its last items are read,
ends the iteration; a run queued again (a retry, a sleep) is followed on.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator

from motir_celery.errors import MotirError
from motir_celery.store.db import validate_workspace_id
from motir_celery.store.listen import FALLBACK
from motir_celery.store.sql import reads as reads_sql

if TYPE_CHECKING:
    from motir_celery.core.engine import Engine
    from motir_celery.store.driver import Conn

__all__ = ["StreamReader", "StreamItem", "Progress", "RunNotFound", "read_progress", "FINAL", "FIRST_POLL",
           "MAX_POLL", "BATCH"]

#: A run's final states: its streams get nothing more.
FINAL = frozenset({"succeeded", "failed", "cancelled"})
#: Polling (no LISTEN: behind a transaction pooler): the first pause, its ceiling (seconds).
FIRST_POLL, MAX_POLL = 0.02, 0.1
#: Items read in one statement at most.
BATCH = 1000


@dataclass
class _Pace:
    """How long a follower waits for the next notification: ``FALLBACK`` while it listens, else a
    poll that backs off while nothing comes; never past the caller's deadline."""

    what: str
    timeout: float | None
    pause: float = FIRST_POLL
    deadline: float | None = None

    def __post_init__(self) -> None:
        self.deadline = None if self.timeout is None else time.monotonic() + self.timeout

    def came(self) -> None:
        """Items came: the next poll is soon again."""
        self.pause = FIRST_POLL

    def wait(self, listening: bool) -> float:
        """The next wait (seconds); ``TimeoutError`` once the deadline has passed."""
        wait = FALLBACK if listening else self.pause
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.what}: not ended after {self.timeout}s")
            wait = min(wait, left)
        if not listening:
            self.pause = min(self.pause * 1.5, MAX_POLL)
        return wait


class RunNotFound(MotirError, LookupError):
    """No run of that id in the reader's workspace (another workspace's is not found), or not yet
    committed."""


@dataclass(frozen=True)
class StreamItem:
    """One item of a stream: its position (``segment * 10**9 + order``, core/worker/streams.py),
    its value, and the attempt that wrote it."""

    position: int
    value: Any
    attempt: int


@dataclass(frozen=True)
class Progress:
    """A run's latest progress report and its streams (``RunHandle.progress``)."""

    run_state: str
    #: The reported state (``PROGRESS``...) and meta; None when the run never reported one.
    state: str | None
    meta: Any
    #: The attempt that reported it, and when (the database's clock).
    attempt: int | None
    updated_at: datetime | None
    #: The report is the running attempt's own (what ``AsyncResult(id).state`` shows).
    current: bool
    #: The run's stream names, in the order first written, and what they hold.
    streams: tuple[str, ...]
    stream_items: int
    stream_bytes: int


@contextmanager
def reading(engine: Engine, workspace_id: str | None) -> Iterator[Conn]:
    """A connection that reads in ``workspace_id`` only: the app role under row-level security, or
    (a system run's, or while a framework lends its connection) the engine login, the statements
    naming the workspace either way (``results.read_result`` reads the same way)."""
    if workspace_id is not None and engine.lent() is None:
        with engine.session(workspace_id) as session:
            yield session.connection()
        return
    with engine.pool().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        yield conn


def read_progress(engine: Engine, run_id: uuid.UUID, workspace_id: str | None) -> Progress | None:
    """The run's progress and streams, in ``workspace_id`` only; None: no such run there."""
    with reading(engine, workspace_id) as conn:
        row = reads_sql.run_progress(conn, run_id, workspace_id)
    if row is None:
        return None
    current = row["run_state"] == "running" and row["state"] is not None and row["attempt"] == row["attempts"]
    return Progress(row["run_state"], row["state"], row["meta"], row["attempt"], row["updated_at"], current,
                    tuple(row["streams"]), int(row["stream_items"]), int(row["stream_bytes"]))


class StreamReader:
    """One stream of one run, read from any process (the module docstring)."""

    def __init__(self, engine: Engine, run_id: uuid.UUID | str, name: str, *, workspace_id: str | None = None) -> None:
        self.engine = engine
        self.run_id = run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))
        self.name = name
        self.workspace_id = validate_workspace_id(workspace_id)

    def __repr__(self) -> str:
        return f"<StreamReader {self.name!r} of run {self.run_id}>"

    def page(self, after: int = -1, *, offset: int = 0, limit: int = BATCH) -> tuple[str, list[StreamItem]]:
        """(the run's state, its items past ``after``) in one snapshot; ``RunNotFound`` if not visible."""
        if isinstance(after, bool) or not isinstance(after, int):
            raise TypeError(f"after must be a position (an int), got {after!r:.60}")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be a whole number >= 0, got {offset!r:.60}")
        limit = max(1, min(int(limit), BATCH))
        with reading(self.engine, self.workspace_id) as conn:
            state, found = reads_sql.stream_items(conn, self.run_id, self.workspace_id, self.name, after=after,
                                                  offset=offset, limit=limit)
        if state is None:
            raise RunNotFound(f"no run {self.run_id} in workspace {self.workspace_id!r} (or not committed yet)")
        return state, [StreamItem(r["position"], r["item"], r["attempt"]) for r in found]

    def read(self, after: int = -1, *, offset: int = 0, limit: int = BATCH) -> list[StreamItem]:
        """The items past position ``after`` (skipping the first ``offset`` of those), at most
        ``limit`` (1 to 1000), in order."""
        return self.page(after, offset=offset, limit=limit)[1]

    def follow(self, after: int = -1, *, offset: int = 0, timeout: float | None = None) -> Iterator[StreamItem]:
        """Every item past ``after`` (after skipping ``offset``), as it is written, until the run has
        finished and all are read (``timeout``: ``TimeoutError`` when it has not ended by then)."""
        pace = _Pace(f"stream {self.name!r} of run {self.run_id}", timeout)
        woken = threading.Event()
        cursor, skip = after, offset
        state, items = self.page(cursor, offset=skip)  # first: the run exists, and the engine has probed
        listener = self.engine.listener()
        handle = listener.follow(self.run_id, woken.set) if listener is not None else None
        woken.set()  # read once more at once: what was written before the LISTEN took effect
        try:
            while True:
                for item in items:
                    cursor = item.position
                    yield item
                if items:
                    skip = 0
                    pace.came()
                    if len(items) == BATCH:
                        woken.clear()
                        state, items = self.page(cursor)
                        continue
                elif state in FINAL:
                    return
                woken.wait(pace.wait(handle is not None and handle.listening))
                woken.clear()
                state, items = self.page(cursor, offset=skip)
        finally:
            if handle is not None:
                handle.close()

    def __iter__(self) -> Iterator[StreamItem]:
        return self.follow()

    async def afollow(self, after: int = -1, *, offset: int = 0,
                      timeout: float | None = None) -> AsyncIterator[StreamItem]:
        """``follow`` for asyncio code: reads in a thread, waits on the loop (never blocking it)."""
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()
        pace = _Pace(f"stream {self.name!r} of run {self.run_id}", timeout)
        cursor, skip = after, offset
        state, items = await asyncio.to_thread(self.page, cursor, offset=skip)
        listener = await asyncio.to_thread(self.engine.listener)

        def wake() -> None:
            loop.call_soon_threadsafe(woken.set)

        handle = await asyncio.to_thread(listener.follow, self.run_id, wake) if listener is not None else None
        woken.set()  # read once more at once: what was written before the LISTEN took effect
        try:
            while True:
                for item in items:
                    cursor = item.position
                    yield item
                if items:
                    skip = 0
                    pace.came()
                    if len(items) == BATCH:
                        woken.clear()
                        state, items = await asyncio.to_thread(self.page, cursor)
                        continue
                elif state in FINAL:
                    return
                wait = pace.wait(handle is not None and handle.listening)  # its TimeoutError is the caller's
                try:
                    await asyncio.wait_for(woken.wait(), wait)
                except asyncio.TimeoutError:
                    pass
                woken.clear()
                state, items = await asyncio.to_thread(self.page, cursor, offset=skip)
        finally:
            if handle is not None:
                handle.close()

    def __aiter__(self) -> AsyncIterator[StreamItem]:
        return self.afollow()
