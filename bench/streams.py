"""What progress and streams cost (issue 45): a job writing 1,000 stream items, and a plain run beside it.

    python -m bench.streams cost  [--items 1000] [--rounds 5]       # items/s, CPU per item (client, Postgres)
    python -m bench.streams plain [--runs 2000]                     # CPU of a plain 3-step run (one line of JSON)
    python -m bench.streams ab --baseline CHECKOUT [--pairs 8]      # plain runs here and there, in pairs

Runs execute in this process through the real runner (``Engine.execute``: the claim, each fenced step
record and stream write, the settle), their messages held (no broker), on a database of the bench's
own on ``MOTIR_DATABASE_URL``'s server, migrated by the checkout that runs it. CPU is counted on both
sides: this process (``time.process_time``) and the Postgres server's processes (the postmaster and
its children, from /proc: the server must be local and ours, as the embedded one is).

``cost`` runs ``bench.streams.thousand`` — 1,000 items in 3 steps, written as the job produces them
(``write``, one statement each), then ``bench.streams.batched`` (the same through ``write_many`` in
batches of 100) and ``bench.streams.quiet`` (the same 3 steps, no item): the item's cost is the run's
less the quiet one's, over 1,000.

``ab`` answers "does a plain run pay anything": ``plain`` is run alternately by this checkout's
interpreter and by the baseline checkout's (its own ``.venv``, its own engine, this file), ``--pairs``
times; each pair's ratio of CPU per run, and their median. The machine is shared: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent


def _server_cpu() -> float:
    """CPU seconds of the local Postgres server (postmaster and children), from /proc."""
    data = os.environ.get("MOTIR_DATA_DIR", str(ROOT / ".motir"))
    try:
        postmaster = int(Path(data, "pg", "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path("/proc", entry, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) == postmaster or int(fields[1]) == postmaster:   # fields[1]: ppid
            total += int(fields[11]) + int(fields[12])                 # utime + stime
    return total / tick


def _database() -> tuple[str, Any]:
    """A fresh database of the bench's own, migrated by the checkout this process runs."""
    from sqlalchemy import create_engine, make_url, text

    from motir_celery.store.migrate import upgrade

    server = make_url(os.environ["MOTIR_DATABASE_URL"])
    name = f"motir_bench_streams_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = server.set(database=name).render_as_string(hide_password=False)
    os.environ["MOTIR_DATABASE_URL"] = url
    upgrade(url)

    def drop() -> None:
        from motir_celery.store.db import dispose_engines

        dispose_engines()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

    return url, drop


def _engine() -> Any:
    from motir_celery.core.engine import Engine
    from motir_celery.settings import Settings
    from motir_celery.testing import Held

    return Engine(Settings.from_env(), host=Held())


