"""Progress and streams of a running run, the writer's side: ``step.progress`` and ``step.stream``.

**Progress.** ``step.progress(meta, state="PROGRESS")`` stores the run's latest report (one row per
run, ``job_progress``), fenced on the claim like a step record: a worker that lost the run gets
``LostClaim`` / ``RunCancelled`` there. A durable Celery task's ``self.update_state(state=...,
meta=...)`` comes here too (adapter/tasks.py). Readers (``AsyncResult(id).state`` / ``.info``,
``RunHandle``, the dashboard, ``motir runs show``) show the report while the attempt that made it
runs.

**Streams.** ``step.stream("tokens").write(x)`` appends ``x`` to the run's stream ``tokens``;
``write_many(xs)`` several in one statement. Each item gets a **position derived from where it
was written**: the handler's segment — a step's body, or the code between two steps (before the
first, after the last), counted in the order the handler reaches them — and its order within the
segment (``position = segment * POSITION_STRIDE + n``). A handler reaches its steps in the same
order on every attempt (that is what makes step ids memo keys), so an attempt that runs a segment
again after a crash writes the same positions again: **a re-run overwrites, it never appends**.

What a reader sees (core/producer/streams.py reads in position order, from a cursor):

* items of a segment that completed (its step's record committed) never change: that body never
  runs again;
* a re-run of a segment (the step that was running when the worker died, and the code between
  steps, which runs again on every attempt) writes its items at the positions the first run used.
  A follower that read position ``p`` before the crash is never given ``p`` again: it goes on
  past its cursor. Items are delivered once each, in order. When the re-run writes the same items
  (a deterministic body), every reader sees each item exactly once, whenever it started;
* when the re-run writes *other* items (a model's next answer), a follower that was reading
  across the crash saw the first run's items up to its cursor and the re-run's after it; a reader
  that starts after the end sees only the re-run's (its first run's items past the re-run's last
  in that segment are deleted when the segment ends: ``STREAM_TRIM``, sent after the step's record
  commits, never between the body and its record, so the window in which a finished step runs
  again is not widened; a worker that dies between the two leaves them). A segment the re-run
  writes nothing to keeps the first run's items.

**Cost and what a crash costs.** Every write is one statement and one commit on the attempt's
connection, which does not wait for the WAL flush (store/sql/worker.py, above ``PROGRESS``): a
crash of Postgres itself can lose the last fraction of a second of progress and items, only ever
of the segment in progress (which runs again when the run is reclaimed), never one before a
step's committed record. Progress is advisory; a step's record is not.

**Bounds.** An item or a meta is JSON of at most ``MOTIR_MAX_PAYLOAD_BYTES``; a run's streams
hold at most ``MOTIR_MAX_STREAM_BYTES`` (each item counted with 64 bytes for its row) in at most
``MAX_STREAMS`` names, decided by the write itself; past that, ``StreamFull`` and nothing stored.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterable

from motir_celery.errors import StreamFull
from motir_celery.store.sql import worker as worker_sql

if TYPE_CHECKING:
    from motir_celery.core.worker.steps import Step

__all__ = ["Output", "StreamWriter", "POSITION_STRIDE", "MAX_STREAMS", "MAX_STREAM_NAME", "DEFAULT_STATE",
           "check_state", "check_stream_name"]

#: A position is ``segment * POSITION_STRIDE + order``: at most this many items in one segment.
POSITION_STRIDE = 1_000_000_000
#: The most stream names one run may write.
MAX_STREAMS = 100
#: The longest stream name, and the longest progress state, in characters.
MAX_STREAM_NAME = 100
MAX_STATE = 64
#: The state of a progress report that names none (Celery's idiom: ``update_state(state="PROGRESS")``).
DEFAULT_STATE = "PROGRESS"
#: Celery's final states: a report in one would make a reader take a running run for finished.
FINAL_STATES = frozenset({"SUCCESS", "FAILURE", "REVOKED"})
#: Items sent in one statement by ``write_many`` at most.
BATCH = 1000

_NAME = re.compile(r"[A-Za-z0-9_.:\-]+")


def check_stream_name(name: object) -> str:
    """``name`` if it can name a stream (letters, digits, ``_ . : -``; at most 100), else ``ValueError``."""
    if not isinstance(name, str) or not name or len(name) > MAX_STREAM_NAME or not _NAME.fullmatch(name):
        raise ValueError(f"a stream name is 1 to {MAX_STREAM_NAME} letters, digits or _ . : - characters, "
                         f"got {name!r:.120}")
    return name


def check_state(state: object) -> str:
    """``state`` if it can be a progress state, else ``ValueError`` (a final state is refused)."""
    if not isinstance(state, str) or not state or len(state) > MAX_STATE or not state.isprintable():
        raise ValueError(f"a progress state is 1 to {MAX_STATE} printable characters, got {state!r:.120}")
    if state in FINAL_STATES:
        raise ValueError(f"{state} is a final state: a run reports it by finishing, not as progress")
    return state


class StreamWriter:
    """One stream of the running run: ``write(item)``, ``write_many(items)``."""

    def __init__(self, output: Output, name: str) -> None:
        self.output = output
        self.name = name

    def __repr__(self) -> str:
        return f"<StreamWriter {self.name!r} of run {self.output.step.run_id}>"

    def write(self, item: Any) -> int:
        """Append ``item`` (JSON); its position."""
        return self.output.write(self.name, [item])[-1]

    def write_many(self, items: Iterable[Any]) -> list[int]:
        """Append ``items`` in order, up to ``BATCH`` a statement; their positions."""
        items = list(items)
        positions: list[int] = []
        for start in range(0, len(items), BATCH):
            positions += self.output.write(self.name, items[start:start + BATCH])
        return positions


class Output:
    """What one attempt wrote to its run's streams: the segment it is in and each stream's next
    position there. Made on a step's first write (a run that writes none never makes one)."""

    def __init__(self, step: Step) -> None:
        self.step = step
        self.segment = -1
        #: Per stream, in the current segment: the next order, and whether an earlier attempt's item
        #: was overwritten (then its items past this attempt's last are trimmed when it ends).
        self.next: dict[str, int] = {}
        self.rewritten: set[str] = set()

    def progress(self, meta: Any, state: str) -> None:
        step = self.step
        encoded = step.encode_value(meta, what=f"the progress meta of state {state!r}")
        if not worker_sql.progress(step.connection, step.claim, state, encoded):
            step.refused(f"progress {state!r}")

    def write(self, name: str, items: list[Any]) -> list[int]:
        step = self.step
        self.enter(step.segment)
        first = self.next.get(name, 0)
        if first + len(items) > POSITION_STRIDE:
            raise StreamFull(f"stream {name!r} of run {step.run_id}: more than {POSITION_STRIDE} items in one segment")
        encoded = [step.encode_value(item, what=f"an item of stream {name!r}") for item in items]
        positions = [self.segment * POSITION_STRIDE + first + n for n in range(len(items))]
        settings = step.engine.settings
        done = worker_sql.stream_write(step.connection, step.claim, name, positions, encoded,
                                       [len(e.encode()) for e in encoded], limit=settings.max_stream_bytes,
                                       max_streams=MAX_STREAMS)
        if not done["held"]:
            step.refused(f"stream {name!r}")
        if not done["written"]:
            raise StreamFull(
                f"stream {name!r} of run {step.run_id}: this write would take the run's streams past "
                f"MOTIR_MAX_STREAM_BYTES={settings.max_stream_bytes} (each item's JSON and 64 bytes) or past "
                f"{MAX_STREAMS} stream names; nothing of it was stored")
        if done["overwritten"]:
            self.rewritten.add(name)  # a re-run: an earlier attempt wrote this segment
        self.next[name] = first + len(items)
        return positions

    def enter(self, segment: int) -> None:
        """The handler is in ``segment`` now: the segment it left ends (its leftovers trimmed)."""
        if segment == self.segment:
            return
        self.close()
        self.segment = segment
        self.next.clear()

    def close(self) -> None:
        """End the current segment: in each stream a re-run wrote, delete what an earlier attempt
        wrote there past this attempt's last item (``STREAM_TRIM``; a re-run's path only)."""
        step = self.step
        for name in sorted(self.rewritten):
            last = self.segment * POSITION_STRIDE + self.next.get(name, 0) - 1
            until = (self.segment + 1) * POSITION_STRIDE
            if not worker_sql.stream_trim(step.connection, step.claim, name, last, until):
                step.refused(f"stream {name!r}")
        self.rewritten.clear()

