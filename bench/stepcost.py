"""Step cost: ``step.run`` memo hit vs miss, and round trips / commits per run of k steps.

In-process (no Celery): ``runner.execute`` on runs of job ``bench.steps``.

* Time per step: a run of 100 steps whose first attempt stores all 100 (misses)
  and then fails on purpose; the second attempt replays them (hits). Each
  ``step.run`` is timed inside the handler.
* Round trips and commits: libpq's protocol trace of the worker's connections
  (``PGconn.trace``), read back message by message. A round trip is a message
  the server answers on its own: a simple ``Query`` or an extended-protocol
  ``Sync``. A commit is a server transaction that wrote (INSERT/UPDATE/DELETE in
  one of its statements) and ended without ROLLBACK: an explicit COMMIT, or one
  autocommit statement. So a pool pre-ping, a BEGIN or a COMMIT all count.
  Pipelined statements (step records, the settle behind them) are round trips
  the client does not wait for one by one: *waits* counts the turns from
  sending to reading in the trace, an upper bound on the answers the attempt
  waited for (an answer already in when it looks is read without waiting, and
  counts too: the faster the server answers, the more such turns).
"""

from __future__ import annotations

import os
import re
import tempfile
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event, text

from bench import workload
from bench.harness import median
from motir_celery.core.producer import events
from motir_celery.core.worker import runner
from motir_celery.store.db import dispose_engines, get_engine

#: Seconds each body of the "slow" runs sleeps: longer than steps.MAX_LAG (1 ms), so
#: every step but the last is stored on its own before the next body starts.
SLOW_BODY = 0.002

_WRITES = re.compile(r"\b(INSERT|UPDATE|DELETE)\b", re.IGNORECASE)
_QUOTED = re.compile(r'"((?:[^"]|"")*)"')


@dataclass
class Protocol:
    round_trips: int = 0
    commits: int = 0
    statements: int = 0
    waits: int = 0


def analyse_trace(lines: list[str], prelude: list[str] = ()) -> Protocol:  # type: ignore[assignment]
    """Count round trips and committed write transactions in a libpq trace (PQTRACE_REGRESS_MODE).

    ``prelude``: the trace before the window, read only for the text of the
    statements psycopg prepared there (a later Bind names them only).
    """
    out = Protocol()
    prepared: dict[str, str] = {}
    for message in _messages(prelude):
        parts = message.split("\t", 3)
        if len(parts) > 3 and parts[0] == "F" and parts[2].strip() == "Parse":
            q = _QUOTED.findall(parts[3])
            if len(q) >= 2 and q[0]:
                prepared[q[0]] = q[1]
    unnamed = ""
    # Each Query or Sync closes a segment the server answers with one ReadyForQuery;
    # pipelined segments are sent before the answers to earlier ones arrive.
    segments: deque[tuple[bool, bool]] = deque()
    writes = rolled_back = False  # of the segment being sent
    txn_writes = txn_rolled_back = False  # of the transaction being answered
    last_direction = ""
    for message in _messages(lines):
        parts = message.rstrip("\n").split("\t", 3)
        if len(parts) < 3:
            continue
        direction, kind, rest = parts[0], parts[2].strip(), parts[3] if len(parts) > 3 else ""
        if direction == "B" and last_direction == "F":
            out.waits += 1
        last_direction = direction
        if direction == "F":
            if kind == "Query":
                out.round_trips += 1
                sql = (_QUOTED.findall(rest) or [""])[0]
                word = sql.strip().upper()
                if word == "ROLLBACK":
                    rolled_back = True
                elif word not in ("BEGIN", "COMMIT"):
                    out.statements += 1
                    writes |= bool(_WRITES.search(sql))
                segments.append((writes, rolled_back))
                writes = rolled_back = False
            elif kind == "Parse":
                q = _QUOTED.findall(rest)
                name, sql = (q + ["", ""])[:2]
                if name:
                    prepared[name] = sql
                else:
                    unnamed = sql
            elif kind == "Bind":
                q = _QUOTED.findall(rest)
                name = q[1] if len(q) > 1 else ""
                sql = prepared.get(name, "") if name else unnamed
                out.statements += 1
                writes |= bool(_WRITES.search(sql))
            elif kind == "Sync":
                out.round_trips += 1
                segments.append((writes, rolled_back))
                writes = rolled_back = False
        elif direction == "B" and kind == "ReadyForQuery" and segments:
            seg_writes, seg_rolled_back = segments.popleft()
            txn_writes |= seg_writes
            txn_rolled_back |= seg_rolled_back
            if rest.strip() == "I":  # the transaction ended (T: still open, E: failed)
                if txn_writes and not txn_rolled_back:
                    out.commits += 1
                txn_writes = txn_rolled_back = False
    return out


def _lines(text_: str) -> list[str]:
    return [line + "\n" for line in text_.split("\n") if line]


def _messages(lines: list[str]) -> list[str]:
    """A statement's text spans lines; a message starts with its direction (F or B)."""
    messages: list[str] = []
    for line in lines:
        if line.startswith(("F\t", "B\t")) or not messages:
            messages.append(line)
        else:
            messages[-1] += line
    return messages


