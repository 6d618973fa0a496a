"""The engine against plain Celery, Procrastinate and (``--baseline``) another checkout, in one interleaved run.

    python -m bench.targets                               # 3 rounds; rewrites its block of docs/performance.md
    python -m bench.targets --baseline /path/to/checkout  # the engine before, as one more side
    python -m bench.targets --rounds 1 --runs 600 --no-write

On a Postgres and a Redis of its own (``harness.private_stack``: fsync and synchronous_commit
on), so nobody else's work is in the figures. Each round, every side takes its turn at:

* **CPU added**: ``Stack.cpu_per_run`` (one worker of 2; every process's CPU per run); this
  engine's and the baseline's minus plain Celery's of the same round;
* **trivial workload** (``bench.three``): drains of ``--runs`` queued runs at 1 worker x 2 and
  2 workers x 2, runs/s over the 5..95 % span; Procrastinate through ``bench.peers`` in its
  own virtualenv, pointed at the same private server;
* **p50** enqueue -> completion at one event every 20 ms (1 worker x 2);
* **I/O-like workload** (``bench/io_jobs.py``: 3 steps x 5 ms of waiting) at 1 worker x 8,
  against plain Celery running the same (``bench/plain_io_app.py``);
* **worker RSS**: the sum over the worker's processes (main, pool children, the lease
  renewer) after the trivial drain at ``-c 2`` and the I/O drain at ``-c 8``; PSS beside it
  (shared pages divided among the processes that map them), not a target;
* **single calls**: ``send_event`` and a direct job's ``.delay()`` one at a time, and
  Procrastinate's ``defer``, calls/s.

Targets (issue 28): CPU added <= 1.0 ms a run; I/O-like >= 0.9 x plain Celery; trivial >=
1.1 x Procrastinate (median of rounds, no round under 1.0) and p50 <= Procrastinate's; RSS <=
1.3 x plain Celery's at -c 2 and -c 8; single calls >= 1.2 x Procrastinate's ``defer``. With
``--baseline``, each of this engine's figures is also given as a ratio to the baseline's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from bench import harness as h
from bench import peersenv

MODULE = "bench.targets"
DB, PEER_DB = "motir_bench_targets", "motir_bench_targets_procrastinate"
QUEUE = "bench-targets"
CONFIGS = ((1, 2), (2, 2))


class Procrastinate:
    """Procrastinate running the three functions as one task, from the peers' virtualenv, driven
    from here (a ``harness.Side`` for ``Stack.cpu_per_run``: its workers' CPU is read from /proc)."""

    def __init__(self, server: str, queue: str = "bench") -> None:
        self.python, self.queue = str(peersenv.ensure(quiet=True)), queue
        self.db = h.Database.create(PEER_DB, server, migrate=False)
        self.env = {**h.child_env(), "BENCH_PEER_DSN": h.dsn(self.db.url), "PYTHONPATH": str(h.ROOT)}
        self._peer("from bench.peers.procrastinate_app import app\nwith app.open(): app.schema_manager.apply_schema()")

    def _peer(self, code: str) -> None:
        done = subprocess.run([self.python, "-c", code], env=self.env, cwd=h.ROOT, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"procrastinate: {done.stderr[-3000:]}")

    def reset(self) -> None:
        self.db.rows("TRUNCATE procrastinate_jobs CASCADE")

    def prequeue(self, n: int, offset: int = 0) -> None:
        self._peer("from bench.peers.procrastinate_app import app, three\nwith app.open():\n"
                   f"    for i in range({offset}, {offset + n}, 1000):\n"
                   f"        three.batch_defer(*({{'n': k}} for k in range(i, min({offset + n}, i + 1000))))")

    def settled(self) -> int:
        row = self.db.monitor.execute("SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'").fetchone()
        return int(row[0]) if row else 0

    def workers(self, n: int, concurrency: int, tag: str = "procrastinate") -> h.Procs:
        procs = h.Procs(tag)
        for i in range(n):
            procs.start([self.python, "-m", "procrastinate", "--app", "bench.peers.procrastinate_app.app",
                         "--log-level", "warning", "worker", "-q", self.queue, "-c", str(concurrency), "-n", f"{tag}-{i}"],
                        self.env, h.ROOT)
        return procs


def memory_mb(procs: h.Procs) -> dict[str, float]:
    """The workers' processes summed: RSS (each counts every page it maps) and PSS (a page shared by
    n processes counts 1/n in each: pool children share what the main process imported before
    forking them, which RSS counts in every one)."""
    rss = pss = 0
    for pid in procs.pids:
        for p, kb, _ in h.rss_tree(pid):
            rss += kb
            pss += h.pss_kb(p)
    return {"rss": rss / 1024, "pss": pss / 1024}


def drain(side: Any, runs: int, workers: int, concurrency: int, tag: str) -> tuple[float, dict[str, float]]:
    """(runs/s over the drain's 5..95 %, ``memory_mb`` of the workers once drained)."""
    side.reset()
    side.prequeue(runs)
    with side.workers(workers, concurrency, tag) as procs:
        procs.wait(lambda: side.settled() >= runs, 1200, poll=0.25)
        mem = memory_mb(procs)
    return h.drain_rate(side.finished().values()), mem


def peer(section: str, dsn: str, *args: Any) -> dict[str, Any]:
    return peersenv.run("bench.peers.procrastinate_side", section, "--admin-dsn", dsn, *map(str, args))


_DEFER = """
import json, os, sys, time
from bench.peers.procrastinate_app import app, three
with app.open():
    for i in range(50):
        three.defer(n=i)
    t = time.perf_counter()
    for i in range({calls}):
        three.defer(n=i)
    print(json.dumps({{"per_s": {calls} / (time.perf_counter() - t)}}))
"""


def defer_rate(dsn: str, calls: int) -> float:
    env = {**h.child_env(), "BENCH_PEER_DSN": dsn, "PYTHONPATH": str(h.ROOT)}
    done = subprocess.run([str(peersenv.PYTHON), "-c", _DEFER.format(calls=calls)], env=env, cwd=h.ROOT,
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return float(json.loads(done.stdout.strip().splitlines()[-1])["per_s"])


def call_rates(calls: int) -> dict[str, float]:
    """send_event and a direct job's .delay(), one at a time, published (calls/s)."""
    import motir_celery
    from bench.io_jobs import direct_noop as direct_job

    for i in range(50):
        motir_celery.send_event("bench.three", {"n": i})
        direct_job.delay(i)
    out = {}
    for name, fn in (("send_event", lambda i: motir_celery.send_event("bench.three", {"n": i})),
                     (".delay()", lambda i: direct_job.delay(i))):
        t = time.perf_counter()
        for i in range(calls):
            fn(i)
        out[name] = calls / (time.perf_counter() - t)
    return out


def one_round(stack: h.Stack, engines: dict[str, str | None], peers_db: Procrastinate, reuse: list[str],
              args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """Every side's turn at every figure, once."""
    admin_dsn = h.dsn(stack.pg.url("postgres"))

    def motir(engine: str | None, job: str = "bench.three") -> h.Motir:
        return h.Motir(stack.db, job=job, imports=h.IMPORTS, queue=QUEUE, env=dict(h.WORKER_ENV), engine=engine)

    got: dict[str, Any] = {"cpu": {}, "trivial": {}, "p50": {}, "io": {}, "rss": {}, "pss": {}, "calls": {}}
    cpu_sides: dict[str, Any] = {**{n: motir(e) for n, e in engines.items()}, "plain": h.Plain(),
                                 "procrastinate": peers_db}
    for name, side in cpu_sides.items():
        got["cpu"][name] = stack.cpu_per_run(side, args.cpu_runs, 200, tag=f"t-cpu-{name}")["total"]
    log("cpu " + ", ".join(f"{k} {v:.2f}" for k, v in got["cpu"].items()))
    for workers, conc in CONFIGS:
        label = f"{workers}x{conc}"
        sides: dict[str, Any] = {n: motir(e) for n, e in engines.items()}
        if (workers, conc) == (1, 2):
            sides["plain"] = h.Plain()
        got["trivial"][label] = {}
        for name, side in sides.items():
            got["trivial"][label][name], mem = drain(side, args.runs, workers, conc, f"t-{name}")
            if (workers, conc) == (1, 2):
                got["rss"].setdefault("c2", {})[name], got["pss"].setdefault("c2", {})[name] = mem["rss"], mem["pss"]
        got["trivial"][label]["procrastinate"] = peer(
            "throughput", admin_dsn, "--runs", args.runs, "--workers", workers, "--concurrency", conc,
            "--rounds", 1, *reuse)["rounds"][0]
        reuse[:] = ["--reuse"]
        log(f"trivial {label} " + ", ".join(f"{k} {v:.0f}" for k, v in got["trivial"][label].items()))
    for name, side in {**{n: motir(e) for n, e in engines.items()}, "plain": h.Plain()}.items():
        got["p50"][name] = h.latency(side, args.events, 0.02, 2)["p50"]
    got["p50"]["procrastinate"] = peer("latency", admin_dsn, "--events", args.events, "--interval", 0.02,
                                       "--concurrency", 2)["p50"]
    reuse[:] = []  # (its latency run made that database again)
    log("p50 " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in got["p50"].items()))
    for name, side in {**{n: motir(e, h.IO_JOB) for n, e in engines.items()}, "plain": h.PlainIO()}.items():
        got["io"][name], mem = drain(side, args.io_runs, 1, 8, f"t-io-{name}")
        got["rss"].setdefault("c8", {})[name], got["pss"].setdefault("c8", {})[name] = mem["rss"], mem["pss"]
    log("io -c 8 " + ", ".join(f"{k} {v:.0f}" for k, v in got["io"].items()) + "; rss " + json.dumps(
        {k: {s: round(m) for s, m in v.items()} for k, v in got["rss"].items()}))
    motir(None)  # the sender's engine: this checkout's, at the bench database
    got["calls"] = call_rates(args.calls)
    got["calls"]["procrastinate defer"] = defer_rate(h.dsn(peers_db.db.url), args.calls)
    log("calls/s " + ", ".join(f"{k} {v:.0f}" for k, v in got["calls"].items()))
    return got


def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    engines: dict[str, str | None] = {"motir": None, **({"baseline": args.baseline} if args.baseline else {})}
    with h.private_stack(DB) as stack:
        peers_db = Procrastinate(stack.pg.url("postgres"))  # its schema, for the CPU turn
        reuse: list[str] = []  # the peers' throughput database: made by its first call
        try:
            rounds = [one_round(stack, engines, peers_db, reuse, args, lambda m, r=r: log(f"round {r + 1}: {m}"))
                      for r in range(args.rounds)]
        finally:
            peers_db.db.close()
    return {"rounds": rounds, "engines": list(engines)}


def _med(rounds: list[dict[str, Any]], *path: str) -> float:
    def at(r: dict[str, Any]) -> float:
        for p in path:
            r = r[p]
        return float(r)  # type: ignore[arg-type]

    return h.median(at(r) for r in rounds)


def _per_round(rounds: list[dict[str, Any]], fn: Callable[[dict[str, Any]], float], fmt: str = "{:.2f}") -> str:
    return ", ".join(fmt.format(fn(r)) for r in rounds)


def render(result: dict[str, Any], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    rs: list[dict[str, Any]] = result["rounds"]
    engines: list[str] = result["engines"]
    names = {"motir": "this engine", "baseline": f"baseline ({meta.get('baseline_commit') or 'another checkout'})"}
    md = ["### The engine against plain Celery, Procrastinate and a baseline (generated)", "",
          f"Generated by `{meta['command']}` ({meta['date']}, {meta['elapsed'] / 60:.0f} min; {meta['machine']}; "
          f"commit {meta['commit']}). Method: `bench/targets.py`; {len(rs)} rounds, the sides taking turns; "
          "each figure the median of the rounds (the rounds in parentheses).", "",
          "| target | " + " | ".join(names[e] for e in engines) + " | met |", "|---|" + "---:|" * len(engines) + "---|"]

    def row(what: str, fn: Callable[[dict[str, Any], str], float], ok: Callable[[float, list[float]], bool],
            fmt: str = "{:.2f}") -> None:
        cells, verdict = [], ""
        for e in engines:
            per = [fn(r, e) for r in rs]
            cells.append(f"**{fmt.format(h.median(per))}** ({', '.join(fmt.format(x) for x in per)})")
            if e == "motir":
                verdict = "met" if ok(h.median(per), per) else "MISSED"
        md.append(f"| {what} | " + " | ".join(cells) + f" | {verdict} |")

    row("CPU durability adds, ms a run (- plain Celery's) <= 1.0", lambda r, e: r["cpu"][e] - r["cpu"]["plain"],
        lambda m, _: m <= 1.0)
    row("I/O-like workload (3 x 5 ms, 1 x 8) / plain Celery >= 0.9", lambda r, e: r["io"][e] / r["io"]["plain"],
        lambda m, _: m >= 0.9)
    for label in ("1x2", "2x2"):
        row(f"trivial workload {label} / Procrastinate >= 1.1, no round < 1.0",
            lambda r, e, label=label: r["trivial"][label][e] / r["trivial"][label]["procrastinate"],
            lambda m, per: m >= 1.1 and min(per) >= 1.0)
    row("p50 at one event / 20 ms, ms (<= Procrastinate's)", lambda r, e: r["p50"][e] * 1e3,
        lambda m, _: m <= _med(rs, "p50", "procrastinate") * 1e3, "{:.1f}")
    for c in ("c2", "c8"):
        row(f"worker RSS at -{c[0]} {c[1:]} / plain Celery <= 1.3", lambda r, e, c=c: r["rss"][c][e] / r["rss"][c]["plain"],
            lambda m, _: m <= 1.3)
    ab = "baseline" in engines  # this engine / the baseline, median of the rounds' ratios: the A/B
    md += ["", "Beside them (medians; rounds in parentheses):", "",
           "| figure | " + " | ".join(names[e] for e in engines) + (" | this / baseline" if ab else "")
           + " | plain Celery | Procrastinate |", "|---|" + "---:|" * (len(engines) + 2 + ab)]

    def fig(what: str, key: Callable[[dict[str, Any], str], float], fmt: str = "{:.0f}", plain: bool = True,
            peer_: bool = True) -> None:
        cells = [f"{fmt.format(h.median(key(r, e) for r in rs))} ({_per_round(rs, lambda r, e=e: key(r, e), fmt)})"
                 for e in engines]
        if ab:
            cells.append(f"{h.median(key(r, 'motir') / key(r, 'baseline') for r in rs):.2f}")
        cells.append(f"{fmt.format(h.median(key(r, 'plain') for r in rs))}" if plain else "")
        cells.append(f"{fmt.format(h.median(key(r, 'procrastinate') for r in rs))}" if peer_ else "")
        md.append(f"| {what} | " + " | ".join(cells) + " |")

    fig("CPU ms a run, every process", lambda r, e: r["cpu"][e], "{:.2f}")
    for label in ("1x2", "2x2"):
        fig(f"trivial {label}, runs/s", lambda r, e, label=label: r["trivial"][label].get(e, float("nan")),
            plain=label == "1x2")
    fig("p50 ms", lambda r, e: r["p50"][e] * 1e3, "{:.1f}")
    fig("I/O-like 1 x 8, runs/s (Celery's ceiling 533)", lambda r, e: r["io"][e], peer_=False)
    fig("worker RSS MB at -c 2", lambda r, e: r["rss"]["c2"][e], peer_=False)
    fig("worker RSS MB at -c 8", lambda r, e: r["rss"]["c8"][e], peer_=False)
    if all("pss" in r for r in rs):
        for c in ("c2", "c8"):
            fig(f"worker PSS MB at -{c[0]} {c[1:]}", lambda r, e, c=c: r["pss"][c][e], peer_=False)
            fig(f"worker PSS at -{c[0]} {c[1:]} / plain Celery's", lambda r, e, c=c: r["pss"][c][e] / r["pss"][c]["plain"],
                "{:.2f}", peer_=False)
    defer = _med(rs, "calls", "procrastinate defer")
    md += ["", f"Single calls, one at a time (calls/s, medians): send_event {_med(rs, 'calls', 'send_event'):.0f}, "
           f".delay() {_med(rs, 'calls', '.delay()'):.0f}, Procrastinate's defer {defer:.0f}: ratios "
           f"{_med(rs, 'calls', 'send_event') / defer:.2f} and {_med(rs, 'calls', '.delay()') / defer:.2f} "
           "(target >= 1.2)."]
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=2000, help="runs per trivial drain")
    p.add_argument("--cpu-runs", type=int, default=2000, help="runs per CPU drain")
    p.add_argument("--io-runs", type=int, default=2000, help="runs per I/O-like drain")
    p.add_argument("--events", type=int, default=250)
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--baseline", help="another checkout whose motir_celery runs as one more side")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--json", help="also write the raw results here")
    args = p.parse_args(argv)
    if args.baseline:
        args.baseline = str(Path(args.baseline).resolve())
    started, t0, machine = h.now(), time.monotonic(), h.machine(load=True)

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.0f}s] {msg}", file=sys.stderr, flush=True)

    peersenv.ensure(quiet=True)
    result = run(args, log)
    meta = {"command": h.command(MODULE, argv), "date": started, "elapsed": time.monotonic() - t0,
            "machine": machine, "commit": h.describe(), "baseline_commit": h.describe(args.baseline) if args.baseline else ""}
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, **result}, indent=1))
    h.write_block(MODULE, render(result, args, meta), h.PERFORMANCE_DOC, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
