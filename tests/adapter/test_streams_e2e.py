"""Streams end to end: a real `celery worker` writes, a reader in another process follows (issue 45).

The job (tests/fixtures/stream_jobs.py) writes 1,000 items of stream ``items`` across 3 steps, ~1 ms
apart, each stamped with the writer's clock; the reader (tests/fixtures/stream_reader.py) is a
process of its own that follows the stream and stamps what it gets with its own clock (one machine,
one clock). Both readers — one that followed from the start, one started after the end — must see
the same 1,000 items, each once, in order; through a ``kill -9`` of the worker in the middle of the
second step too.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

import tests.fixtures.stream_jobs as sj
from tests.conftest import ROOT, celery_worker, run_state, wait_for

IMPORTS = {"MOTIR_IMPORTS": "tests.fixtures.jobs,tests.fixtures.stream_jobs"}


class Reader:
    """``python -m tests.fixtures.stream_reader``: its lines as they come."""

    def __init__(self, run_id: Any, *, once: bool = False) -> None:
        cmd = [sys.executable, "-m", "tests.fixtures.stream_reader", str(run_id), "items"] + (["--once"] if once else [])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True)
        self.lines: list[dict[str, Any]] = []
        self.listening: bool | None = None
        self.ready = threading.Event()
        self.done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            entry = json.loads(line)
            if entry.get("ready"):
                self.listening = entry["listening"]
                self.ready.set()
            elif entry.get("end"):
                self.done.set()
            else:
                self.lines.append(entry)
        self.done.set()

    def items(self) -> list[int]:
        return [e["value"]["i"] for e in self.lines]

    def finish(self, timeout: float = 120.0) -> None:
        assert self.done.wait(timeout), "the reader did not finish"
        self.proc.wait(10)
        assert self.proc.returncode == 0, self.proc.stderr.read() if self.proc.stderr else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


@pytest.fixture
def readers() -> Iterator[list[Reader]]:
    made: list[Reader] = []
    yield made
    for r in made:
        r.stop()


def test_a_reader_in_another_process_follows_1000_items_as_they_are_written(
        engine: Any, broker_url: str, tmp_path: Path, readers: list[Reader]) -> None:
    handle = sj.thousand.delay(1000, 0.001)         # queued: no worker yet
    live = Reader(handle.id)
    readers.append(live)
    assert live.ready.wait(60), "the reader never read the run"
    with celery_worker(tmp_path, broker=broker_url, concurrency=1, env=IMPORTS):
        assert handle.get(timeout=90) == 1000
        live.finish()
    assert live.items() == list(range(1000))        # all of them, each once, in order
    latency = sorted((e["got"] - e["value"]["t"]) * 1000 for e in live.lines)
    first = (live.lines[0]["got"] - live.lines[0]["value"]["t"]) * 1000
    p50, p95 = statistics.median(latency), latency[int(len(latency) * 0.95)]
    print(f"\nwrite-to-read latency over 1000 items: first {first:.1f} ms, p50 {p50:.1f} ms, "
          f"p95 {p95:.1f} ms, max {latency[-1]:.1f} ms (load {os.getloadavg()[0]:.1f}; "
          f"{'LISTEN' if live.listening else 'polling: a transaction pooler'})")
    # The figure is measured, not asserted (printed above; docs/jobs.md quotes a quiet host's: p95
    # 2-3 ms; CI running two suites at once on 2 cores gave 104 and 157 ms). The bound
    # holds the mechanism: a reader woken by each write's notification (or polling at most 0.1 s apart
    # behind a pooler), never one waiting for its fallback read, a second later.
    assert p95 <= 500.0, f"p95 {p95:.1f} ms"
    assert first <= 500.0, f"first item {first:.1f} ms"
    # it got them while the job ran, not at its end
    written_span = live.lines[-1]["value"]["t"] - live.lines[0]["value"]["t"]
    assert live.lines[500]["got"] < live.lines[-1]["value"]["t"] and written_span > 1.0

    late = Reader(handle.id, once=True)
    readers.append(late)
    late.finish()
    assert late.items() == list(range(1000))
    assert [e["position"] for e in late.lines] == [e["position"] for e in live.lines]
    progress = handle.progress
    assert progress is not None and progress.meta == {"parts": 3, "items": 1000} and progress.stream_items == 1000


def test_kill_9_in_the_middle_of_the_second_step_each_reader_sees_each_item_once_in_order(
        engine: Any, broker_url: str, tmp_path: Path, readers: list[Reader]) -> None:
    handle = sj.thousand.delay(1000, 0.002)
    live = Reader(handle.id)
    readers.append(live)
    assert live.ready.wait(60)
    env = {**IMPORTS, "MOTIR_REPUBLISH_AFTER": "2"}
    with celery_worker(tmp_path, broker=broker_url, concurrency=1, env=env, lease=2, name="doomed") as doomed:
        # the second step writes items 333..665: kill in its middle
        wait_for(lambda: len(live.lines) >= 500, timeout=60, what="the reader past item 500")
        doomed.kill(signal.SIGKILL)
        killed_at = len(live.lines)
    assert 333 < killed_at < 666, killed_at
    assert run_state(engine, handle.id) == "running"
    with celery_worker(tmp_path, broker=broker_url, concurrency=1, env=env, lease=2, name="heir"):
        assert handle.get(timeout=120) == 1000
        live.finish()
    assert live.items() == list(range(1000))        # each once, in order, through the crash
    attempts = {e["value"]["attempt"] for e in live.lines}
    assert attempts == {1, 2}, attempts             # it followed the first attempt, then the re-run

    late = Reader(handle.id, once=True)
    readers.append(late)
    late.finish()
    assert late.items() == list(range(1000))
    by_attempt = [e["value"]["attempt"] for e in late.lines]
    assert set(by_attempt[:333]) == {1} and set(by_attempt[333:]) == {2}   # the second step was written again
    assert [e["position"] for e in late.lines] == [e["position"] for e in live.lines]
