"""What durability costs at least on this host (issue 28): Celery carrying the statements alone.

    python -m bench.floor                       # 3 rounds; rewrites its block of docs/performance.md
    python -m bench.floor --runs 600 --io-runs 600 --rounds 1 --no-write   # a smoke test (a minute)

Runs on a Postgres and a Redis of its own (``harness.private_stack``) and reads CPU as
``bench.targets`` does (every process of the worker, of the Postgres server and of Redis, from
``/proc``, ms per run).

**The floor** is ``bench/floor_app.py``: a plain Celery worker whose one task sends a run's
claim, its three step records and its settle, and does nothing else. Its delivery is the
engine's (early acks, prefetch 1, Redis ack emulation off); its statements one of two sets,
sent through the engine's own libpq path (``driver.through_libpq_prepared``):

* ``engine``: the engine's own claim, step records and settle (store/sql/worker.py);
* ``bare``: the least the invariants need on the same tables: a claim that moves the row and
  mints its token (no attempt ledger, no event read, no memo read), the same fenced step
  records, a settle that moves the row (no ledger). What other statements could save.

Each keeps the rules issue 28 keeps: every step record a flushed commit answered before the
next body, k + 2 round trips; the claim and the settle commit without waiting for the flush,
as the engine's do by default. What the engine spends over the floor is its Python (runner,
steps, leases, driver, JSON checks), Celery's tracer around what its task returns, and the
sweeper's periodic statements.

Turns, each round:

* CPU, one worker x 2 draining ``--runs`` queued runs after ``--warmup``: plain Celery (the
  figure issue 28's "CPU durability adds" is taken against; its task records its completion
  with one Redis ``HSET``), plain Celery with ack emulation off, the floor with each set, and
  this engine (``bench.three``);
* the statements alone, without Celery: each set (and the issue's premise: five one-row
  INSERTs on a table with only a primary key, each its own transaction, three flushed) sent
  for each run by two processes at once; the clients' CPU and the server's, split;
* the I/O-like workload (3 x 5 ms) at one worker x 8, ``--io-runs`` runs: plain Celery, the
  floor with each set, this engine; drain rates.

The last line gives this engine's CPU a run over the floor's with its own statements: what the
engine's own code costs on top of what its statements must cost.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import psycopg

from bench import harness as h
from motir_celery.core.engine import Tuning
from motir_celery.settings import Settings
from motir_celery.store.driver import Statement
from motir_celery.store.driver import through_libpq_prepared as send
from motir_celery.store.sql import worker as worker_sql

MODULE, DB = "bench.floor", "motir_bench_floor"
QUEUE, FLOOR_QUEUE = "bench-floor-motir", "bench-floor"
JOB, IO_JOB = "bench.three", h.IO_JOB
IO_SECONDS = 0.005  # bench/io_jobs.py's
#: The three step outputs and the result bench.three's run stores (bench/functions.py's values).
OUTPUTS = (("reserve", '{"reserved": %d}'), ("charge", '{"charged": %d}'), ("notify", '{"notified": %d}'))
RESULT = '{"notified": %d}'
TARGET_MS, IO_TARGET = 1.0, 0.9
#: The engine's defaults: its lease, and whether the claim's and the settle's commits wait for the flush.
LEASE_SECONDS, TUNING = Settings().lease_seconds, Tuning()

# --- the statements ----------------------------------------------------------------------

ASYNC = "set_config('synchronous_commit', 'off', true)"
BARE_CLAIM = Statement("floor_bare_claim", "The least claim: queued -> running, a token, a lease.", f"""
    UPDATE job_queue SET state = 'running', attempts = attempts + 1, claim_token = CAST(%(token)s AS uuid),
                         lease_expires_at = now() + interval '60 seconds'
    WHERE id = %(run_id)s AND (state = 'queued') IS TRUE
    RETURNING id, {ASYNC} AS async_commit""", libpq=True)
BARE_STEP = Statement("floor_bare_step", "The least fenced step record.", """
    INSERT INTO job_step (run_id, step_id, workspace_id, output, attempt, started_at)
    SELECT id, %(step_id)s, workspace_id, CAST(%(output)s AS jsonb), attempts, now() FROM job_queue
    WHERE id = %(run_id)s AND claim_token = CAST(%(token)s AS uuid) AND (state = 'running') IS TRUE
    ON CONFLICT (run_id, step_id) DO NOTHING
    RETURNING 1 AS stored""", libpq=True)
BARE_SETTLE = Statement("floor_bare_settle", "The least settle: running -> succeeded, fenced.", f"""
    UPDATE job_queue SET state = 'succeeded', result = CAST(%(result)s AS jsonb), finished_at = now(),
                         claim_token = NULL, lease_expires_at = NULL
    WHERE id = %(run_id)s AND claim_token = CAST(%(token)s AS uuid) AND (state = 'running') IS TRUE
    RETURNING 1 AS settled, {ASYNC} AS async_commit""", libpq=True)
PREMISE_TABLE = "CREATE TABLE IF NOT EXISTS bench_floor_premise (id bigserial PRIMARY KEY, v int NOT NULL)"
PREMISE_FLUSHED = Statement("floor_premise_flushed", "One row, its commit flushed.",
                            "INSERT INTO bench_floor_premise (v) VALUES (CAST(%(v)s AS int)) RETURNING 1 AS done",
                            libpq=True)
PREMISE_ASYNC = Statement("floor_premise_async", "One row, its commit not waiting for the flush.",
                          f"INSERT INTO bench_floor_premise (v) VALUES (CAST(%(v)s AS int)) RETURNING {ASYNC} AS done",
                          libpq=True)
SETS = ("engine", "bare", "premise")
SET_NAMES = {"engine": "the engine's statements", "bare": "the least statements the invariants need",
             "premise": "the issue's premise: five one-row transactions, three flushed"}


def one_run(conn: psycopg.Connection[Any], which: str, run_id: uuid.UUID, n: int, worker: str, *,
            io_seconds: float = 0.0, steps: int = len(OUTPUTS)) -> bool:
    """One run's statements of set ``which`` on an autocommit connection, with ``steps`` step
    records (each body first waits ``io_seconds``); False when one of them wrote nothing."""
    if which == "premise":
        return all(send(conn, st, {"v": n}) for st in (PREMISE_ASYNC, *[PREMISE_FLUSHED] * 3, PREMISE_ASYNC))
    token = uuid.uuid4()
    if which == "engine":
        claim, step, settle = worker_sql.CLAIM, worker_sql.STORE_STEP, worker_sql.SETTLE_SUCCEEDED
    else:
        claim, step, settle = BARE_CLAIM, BARE_STEP, BARE_SETTLE
    job = IO_JOB if io_seconds else JOB
    if not send(conn, claim, {"run_id": run_id, "job_id": job, "worker": worker, "lease": LEASE_SECONDS,
                              "limit": None, "async_commit": TUNING.claim_async_commit, "token": token}):
        return False
    for step_id, output in OUTPUTS[:steps]:
        if io_seconds:
            time.sleep(io_seconds)
        if not send(conn, step, {"run_id": run_id, "token": token, "step_id": step_id, "output": output % n,
                                 "elapsed": 0.0001}):
            return False
    settled = send(conn, settle, {"run_id": run_id, "token": token, "result": RESULT % n,
                                  "async_commit": TUNING.settle_async_commit})
    return settled is not None and any(row["settled"] == 1 for row in settled)


# --- the floor on Celery -------------------------------------------------------------------


@dataclass
class Floor:
    """``bench/floor_app.py``'s worker running set ``statements`` for runs of ``job`` queued in ``db``."""

    db: h.Database
    statements: str = "engine"
    io_seconds: float = 0.0
    #: Step records a run (bench/tasks.py: 0, a task with no steps: its claim and settle alone).
    steps: int = len(OUTPUTS)
    queue: str = FLOOR_QUEUE
    job: str = JOB
    env: dict[str, str] = field(default_factory=dict)

    def reset(self) -> None:
        self.db.truncate()
        h.purge_queue(self.queue)

    def prequeue(self, n: int, offset: int = 0) -> None:
        from bench.floor_app import app

        ids = self.db.rows(h.PREQUEUE, {"job": self.job, "lo": offset + 1, "hi": offset + n, "max_attempts": 3,
                                        "policy": "transient"})
        with app.producer_or_acquire() as producer:
            for k, (run_id,) in enumerate(ids):
                app.send_task("bench.floor", args=[str(run_id), offset + k], queue=self.queue, producer=producer)

    def settled(self) -> int:
        return self.db.succeeded()

    def finished(self) -> dict[str, float]:
        return self.db.finished()

    def workers(self, n: int, concurrency: int, tag: str = "floor") -> h.Procs:
        env = h.child_env(MOTIR_DATABASE_URL=self.db.url, BENCH_FLOOR_QUEUE=self.queue,
                          BENCH_FLOOR_STATEMENTS=self.statements, BENCH_FLOOR_IO_SECONDS=repr(self.io_seconds),
                          BENCH_FLOOR_STEPS=str(self.steps), **self.env)
        return h.workers("bench.floor_app", self.queue, n, concurrency, env=env, tag=tag)

    def backends(self) -> list[int]:
        return self.db.backends()