class Tracer:
    """Trace every connection this process's engine makes from now on into one file; ``since``
    returns what was sent after a ``mark``."""

    def __init__(self) -> None:
        from psycopg import pq

        self._fh = tempfile.NamedTemporaryFile("w+", prefix="bench-trace-", suffix=".txt", delete=False)
        self._conns: list[Any] = []
        dispose_engines()  # every connection (the runner's kept ones too) is made again, traced
        self._engine = engine = get_engine()

        @event.listens_for(engine, "connect")
        def _trace(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.pgconn.trace(self._fh.fileno())
            dbapi_conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
            self._conns.append(dbapi_conn)

        self._listener = _trace

    def _flush(self) -> None:
        # libpq buffers the trace in a FILE*; untrace flushes it, and we trace again.
        from psycopg import pq

        for c in self._conns:
            if not c.closed:
                c.pgconn.untrace()
                c.pgconn.trace(self._fh.fileno())
                c.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)

    def mark(self) -> int:
        self._flush()
        return os.path.getsize(self._fh.name)

    def since(self, mark: int) -> tuple[list[str], list[str]]:
        """(the trace before ``mark``, the trace after it)."""
        self._flush()
        with open(self._fh.name, "rb") as fh:  # `mark` counts bytes; SQL comments hold UTF-8
            data = fh.read()
        before, after = data[:mark].decode("utf-8", "replace"), data[mark:].decode("utf-8", "replace")
        return _lines(before), _lines(after)

    def close(self) -> None:
        for c in self._conns:
            if not c.closed:
                c.pgconn.untrace()
        event.remove(self._engine, "connect", self._listener)
        dispose_engines()
        os.unlink(self._fh.name)


def _new_run(data: dict[str, Any]) -> uuid.UUID:
    return events.send_event("bench.steps", data, publish=None).run_ids[0]


def _make_due(run_id: uuid.UUID) -> None:
    with get_engine().begin() as conn:
        conn.execute(text("UPDATE job_queue SET run_at = now() WHERE id = :id"), {"id": run_id})


def measure(k_values: tuple[int, ...] = (0, 1, 3, 10), hits_k: int = 100, rounds: int = 5) -> dict[str, Any]:
    def execute(run_id: uuid.UUID) -> str:
        return runner.execute(run_id, job_id="bench.steps", worker="bench/stepcost", publish=None).state

    # Warm the pool and psycopg's prepared statements (a worker that has run a few jobs).
    for _ in range(6):
        execute(_new_run({"k": 3}))

    # 1. time per step: misses on attempt 1, hits on attempt 2, `rounds` runs.
    miss, hit = [], []
    for _ in range(rounds):
        run_id = _new_run({"k": hits_k, "fail_first": True})
        workload.STEP_TIMES.clear()
        assert execute(run_id) == "retrying"
        _make_due(run_id)
        assert execute(run_id) == "succeeded"
        miss.append(median(workload.STEP_TIMES[0]))
        hit.append(median(workload.STEP_TIMES[1]))

    # 2. protocol: a fresh run of k new steps; then a replay of k memo hits.
    tracer = Tracer()
    try:
        for _ in range(6):  # the traced pool warms up again (new connections, prepared statements)
            execute(_new_run({"k": 3}))
        fresh: dict[int, Protocol] = {}
        slow: dict[int, Protocol] = {}
        replay: dict[int, Protocol] = {}
        for k in k_values:
            for protocols, data in ((fresh, {"k": k}), (slow, {"k": k, "sleep": SLOW_BODY})):
                run_id = _new_run(data)
                mark = tracer.mark()
                assert execute(run_id) == "succeeded"
                before, window = tracer.since(mark)
                protocols[k] = analyse_trace(window, before)
            # A run whose first attempt stores its k steps and fails: its second attempt is k memo hits.
            run_id = _new_run({"k": k, "fail_first": True})
            assert execute(run_id) == "retrying"
            _make_due(run_id)
            mark = tracer.mark()
            assert execute(run_id) == "succeeded"
            before, window = tracer.since(mark)
            replay[k] = analyse_trace(window, before)
    finally:
        tracer.close()
    return {
        "hits_k": hits_k,
        "miss_us": median(miss) * 1e6,
        "hit_us": median(hit) * 1e6,
        "fresh": {k: vars(p) for k, p in fresh.items()},
        "slow": {k: vars(p) for k, p in slow.items()},
        "replay": {k: vars(p) for k, p in replay.items()},
    }


def main() -> None:
    """``python -m bench.stepcost`` prints the measurement as JSON (the suite runs it in a
    subprocess, so it can also measure another checkout's engine via BENCH_ENGINE_PATH)."""
    import argparse
    import json

    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hits-k", type=int, default=100)
    args = p.parse_args()
    print(json.dumps(measure(hits_k=args.hits_k, rounds=args.rounds)))


if __name__ == "__main__":
    main()