def _jobs(streams: bool) -> dict[str, Any]:
    from motir_celery import define_job

    def part(step: Any, first: int, last: int, batched: bool) -> int:
        if batched:
            out = step.stream("items")
            for start in range(first, last, 100):
                out.write_many({"i": i} for i in range(start, min(start + 100, last)))
        elif streams:
            out = step.stream("items")
            for i in range(first, last):
                out.write({"i": i})
        return last - first

    def make(name: str, n: int, batched: bool = False) -> Any:
        def handler(step: Any) -> int:
            bounds = [0, n // 3, 2 * n // 3, n]
            return sum(step.run(f"part-{s}", part, step, bounds[s], bounds[s + 1], batched) for s in range(3))
        return define_job(name, retry_policy="none")(handler)

    jobs = {"quiet": make("bench.streams.quiet", 0)}
    if streams:
        jobs["thousand"] = make("bench.streams.thousand", ARGS_ITEMS)
        jobs["batched"] = make("bench.streams.batched", ARGS_ITEMS, batched=True)
    return jobs


ARGS_ITEMS = 1000


def _run(engine: Any, job: Any) -> None:
    handle = engine.apply_async(job, (), {}, {})
    outcome = engine.execute(handle.id, job_id=job.id, worker="bench")
    assert outcome.state == "succeeded", outcome


def _measure(engine: Any, job: Any, runs: int) -> dict[str, float]:
    cpu, server, wall = time.process_time(), _server_cpu(), time.perf_counter()
    for _ in range(runs):
        _run(engine, job)
    return {"cpu": (time.process_time() - cpu) / runs, "server": (_server_cpu() - server) / runs,
            "wall": (time.perf_counter() - wall) / runs}


def cost(items: int, rounds: int) -> None:
    global ARGS_ITEMS
    ARGS_ITEMS = items
    _, drop = _database()
    try:
        engine = _engine()
        jobs = _jobs(streams=True)
        for job in jobs.values():
            _run(engine, job)  # warm: connections, prepared statements
        found: dict[str, list[dict[str, float]]] = {k: [] for k in jobs}
        for _ in range(rounds):
            for name, job in jobs.items():  # interleaved, so drift hits all three alike
                found[name].append(_measure(engine, job, 1 if name != "quiet" else 20))
        med = {name: {k: statistics.median(m[k] for m in ms) for k in ("cpu", "server", "wall")}
               for name, ms in found.items()}
        print(f"{items} items in 3 steps, median of {rounds} rounds (this process and the Postgres server):")
        for name in ("thousand", "batched"):
            per = {k: (med[name][k] - med["quiet"][k]) / items for k in ("cpu", "server", "wall")}
            print(f"  {name:9s} {items / med[name]['wall']:8.0f} items/s   a run {med[name]['wall'] * 1000:7.1f} ms   "
                  f"an item: wall {per['wall'] * 1e6:6.1f} us, CPU here {per['cpu'] * 1e6:6.1f} us, "
                  f"Postgres {per['server'] * 1e6:6.1f} us")
        print(f"  quiet     (the same 3 steps, no item) a run {med['quiet']['wall'] * 1000:.1f} ms, "
              f"CPU here {med['quiet']['cpu'] * 1e3:.2f} ms, Postgres {med['quiet']['server'] * 1e3:.2f} ms")
    finally:
        drop()


def plain(runs: int) -> None:
    _, drop = _database()
    try:
        engine = _engine()
        job = _jobs(streams=False)["quiet"]
        for _ in range(50):
            _run(engine, job)
        m = _measure(engine, job, runs)
        print(json.dumps({"cpu_ms": m["cpu"] * 1e3, "server_ms": m["server"] * 1e3, "wall_ms": m["wall"] * 1e3}))
    finally:
        drop()


def ab(baseline: Path, pairs: int, runs: int) -> None:
    sides = {"this": (sys.executable, ROOT), "baseline": (baseline / ".venv" / "bin" / "python", baseline)}
    found: dict[str, list[dict[str, float]]] = {k: [] for k in sides}
    for _ in range(pairs):
        for name, (python, cwd) in sides.items():
            out = subprocess.run([str(python), str(HERE), "plain", "--runs", str(runs)], cwd=cwd, check=True,
                                 capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(cwd)})
            found[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"a plain 3-step run, {runs} runs a side, {pairs} pairs (this / baseline {baseline}):")
    for key in ("cpu_ms", "server_ms", "wall_ms"):
        ratios = [a[key] / b[key] for a, b in zip(found["this"], found["baseline"])]
        print(f"  {key:9s} this {statistics.median(m[key] for m in found['this']):.3f}  "
              f"baseline {statistics.median(m[key] for m in found['baseline']):.3f}  "
              f"ratio median {statistics.median(ratios):.3f} (pairs {min(ratios):.3f} .. {max(ratios):.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--items", type=int, default=1000)
    c.add_argument("--rounds", type=int, default=5)
    p = sub.add_parser("plain")
    p.add_argument("--runs", type=int, default=2000)
    a = sub.add_parser("ab")
    a.add_argument("--baseline", type=Path, required=True)
    a.add_argument("--pairs", type=int, default=8)
    a.add_argument("--runs", type=int, default=1000)
    args = parser.parse_args()
    if args.what == "cost":
        cost(args.items, args.rounds)
    elif args.what == "plain":
        plain(args.runs)
    else:
        ab(args.baseline, args.pairs, args.runs)


if __name__ == "__main__":
    main()
