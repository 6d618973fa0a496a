"""Step cost: ``step.run`` memo hit vs miss, and round trips / commits per run of k steps (the suite's section 3).

    python -m bench.stepcost [--rounds 5]     # prints one JSON object

In process (no Celery), ``Engine.execute`` of runs of ``bench.steps`` (an engine whose messages are held). Time per step: a run of
100 steps whose first attempt stores them all (misses) and fails on purpose; the second replays
them (hits). Protocol: libpq's trace (``PGconn.trace``) of every connection psycopg opens in
this process, read back message by message. A round trip is a message the server answers on
its own (a ``Query``, or an extended-protocol ``Sync``); a commit, a server transaction that
wrote and did not roll back.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import psycopg

from bench import harness as h
from bench import workload

_WRITES = re.compile(r"\b(INSERT|UPDATE|DELETE)\b", re.IGNORECASE)
_QUOTED = re.compile(r'"((?:[^"]|"")*)"')


@dataclass
class Protocol:
    round_trips: int = 0
    commits: int = 0
    statements: int = 0


def _messages(data: str) -> list[list[str]]:
    """A trace (PQTRACE_REGRESS_MODE) as messages [direction, length, kind, rest]: a statement's
    text spans lines; a message starts with its direction (F or B)."""
    messages: list[str] = []
    for line in data.split("\n"):
        if line.startswith(("F\t", "B\t")) or (line and not messages):
            messages.append(line)
        elif line:
            messages[-1] += "\n" + line
    return [(m.split("\t", 3) + [""])[:4] for m in messages if m.count("\t") >= 2]


def analyse_trace(window: str, prelude: str = "") -> Protocol:
    """Round trips and committed write transactions of the trace ``window``; ``prelude``, the trace
    before it, is read only for the text of the statements prepared there (a later Bind names them only)."""
    out, prepared, unnamed = Protocol(), {}, ""
    for direction, _, kind, rest in _messages(prelude):
        if direction == "F" and kind.strip() == "Parse" and len(q := _QUOTED.findall(rest)) >= 2 and q[0]:
            prepared[q[0]] = q[1]
    segments: deque[tuple[bool, bool]] = deque()  # each Query or Sync: one ReadyForQuery answers it
    writes = rolled_back = False  # of the segment being sent
    txn_writes = txn_rolled_back = False  # of the transaction being answered
    for direction, _, kind, rest in _messages(window):
        kind, rest = kind.strip(), rest.rstrip("\n")
        q = _QUOTED.findall(rest)
        if direction == "F" and kind == "Query":
            word = (q or [""])[0].strip().upper()
            rolled_back |= word == "ROLLBACK"
            if word not in ("BEGIN", "COMMIT", "ROLLBACK"):
                out.statements += 1
                writes |= bool(_WRITES.search((q or [""])[0]))
        elif direction == "F" and kind == "Parse":
            name, sql = (q + ["", ""])[:2]
            if name:
                prepared[name] = sql
            else:
                unnamed = sql
        elif direction == "F" and kind == "Bind":
            out.statements += 1
            writes |= bool(_WRITES.search(prepared.get(q[1], "") if len(q) > 1 and q[1] else unnamed))
        elif direction == "B" and kind == "ReadyForQuery" and segments:
            seg_writes, seg_rolled_back = segments.popleft()
            txn_writes, txn_rolled_back = txn_writes or seg_writes, txn_rolled_back or seg_rolled_back
            if rest.strip() == "I":  # the transaction ended (T: still open, E: failed)
                out.commits += txn_writes and not txn_rolled_back
                txn_writes = txn_rolled_back = False
        if direction == "F" and kind in ("Query", "Sync"):
            out.round_trips += 1
            segments.append((writes, rolled_back))
            writes = rolled_back = False
    return out


class Tracer:
    """Every psycopg connection this process opens from now on (``psycopg.connect`` and
    ``Connection.connect``: the engine's pool's, whatever pool it is), traced into one file until
    ``stop``; ``since`` returns what was sent after a ``mark``."""

    def __init__(self) -> None:
        self._fh = tempfile.NamedTemporaryFile("w+", prefix="bench-trace-", suffix=".txt", delete=False)
        self._conns: list[psycopg.Connection[Any]] = []
        self._on = True
        self._saved = psycopg.connect, psycopg.Connection.connect
        make = psycopg.Connection.connect.__func__  # type: ignore[attr-defined]

        def connect(cls: Any, *args: Any, **kwargs: Any) -> Any:
            conn = make(cls, *args, **kwargs)
            self._conns.append(conn)
            if self._on:
                self._trace(conn)
            return conn

        psycopg.Connection.connect = classmethod(connect)  # type: ignore[method-assign, assignment]
        psycopg.connect = psycopg.Connection.connect

    def _trace(self, conn: psycopg.Connection[Any]) -> None:
        from psycopg import pq

        conn.pgconn.trace(self._fh.fileno())
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)

    def stop(self) -> None:
        for c in self._conns:
            if self._on and not c.closed:
                c.pgconn.untrace()
        self._on = False

    def mark(self) -> int:
        for c in self._conns:  # libpq buffers the trace in a FILE*: untrace flushes it, and we trace again
            if self._on and not c.closed:
                c.pgconn.untrace()
                self._trace(c)
        return os.path.getsize(self._fh.name)

    def since(self, mark: int) -> tuple[str, str]:
        """(the trace after ``mark``, the trace before it)."""
        self.mark()
        with open(self._fh.name, "rb") as fh:  # `mark` counts bytes; SQL comments hold UTF-8
            data = fh.read()
        return data[mark:].decode("utf-8", "replace"), data[:mark].decode("utf-8", "replace")

    def close(self) -> None:
        psycopg.connect, psycopg.Connection.connect = self._saved  # type: ignore[method-assign]
        self.stop()
        os.unlink(self._fh.name)


def measure(tracer: Tracer, k_values: tuple[int, ...] = (0, 1, 3, 10), hits_k: int = 100,
            rounds: int = 5) -> dict[str, Any]:
    url = h.dsn(os.environ["MOTIR_DATABASE_URL"])
    engine = h.held()

    def execute(data: dict[str, Any], *, fail_first: bool = False, traced: bool = False) -> Protocol | None:
        """A run of ``data``; ``fail_first``: its first attempt fails, the second is measured (memo hits)."""
        run_id: uuid.UUID = engine.send_event("bench.steps",
                                              {**data, **({"fail_first": True} if fail_first else {})}).run_ids[0]
        if fail_first:
            assert engine.execute(run_id, job_id="bench.steps", worker="bench/stepcost").state == "retrying"
            with psycopg.connect(url, autocommit=True) as conn:  # due again now, not after its backoff
                conn.execute("UPDATE job_queue SET run_at = now() WHERE id = %s", (run_id,))
        mark = tracer.mark() if traced else 0
        assert engine.execute(run_id, job_id="bench.steps", worker="bench/stepcost").state == "succeeded"
        if not traced:
            return None
        sent = analyse_trace(*tracer.since(mark))
        if sent.round_trips < 2:  # a claim and a settle at least: else the trace missed the runner's connection
            raise SystemExit(f"bench.stepcost: the trace saw {sent.round_trips} round trips for a run; "
                             "it no longer follows the runner's connections")
        return sent

    for _ in range(6):  # warm the pool and the prepared statements (a worker that has run a few jobs)
        execute({"k": 3})
    runs: dict[str, dict[int, Any]] = {"fresh": {}, "replay": {}}
    for k in k_values:
        runs["fresh"][k] = vars(execute({"k": k}, traced=True))
        runs["replay"][k] = vars(execute({"k": k}, fail_first=True, traced=True))
    tracer.stop()  # (before the timed runs: the trace costs each statement a write)
    miss, hit = [], []
    for _ in range(rounds):  # misses on attempt 1, hits on attempt 2
        workload.STEP_TIMES.clear()
        execute({"k": hits_k}, fail_first=True)
        miss.append(h.median(workload.STEP_TIMES[0]))
        hit.append(h.median(workload.STEP_TIMES[1]))
    return {"hits_k": hits_k, "miss_us": h.median(miss) * 1e6, "hit_us": h.median(hit) * 1e6, **runs}


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m bench.stepcost", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hits-k", type=int, default=100)
    args = p.parse_args()
    h.need("MOTIR_DATABASE_URL")
    tracer = Tracer()  # from the first connection on: the engine's pool keeps its connections
    with h.Database.create("motir_bench_stepcost") as db:
        h.use_engine(db.url, "bench-stepcost", imports="bench.workload")
        try:
            result = measure(tracer, hits_k=args.hits_k, rounds=args.rounds)
        finally:
            tracer.close()
    print(json.dumps(result))
