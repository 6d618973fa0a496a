"""Issue 28's cuts, each measured with it and without it in one run: the ablation of what has no switch.

    python -m bench.cuts                               # every cut, 3 rounds; rewrites its block of docs/performance.md
    python -m bench.cuts --only held_connection,kept_cursor --rounds 2 --no-write

A cut that removes work from a run leaves no switch behind (``MOTIR_*``, which
``bench.ablation`` flips). So each cut here says how to *undo* it: source edits
(``Undo``) that turn the engine back to what it did before, checked to apply (a cut
whose code moved fails loudly rather than measure nothing), or an environment
variable for a cut that kept one. The engine measured is a snapshot of this
checkout's ``motir_celery`` taken at the start (others may edit the work tree
meanwhile); each cut's OFF engine is that snapshot with its undo applied.

The measurement runs on a Postgres and a Redis of the bench's own (``motir_celery.dev.private``;
fsync and synchronous_commit on), so nobody else's work is in it. It is
``bench.ablation.measure`` (a drain of ``--runs`` queued runs on
1 worker x 2: runs/s and CPU per run; then, on the same workers, one event every
20 ms: p50 enqueue -> completion), in a fresh process each time, and its schedule:
every OFF between two ONs, rotated each round, a control row (nothing undone) for
the drift. Rule (issue 16): a mechanism stays if it buys >= 5 % throughput or
>= 0.3 ms p50. A cut that only *removes* work passes by being less; its row is
there to show what it bought.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import harness as h
from bench.ablation import KEEP_MS, KEEP_RATIO, pair, schedule, verdict

DB = "motir_bench_cuts"
QUEUE = "bench-cuts"
MODULE = "bench.cuts"
CONTROL = "control"
#: A private server as a production one commits: every commit flushed (bench.cpu_profile's).
SERVER_SETTINGS = ("fsync=on", "full_page_writes=on", "synchronous_commit=on")


@dataclass(frozen=True)
class Undo:
    """In ``path`` (under motir_celery/), replace ``new`` (what the cut wrote) with ``old``."""

    path: str
    new: str
    old: str


@dataclass(frozen=True)
class Cut:
    key: str
    what: str
    undo: tuple[Undo, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # the OFF setting, for a cut that kept a switch
    commit: str = ""  # where it landed


CUTS = (
    Cut("kept_cursor", "one kept cursor per connection, tuple rows with cached column names (not a dict_row "
        "cursor per statement)",
        (Undo("store/driver.py", """    kept = _kept_with(raw)
    cursor = kept.cursor
    try:
""", """    kept = None
    try:
"""),
         Undo("store/driver.py", """        cursor.execute(statement.sql, params, prepare=prepare)
        answer = cursor.pgresult
        if answer is None or answer.status != pq.ExecStatus.TUPLES_OK:
            return []
        names = _columns.get(statement.sql)
        if names is None or len(names) != answer.nfields:
            names = _columns[statement.sql] = tuple(column.name for column in cursor.description or ())
        return [dict(zip(names, values)) for values in cursor.fetchall()]
""", """        from psycopg.rows import dict_row

        with raw.cursor(row_factory=dict_row) as cursor:
            cursor.execute(statement.sql, params, prepare=prepare)
            return cursor.fetchall() if cursor.description is not None else []