# --- the statements alone -------------------------------------------------------------------

CLIENTS = 2


def _client(url: str, which: str, ids: list[uuid.UUID], warmup: int, barrier: Any, out: Any) -> None:
    """One pool child's statements for each of ``ids``, nothing else; its CPU over the runs
    after ``warmup`` (between the first two barrier waits) goes to ``out``. Its connection stays
    open until the third, when the server has been read."""
    conn = psycopg.connect(h.dsn(url), autocommit=True)
    worker = f"floor@{os.getpid()}"
    stats = {"cpu_s": 0.0, "runs": 0, "failed": 0}
    try:
        for n, run_id in enumerate(ids[:warmup]):
            stats["failed"] += not one_run(conn, which, run_id, n, worker)
        barrier.wait()
        t0 = time.process_time()
        for n, run_id in enumerate(ids[warmup:]):
            stats["failed"] += not one_run(conn, which, run_id, n, worker)
        stats["cpu_s"], stats["runs"] = time.process_time() - t0, len(ids) - warmup
        barrier.wait()
        barrier.wait()  # the server read again: its backend may go now (a reading must not race its exit)
    finally:
        conn.close()
        out.put(stats)


def statements_alone(server: h.Stack, which: str, runs: int, warmup: int) -> dict[str, Any]:
    """Set ``which``'s statements for ``runs`` queued runs from ``CLIENTS`` processes at once: the
    clients' CPU and the server's (every process but the monitor), ms per run."""
    server.db.truncate("bench_floor_premise")
    ids = [r[0] for r in server.db.rows(h.PREQUEUE, {"job": JOB, "lo": 1, "hi": warmup + runs, "max_attempts": 3,
                                                     "policy": "transient"})]
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(CLIENTS + 1), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(server.db.url, which, ids[i::CLIENTS], warmup // CLIENTS, barrier, out))
             for i in range(CLIENTS)]
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=300)
        p0 = server.pg_reading(None)
        barrier.wait(timeout=1200)
        p1 = server.pg_reading(None)
        barrier.wait(timeout=60)
        got = [out.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    failed = sum(g["failed"] for g in got)
    if failed:
        raise RuntimeError(f"statements alone ({which}): {failed} runs were not claimed, stored and settled")
    n = sum(g["runs"] for g in got)
    pg_clients, pg_bg = server.split(p0, p1)
    result = {"clients": sum(g["cpu_s"] for g in got) * 1000 / n, "pg_clients": pg_clients / n,
              "pg_background": pg_bg / n}
    result["total"] = sum(result.values())
    return result


# --- the run ---------------------------------------------------------------------------------

CPU_SIDES = {"plain": "plain Celery (the figure the target is taken against)",
             "plain_noack": "plain Celery, Redis ack emulation off",
             "floor_engine": "the floor: Celery carrying the engine's statements alone",
             "floor_bare": "the floor: Celery carrying the least statements the invariants need",
             "motir": "this engine (3 durable steps)"}
IO_SIDES = {"plain": "plain Celery", "floor_engine": "the floor: Celery carrying the engine's statements alone",
            "floor_bare": "the floor: Celery carrying the least statements the invariants need",
            "motir": "this engine"}


def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, list[Any]]:
    with h.private_stack(DB) as stack:
        db, env = stack.db, dict(h.WORKER_ENV)
        db.rows(PREMISE_TABLE)
        cpu = {"plain": h.Plain(), "plain_noack": h.Plain(env={"BENCH_NO_ACK_EMULATION": "1"}),
               "floor_engine": Floor(db), "floor_bare": Floor(db, "bare"),
               "motir": h.Motir(db, queue=QUEUE, imports=h.IMPORTS, env=env)}
        io = {"plain": h.PlainIO(), "floor_engine": Floor(db, io_seconds=IO_SECONDS, job=IO_JOB),
              "floor_bare": Floor(db, "bare", io_seconds=IO_SECONDS, job=IO_JOB),
              "motir": h.Motir(db, job=IO_JOB, queue=QUEUE, imports=h.IMPORTS, env=env)}
        turns: dict[str, Callable[[], Any]] = {
            f"cpu {name}": (lambda s=s, name=name: stack.cpu_per_run(s, args.runs, args.warmup, tag=f"fl-{name}"))
            for name, s in cpu.items()}
        turns.update({f"alone {which}": (lambda which=which: statements_alone(stack, which, args.runs, args.warmup))
                      for which in SETS})
        turns.update({f"io {name}": (lambda s=s, name=name: h.drain(s, args.io_runs, 1, 8, tag=f"fl-io-{name}").rate)
                      for name, s in io.items()})
        return h.interleave(turns, args.rounds, log=lambda m: log("  " + m.split(" {", 1)[0][:60]))


def _med(rs: list[Any], key: str | None = "total") -> float:
    return h.median(r if key is None else r[key] for r in rs)


def _each(xs: list[float], fmt: str = "{:+.2f}") -> str:
    return ", ".join(fmt.format(x) for x in xs)


def render(rounds: dict[str, list[Any]], args: argparse.Namespace, command: str, started: str, elapsed: float) -> str:
    plain = rounds["cpu plain"]

    def adds(name: str) -> list[float]:
        return [a["total"] - p["total"] for a, p in zip(rounds[f"cpu {name}"], plain)]

    md = ["### The floor of what durability adds (generated)", "",
          f"Generated by `{command}` ({started}, {elapsed / 60:.0f} min; {h.machine(load=True)}; commit "
          f"{h.describe()}). Method: "
          f"`bench/floor.py`'s docstring. {args.rounds} rounds, the turns taking turns; each figure the median of "
          "the rounds (the rounds in parentheses).", "",
          f"CPU ms a run, one worker x 2 draining {args.runs:,} queued runs (after {args.warmup}), every process:", "",
          "| side | CPU ms a run | adds to plain Celery's | left by the target (<= 1.0 ms) |", "|---|---:|---:|---:|"]
    for name, title in CPU_SIDES.items():
        each = ", ".join(f"{r['total']:.2f}" for r in rounds[f"cpu {name}"])
        extra = " | |" if name == "plain" else (f" | **{h.median(adds(name)):+.2f}** ({_each(adds(name))}) | "
                                                f"{TARGET_MS - h.median(adds(name)):+.2f} |")
        md.append(f"| {title} | **{_med(rounds[f'cpu {name}']):.2f}** ({each})" + extra)
    md += ["", f"The statements alone, without Celery ({CLIENTS} processes at once), CPU ms a run:", "",
           "| statements | all | the clients | Postgres backends | Postgres background |", "|---|---:|---:|---:|---:|"]
    for which in SETS:
        rs = rounds[f"alone {which}"]
        md.append(f"| {SET_NAMES[which]} | **{_med(rs):.2f}** ({_each([r['total'] for r in rs], '{:.2f}')}) | "
                  f"{_med(rs, 'clients'):.2f} | {_med(rs, 'pg_clients'):.2f} | {_med(rs, 'pg_background'):.2f} |")
    io_plain = rounds["io plain"]
    md += ["", f"The I/O-like workload (3 steps x 5 ms), one worker x 8, {args.io_runs:,} runs (Celery's ceiling "
           f"{8 / (3 * IO_SECONDS):.0f} runs/s):", "",
           f"| side | runs/s | / plain Celery (target >= {IO_TARGET}) |", "|---|---:|---:|"]
    for name, title in IO_SIDES.items():
        rs = rounds[f"io {name}"]
        ratio = [a / p for a, p in zip(rs, io_plain)]
        md.append(f"| {title} | **{_med(rs, None):.0f}** ({_each(rs, '{:.0f}')}) | "
                  + ("" if name == "plain" else f"**{h.median(ratio):.2f}** ({_each(ratio, '{:.2f}')})") + " |")
    over = h.median(adds("motir")) - h.median(adds("floor_engine"))
    ratio = _med(rounds["cpu motir"]) / _med(rounds["cpu floor_engine"])
    each = [a["total"] / f["total"] for a, f in zip(rounds["cpu motir"], rounds["cpu floor_engine"])]
    md += ["", f"This engine spends **{over:+.2f}** ms a run over the floor with its own statements: its CPU a run "
           f"is **x{ratio:.2f}** the floor's (the rounds' ratios: {_each(each, '{:.2f}')}): its runner, steps, leases "
           "and driver, the JSON checks, Celery's tracer around what its task returns, the sweeper's periodic "
           "statements."]
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=2000, help="runs a CPU turn, after the warm-up (default 2000)")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--io-runs", type=int, default=2000, help="runs an I/O-like turn (default 2000)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-write", action="store_true", help="print the block; leave docs/performance.md alone")
    args = p.parse_args(argv)
    started, t0 = h.now(), time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.0f}s] {msg}", file=sys.stderr, flush=True)

    rounds = run(args, log)
    block = render(rounds, args, h.command(MODULE, argv), started, time.monotonic() - t0)
    h.write_block(MODULE, block, h.PERFORMANCE_DOC, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