""")),
        commit="d7259a8"),
    Cut("libpq_statements", "the step record and the settle sent prepared through libpq's PQexecPrepared, not "
        "psycopg's cursor",
        (Undo("store/sql/worker.py", "    libpq=True,  # three a run: through libpq itself (driver.py)\n", ""),
         Undo("store/sql/worker.py", "    libpq=True,  # once a run: through libpq itself (driver.py)\n", "")),
        commit="c41b2d5"),
    Cut("settle_async_commit", "a succeeded run's settle does not wait for the WAL flush (hazard: "
        "store/sql/worker.py, SETTLE_SUCCEEDED)", env={"MOTIR_SETTLE_ASYNC_COMMIT": "0"}, commit="6f43bf0"),
)

#: Every cut at once: what issue 28 took off a run on this same tree, the others' changes since kept.
CUTS += (Cut("all", "all of the above undone at once (the engine as it ran before issue 28's cuts, everything "
             "else as it is now)", tuple(u for c in CUTS for u in c.undo),
             {k: v for c in CUTS for k, v in c.env.items()}, commit="-"),)


def snapshot(into: Path) -> Path:
    """This checkout's motir_celery, copied (the work tree is shared and may change under a run)."""
    shutil.copytree(h.ROOT / "motir_celery", into / "motir_celery",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return into


def undone(on: Path, cut: Cut, into: Path) -> Path:
    """``on`` with ``cut`` undone."""
    shutil.copytree(on, into)
    for u in cut.undo:
        path = into / "motir_celery" / u.path
        text = path.read_text()
        if text.count(u.new) != 1:
            raise SystemExit(f"{cut.key}: {u.path} no longer has the cut's code once; update bench/cuts.py")
        path.write_text(text.replace(u.new, u.old))
    return into


# The engine is the tree's; bench (the measurement) is this checkout's, put first after motir_celery is in.
_CHILD = ("import json, sys; import motir_celery; sys.path.insert(0, sys.argv[1]); from bench.ablation import measure; "
          "print(json.dumps(measure(json.loads(sys.argv[2]))))")


def slot(url: str, tree: Path, env: dict[str, str], runs: int, events: int) -> dict[str, Any]:
    child = h.child_env(str(tree), MOTIR_DATABASE_URL=url, MOTIR_IMPORTS="bench.workload", MOTIR_QUEUE=QUEUE,
                        BENCH_ENGINE_PATH=str(tree), **env)
    spec = json.dumps({"url": url, "queue": QUEUE, "runs": runs, "events": events})
    done = subprocess.run([sys.executable, "-c", _CHILD, str(h.ROOT), spec], env=child, cwd=tree,
                          capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"measurement failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# In-process: the runner alone (runner.execute, what a worker's task calls), no Celery, no broker:
# the CPU of this process and of its Postgres backends per run. Steadier than a drain's figures on
# a shared machine, and it is the engine's own cost, which is what the cuts change.
_INPROCESS = """
import json, os, sys, time
import motir_celery
sys.path.insert(0, sys.argv[1])
import bench.workload
from bench import harness as h
from motir_celery.core.worker import runner
spec = json.loads(sys.argv[2])
db = h.Database(spec["url"])
db.truncate()
ids = [r[0] for r in db.rows(h.PREQUEUE, {"job": "bench.three", "lo": 1, "hi": spec["runs"] + 100,
                                          "max_attempts": 3, "policy": "transient"})]
for run_id in ids[:100]:
    runner.execute(run_id, job_id="bench.three", worker="cuts/1")
backends = db.backends()
walls = []
b0, c0 = h.read_cpu(backends, tree=False), time.process_time()
for run_id in ids[100:]:
    t = time.perf_counter()
    assert runner.execute(run_id, job_id="bench.three", worker="cuts/1").state == "succeeded"
    walls.append(time.perf_counter() - t)
c1, b1 = time.process_time(), h.read_cpu(backends, tree=False)
n = spec["runs"]
print(json.dumps({"client_ms": (c1 - c0) / n * 1e3, "backend_ms": h.cpu_ms(b0, b1) / n,
                  "wall_ms": h.median(walls) * 1e3}))
"""


def inprocess(url: str, tree: Path, env: dict[str, str], runs: int) -> dict[str, float]:
    child = h.child_env(str(tree), MOTIR_DATABASE_URL=url, MOTIR_IMPORTS="bench.workload", MOTIR_QUEUE=QUEUE, **env)
    done = subprocess.run([sys.executable, "-c", _INPROCESS, str(h.ROOT), json.dumps({"url": url, "runs": runs})],
                          env=child, cwd=tree, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"in-process measurement failed:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def render(rows: dict[str, dict[str, Any]], cuts: dict[str, Cut], meta: dict[str, Any]) -> str:
    control = rows.get(CONTROL)
    drift_tp = max(abs(x - 1) for x in control["ratios"]) if control else 0.0
    drift_ms = max(abs(x) for x in control["deltas"]) * 1e3 if control else 0.0
    md = ["## Ablation of issue 28's cuts (generated)", "",
          f"Generated by `{meta['command']}` ({meta['date']}, {meta['elapsed'] / 60:.0f} min; {meta['machine']}; "
          f"engine: a snapshot of `{meta['commit']}`). Method: `bench/cuts.py` (each cut undone by its own source "
          f"edits; `bench.ablation`'s measurement and schedule): {meta['runs']:,}-run drains and {meta['events']} "
          f"events at 20 ms on 1 worker x 2, {meta['rounds']} rounds, every OFF between two ONs. Rule: keep for "
          f">= {(KEEP_RATIO - 1) * 100:.0f} % throughput or >= {KEEP_MS} ms p50; CPU is not in the rule but is "
          "what issue 28 is about.", "",
          "| cut (commit) | throughput with, runs/s | without | ratio | p50 with, ms | without | delta, ms "
          "| CPU ms/run with | without | CPU saved | verdict |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"] if rows else md_head(meta)
    for key, r in rows.items():
        if key == CONTROL:
            name, v = "control: nothing undone", "(drift)"
        else:
            c = cuts[key]
            name, v = f"{c.what} ({c.commit})", verdict(r)
            if control and not (r["ratio"] - 1 > drift_tp or r["delta"] * 1e3 > drift_ms):
                v += " (within the control's drift)"
        md.append(f"| {name} | {r['on_tp']:.0f} | {r['off_tp']:.0f} | {r['ratio']:.2f} | {r['on_p50'] * 1e3:.2f} "
                  f"| {r['off_p50'] * 1e3:.2f} | {r['delta'] * 1e3:+.2f} | {r['on_cpu']:.2f} | {r['off_cpu']:.2f} "
                  f"| {r['off_cpu'] - r['on_cpu']:+.2f} | {v} |")
    md += [] if not rows else ["", "Per round (ratio; delta ms): " + "; ".join(
        f"{key} " + ", ".join(f"{x:.2f}" for x in r["ratios"]) + " / "
        + ", ".join(f"{d * 1e3:+.2f}" for d in r["deltas"]) for key, r in rows.items()) + "."]
    steady = meta.get("inprocess")
    if steady:
        md += ["", f"In process (`runner.execute` alone, {meta['inprocess_runs']:,} runs one after another a "
               "measurement, the same schedule: every OFF between two ONs, medians of the rounds): CPU ms per run of "
               "the process and of its Postgres backends, and the median time one run takes (claim to settle: its "
               "round trips and flushes, the part of p50 the engine owns: it counts toward the p50 rule, and "
               "is steadier than the drains on a shared machine). A cut of the worker's other processes "
               "(the renewer's) shows in the drains only.", "",
               "| cut | client with | without | saved | Postgres with | without | saved | a run's time (median) with, ms "
               "| without | saved | verdict |",
               "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for key, r in steady.items():
            name = "control: nothing undone" if key == CONTROL else cuts[key].what
            saved_ms = r["off_wall"] - r["on_wall"]
            v = "(drift)" if key == CONTROL else ("keep (a run's time)" if saved_ms >= KEEP_MS else "remove")
            md.append(f"| {name} | {r['on_client']:.3f} | {r['off_client']:.3f} | {r['off_client'] - r['on_client']:+.3f} "
                      f"| {r['on_backend']:.3f} | {r['off_backend']:.3f} | {r['off_backend'] - r['on_backend']:+.3f} "
                      f"| {r['on_wall']:.2f} | {r['off_wall']:.2f} | {saved_ms:+.2f} | {v} |")
    return "\n".join(md) + "\n"


def md_head(meta: dict[str, Any]) -> list[str]:
    return ["## Ablation of issue 28's cuts (generated)", "",
            f"Generated by `{meta['command']}` ({meta['date']}, {meta['elapsed'] / 60:.0f} min; {meta['machine']}; "
            f"engine: a snapshot of `{meta['commit']}`). Method: `bench/cuts.py`; {meta['rounds']} rounds."]


def pair_inprocess(seq: list[str | None], results: list[dict[str, float]], key: str) -> dict[str, float]:
    """Each OFF of ``key`` against the mean of the ONs beside it; medians over the rounds."""
    xs: dict[str, list[float]] = {f"{w}_{m}": [] for w in ("on", "off") for m in ("client", "backend", "wall")}
    for i, k in enumerate(seq):
        if k == key:
            for m in ("client", "backend", "wall"):
                xs[f"on_{m}"].append((results[i - 1][f"{m}_ms"] + results[i + 1][f"{m}_ms"]) / 2)
                xs[f"off_{m}"].append(results[i][f"{m}_ms"])
    return {k: h.median(v) for k, v in xs.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated cuts: " + ",".join(c.key for c in CUTS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=1200)
    p.add_argument("--events", type=int, default=150)
    p.add_argument("--no-control", dest="control", action="store_false")
    p.add_argument("--no-write", action="store_true", help="print the block; leave docs/performance.md alone")
    p.add_argument("--inprocess-runs", type=int, default=1500, help="runs per in-process measurement (0: none)")
    p.add_argument("--no-drains", dest="drains", action="store_false", help="the in-process measurements only")
    args = p.parse_args(argv)
    h.need("MOTIR_DATABASE_URL", "CELERY_BROKER_URL")
    wanted = args.only.split(",") if args.only else [c.key for c in CUTS if c.key != "all"]
    cuts = {c.key: c for c in CUTS if c.key in wanted}
    if set(wanted) - set(cuts):
        p.error(f"unknown cut(s): {', '.join(sorted(set(wanted) - set(cuts)))}")
    started, t0, machine = h.now(), time.monotonic(), h.machine(load=True)
    commit = subprocess.run(["git", "-C", str(h.ROOT), "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="motir-bench-cuts-"))
    on = snapshot(work / "on")
    trees: dict[str | None, Path] = {None: on, CONTROL: on}
    envs: dict[str | None, dict[str, str]] = {None: {}, CONTROL: {}}
    for key, c in cuts.items():
        trees[key] = undone(on, c, work / key) if c.undo else on
        envs[key] = dict(c.env)
    keys = list(cuts) + ([CONTROL] if args.control else [])
    plan = schedule(keys, args.rounds)
    from motir_celery.dev.private import PrivatePostgres, PrivateRedis

    # Services of the bench's own: nobody else's statements or messages in the figures.
    h.exit_on_sigterm()  # (before the first private server: a kill stops them all)
    redis = PrivateRedis(work / "redis").start()
    os.environ["CELERY_BROKER_URL"] = redis.url
    pg = PrivatePostgres(settings=SERVER_SETTINGS)
    seq: list[str | None] = []
    results: list[dict[str, Any]] = []
    steady_seq: list[str | None] = []
    steady: list[dict[str, float]] = []
    try:
        pg.init()
        db = h.Database.create(DB, pg.url("postgres"))
        steady_keys = keys
        steady_plan = schedule(steady_keys, args.rounds) if args.inprocess_runs else []
        for i, key in enumerate(steady_plan):
            r = inprocess(db.url, trees[key], envs[key], args.inprocess_runs)
            steady_seq.append(key)
            steady.append(r)
            print(f"[{time.monotonic() - t0:6.0f}s] in process {i + 1}/{len(steady_plan)} {key or 'ON':<18} "
                  f"client {r['client_ms']:.3f} ms/run  Postgres {r['backend_ms']:.3f} ms/run", file=sys.stderr, flush=True)
        for i, key in enumerate(plan if args.drains else []):
            r = slot(db.url, trees[key], envs[key], args.runs, args.events)
            seq.append(key)
            results.append(r)
            print(f"[{time.monotonic() - t0:6.0f}s] {i + 1}/{len(plan)} {key or 'ON':<18} {r['tp']:7.1f} runs/s  "
                  f"p50 {r['p50'] * 1e3:5.2f} ms  cpu {r['cpu_ms']:.2f} ms/run", file=sys.stderr, flush=True)
    finally:
        pg.close()
        redis.close()
        shutil.rmtree(work, ignore_errors=True)
    rows = {key: pair(seq, results, key) for key in keys} if results else {}
    meta = {"command": h.command(MODULE, argv), "date": started, "elapsed": time.monotonic() - t0, "machine": machine,
            "commit": commit, "runs": args.runs, "events": args.events, "rounds": args.rounds,
            "inprocess_runs": args.inprocess_runs,
            "inprocess": {key: pair_inprocess(steady_seq, steady, key) for key in dict.fromkeys(steady_seq) if key}}
    block = render(rows, cuts, meta)
    Path(tempfile.gettempdir(), "bench-cuts.json").write_text(json.dumps(
        {"meta": meta, "schedule": seq, "results": results, "inprocess": [steady_seq, steady]}, indent=1))
    print(block)
    if not args.no_write:
        h.write_between(h.ROOT / "docs" / "performance.md", f"<!-- {MODULE}: begin (generated by python -m {MODULE}; "
                        "edits here are lost) -->", f"<!-- {MODULE}: end -->", block, anchor=h.NOTES_MARKER)
    return 0


if __name__ == "__main__":
    sys.exit(main())
