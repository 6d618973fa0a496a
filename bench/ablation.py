"""Ablation: what each performance mechanism buys, measured with it on and off in one run.

    python -m bench.ablation              # every mechanism, <= ~10 min; rewrites its block of docs/performance.md
    python -m bench.ablation --only direct_publish --rounds 2 --output -
    python -m bench.ablation --engine /path/to/checkout --output -   # another checkout's motir_celery

Issue 16's rule: a mechanism that buys under 5 % throughput and under 0.3 ms p50 is
removed. Each is turned off in the engine's ``Tuning`` (core/engine.py; prepared statements
in its settings) through the bench's own ``BENCH_TUNING`` (e.g. ``claim_async_commit=0``),
which bench/motir_app.py builds its engine from: the workers run that app and the sender
imports it (``MECHANISMS``; ON is no variable, the engine's defaults). A checkout from
before the engine object (``--engine``) is switched by the environment variable its engine
reads instead. Every measurement runs in a fresh process, on the checkout's own code
(``measure``): a drain of ``--runs`` queued runs on 1 worker x 2
(runs/s, and CPU per run: not in the rule), then on the same workers one event every 20 ms
(p50 enqueue -> completion, the sender included). Drift here is larger than the effects, so
every OFF measurement sits between two ON ones (ON, off A, ON, off B, ..., ON, rotated each
round); a ratio or delta is the median over the rounds of OFF against the mean of its two
ONs, and the control row (nothing off) is the drift alone. ``--budget`` (minutes) stops
after a round, from the second on, when the next would end past it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import harness as h

DB = "motir_bench_ablation"
QUEUE = "bench-ablation"
INTERVAL = 0.02
#: Issue 16: a mechanism stays if it buys at least this much.
KEEP_RATIO, KEEP_MS = 1.05, 0.3


@dataclass(frozen=True)
class Mechanism:
    key: str
    field: str  # its name in BENCH_TUNING (bench/motir_app.py): a field of Tuning, or prepared_statements
    var: str  # the environment switch of an engine from before the engine object (af00f2f and older)
    on: str  # the engine's default (the same value for the field and the switch)
    off: str
    what: str


MECHANISMS = (
    Mechanism("direct_publish", "direct_publish", "MOTIR_DIRECT_PUBLISH", "1", "0",
              "a run's message pushed onto Redis with one LPUSH instead of Celery's send_task"),
    Mechanism("prepared_statements", "prepared_statements", "MOTIR_PREPARED_STATEMENTS", "1", "0",
              "server-side prepared statements for claim, step write and settle"),
    Mechanism("claim_async_commit", "claim_async_commit", "MOTIR_CLAIM_ASYNC_COMMIT", "1", "0",
              "the claim's commit does not wait for the WAL flush"),
    Mechanism("settle_async_commit", "settle_async_commit", "MOTIR_SETTLE_ASYNC_COMMIT", "1", "0",
              "a succeeded run's settle does not wait for the WAL flush"),
    Mechanism("no_ack_emulation", "redis_ack_emulation", "MOTIR_REDIS_ACK_EMULATION", "0", "1",
              "kombu's Redis ack emulation off in the app the engine builds (on is kombu's default)"),
)
CONTROL = "control"


def tuned() -> bool:
    """Whether the checkout measured (BENCH_ENGINE_PATH or this one) builds its bench engine from BENCH_TUNING."""
    app = h.child_cwd() / "bench" / "motir_app.py"
    return app.is_file() and "BENCH_TUNING" in app.read_text(errors="replace")


def engine_reads(var: str) -> bool:
    """Whether the engine that the workers run (BENCH_ENGINE_PATH or this checkout) mentions ``var``."""
    return any(var in p.read_text(errors="replace") for p in (h.child_cwd() / "motir_celery").rglob("*.py"))


def switch(m: Mechanism) -> dict[str, str]:
    """The environment that turns ``m`` off in the checkout measured (ON is no variable: its defaults)."""
    return {"BENCH_TUNING": f"{m.field}={m.off}"} if tuned() else {m.var: m.off}


def switch_name(m: Mechanism) -> str:
    return f"`BENCH_TUNING` `{m.field}`" if tuned() else f"`{m.var}`"


# --- one measurement, in a process of its own ----------------------------------------


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """A drain (``harness.settle``, CPU from 10 % of it), then a latency run on the same, now warm,
    workers (``harness.send_paced``), with this process's environment: one worker start, not two."""
    motir = h.Motir(h.Database(spec["url"]), queue=spec["queue"], app="bench.motir_app")
    import bench.motir_app  # noqa: F401  (its engine, BENCH_TUNING's, made current: the sender's too)

    n, events = spec["runs"], spec["events"]
    motir.reset()
    t0 = time.perf_counter()
    motir.prequeue(n)
    with motir.workers(1, 2, "ablation") as procs:
        cpu = h.settle(motir, procs, n, meter=h.Meter(procs, motir.backends), timeout=180, poll=0.05)
        t1 = time.perf_counter()
        sent = h.send_paced(motir, procs, events, INTERVAL, before=n, warm=False)
    done = motir.finished()
    lat = h.latencies(done, sent)
    return {"tp": h.drain_rate(at for k, at in done.items() if k not in sent), "p50": lat["p50"], "p99": lat["p99"],
            "cpu_ms": cpu["total_ms"], "tp_s": t1 - t0, "lat_s": time.perf_counter() - t1}


# The checkout measured (--engine, or this one) runs its own bench.ablation.measure: the child's
# working directory is first on its path, for motir_celery and bench alike.
_CHILD = ("import json, sys; from bench.ablation import measure; "
          "print(json.dumps(measure(json.loads(sys.argv[1]))))")


def _slot(url: str, setting: dict[str, str], runs: int, events: int) -> dict[str, Any]:
    env = h.child_env(MOTIR_DATABASE_URL=url, MOTIR_IMPORTS="bench.workload", MOTIR_QUEUE=QUEUE)
    env.pop("BENCH_TUNING", None)  # ON: the engine's defaults
    env.update(setting)
    spec = json.dumps({"url": url, "queue": QUEUE, "runs": runs, "events": events})
    last = ""
    for attempt in range(2):  # the engine may be mid-edit in a work tree: one retry
        done = subprocess.run([sys.executable, "-c", _CHILD, spec], env=env, cwd=h.child_cwd(),
                              capture_output=True, text=True, timeout=600)
        if done.returncode == 0:
            result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
            return result
        last = done.stderr[-3000:]
        print(f"    measurement failed (attempt {attempt + 1}):\n{last}", file=sys.stderr, flush=True)
        time.sleep(5)
    raise RuntimeError(f"measurement failed twice: {last}")


# --- the interleaved schedule ---------------------------------------------------------


def schedule(keys: list[str], rounds: int) -> list[str | None]:
    """ON (None), then each key followed by ON, in an order rotated each round."""
    seq: list[str | None] = [None]
    for r in range(rounds):
        k = r % len(keys)
        for key in keys[k:] + keys[:k]:
            seq += [key, None]
    return seq


def pair(seq: list[str | None], results: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Each OFF of ``key`` against the mean of the ON measurements beside it."""
    xs: dict[str, list[float]] = {k: [] for k in ("on_tp", "off_tp", "ratios", "on_p50", "off_p50", "deltas",
                                                  "on_cpu", "off_cpu")}
    for i, k in enumerate(seq):
        if k == key:
            on = {m: (results[i - 1][m] + results[i + 1][m]) / 2 for m in ("tp", "p50", "cpu_ms")}
            off = results[i]
            for name, x in (("on_tp", on["tp"]), ("off_tp", off["tp"]), ("ratios", on["tp"] / off["tp"]),
                            ("on_p50", on["p50"]), ("off_p50", off["p50"]), ("deltas", off["p50"] - on["p50"]),
                            ("on_cpu", on["cpu_ms"]), ("off_cpu", off["cpu_ms"])):
                xs[name].append(x)
    medians = {k: h.median(v) for k, v in xs.items()}
    return {**medians, "ratio": medians["ratios"], "delta": medians["deltas"], "ratios": xs["ratios"],
            "deltas": xs["deltas"]}


def verdict(row: dict[str, Any]) -> str:
    tp, ms = row["ratio"] >= KEEP_RATIO, row["delta"] * 1e3 >= KEEP_MS
    if tp or ms:
        return "keep (" + " and ".join(x for x, y in (("throughput", tp), ("p50", ms)) if y) + ")"
    return "remove"


# --- report -----------------------------------------------------------------------


def render(rows: dict[str, dict[str, Any]], skipped: list[Mechanism], meta: dict[str, Any]) -> str:
    by_key = {m.key: m for m in MECHANISMS}
    control = rows.get(CONTROL)
    drift_tp = max(abs(x - 1) for x in control["ratios"]) if control else 0.0
    drift_ms = max(abs(x) for x in control["deltas"]) * 1e3 if control else 0.0
    marked = False
    stopped = (f" of {meta['planned']} (stopped at the {meta['budget']:g} min budget)"
               if meta["rounds"] < meta["planned"] else "")
    md = ["### Each mechanism on and off (generated)", "",
          f"Generated by `{meta['command']}` ({meta['date']}, {meta['elapsed'] / 60:.1f} min; load at start "
          f"{meta['load']}; commit {meta['commit']}). Method: `bench/ablation.py`'s docstring. 1 worker x 2; a drain "
          f"of {meta['runs']:,} queued runs and {meta['events']} events one every {INTERVAL * 1e3:.0f} ms (p50 "
          f"enqueue -> completion) a measurement; {meta['rounds']} rounds{stopped}, every OFF between two ONs "
          "(the defaults); ratio and delta are medians of the rounds' OFF against the mean of its two ONs; the "
          "control row switches nothing off (its ratio and delta are the drift). Rule: keep for >= 5 % throughput "
          "or >= 0.3 ms p50. CPU ms a run (worker and its Postgres backends) is not in the rule.", "",
          "| mechanism (switch: on / off) | throughput on, runs/s | off | ratio on/off, median of rounds "
          "| p50 on, ms | off | delta off - on, ms, median of rounds | verdict | CPU ms/run on | off |",
          "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for key, r in rows.items():
        if key == CONTROL:
            name, v = "control: nothing switched off", "(noise)"
        else:
            m = by_key[key]
            name, v = f"{m.what} ({switch_name(m)}: {m.on} / {m.off})", verdict(r)
            if control and not (r["ratio"] - 1 > drift_tp or r["delta"] * 1e3 > drift_ms):
                v, marked = v + " *", True
        md.append(f"| {name} | {r['on_tp']:.0f} | {r['off_tp']:.0f} | {r['ratio']:.2f} | {r['on_p50'] * 1e3:.2f} "
                  f"| {r['off_p50'] * 1e3:.2f} | {r['delta'] * 1e3:+.2f} | {v} | {r['on_cpu']:.2f} | {r['off_cpu']:.2f} |")
    if marked:
        md += ["", "\\* what it buys is within the control's drift (its rounds' ratios off 1 by up to "
               f"{drift_tp:.2f}, their deltas up to {drift_ms:.2f} ms): the verdict rests on noise; rerun when the "
               "machine is quiet."]
    md += ["", "Per round (ratio; delta ms): " + "; ".join(
        f"{key} " + ", ".join(f"{x:.2f}" for x in r["ratios"]) + " / "
        + ", ".join(f"{d * 1e3:+.2f}" for d in r["deltas"]) for key, r in rows.items()) + "."]
    if skipped:
        md += ["", "Not measured (the engine measured does not read the switch): "
               + ", ".join(f"`{m.var}`" for m in skipped) + "."]
    return "\n".join(md) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ablation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds at most (default 3)")
    parser.add_argument("--budget", type=float, default=10.0,
                        help="minutes: after 2 rounds, no round is started that would end past it (default 10)")
    parser.add_argument("--runs", type=int, default=1200, help="runs per throughput drain")
    parser.add_argument("--events", type=int, default=150, help="events per latency measurement")
    parser.add_argument("--only", help="comma-separated mechanisms: " + ",".join(m.key for m in MECHANISMS))
    parser.add_argument("--no-control", dest="control", action="store_false", help="skip the control row")
    parser.add_argument("--output", default=str(h.PERFORMANCE_DOC),
                        help="markdown file whose ablation block is rewritten ('-' for none)")
    parser.add_argument("--keep", action="store_true", help="keep the ablation database afterwards")
    parser.add_argument("--engine", help="path of another checkout whose motir_celery is measured")
    args = parser.parse_args()
    if args.engine:
        os.environ["BENCH_ENGINE_PATH"] = str(Path(args.engine).resolve())
    h.need("MOTIR_DATABASE_URL", "CELERY_BROKER_URL")
    wanted = set(args.only.split(",")) if args.only else {m.key for m in MECHANISMS}
    unknown = wanted - {m.key for m in MECHANISMS}
    if unknown:
        parser.error(f"unknown mechanism(s): {', '.join(sorted(unknown))}")
    chosen = [m for m in MECHANISMS if m.key in wanted]
    active = [m for m in chosen if tuned() or engine_reads(m.var)]
    skipped = [m for m in chosen if m not in active]
    for m in skipped:
        print(f"skipped: the engine measured does not read {m.var}", flush=True)
    if not active:
        sys.exit("no mechanism to measure")

    started = time.perf_counter()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    date = h.now()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f}s] {msg}", flush=True)

    db = h.Database.create(DB)
    keys = [m.key for m in active] + ([CONTROL] if args.control else [])
    settings: dict[str | None, dict[str, str]] = {None: {}, CONTROL: {}}
    settings.update({m.key: switch(m) for m in active})
    planned = schedule(keys, args.rounds)
    seq: list[str | None] = []
    results: list[dict[str, Any]] = []
    rounds_done, per_round = 0, 2 * len(keys)
    try:
        for i, key in enumerate(planned):
            # A round ends on an ON measurement: stop there when the next round would pass the budget.
            if i and (i - 1) % per_round == 0:
                rounds_done = (i - 1) // per_round
            elapsed = time.perf_counter() - started
            if (i and (i - 1) % per_round == 0 and rounds_done >= 2
                    and elapsed * (rounds_done + 1) / rounds_done > args.budget * 60):
                log(f"stopping after {rounds_done} rounds: a round takes {elapsed / rounds_done:.0f}s, "
                    f"past the {args.budget:g} min budget")
                break
            load1 = os.getloadavg()[0]
            r = _slot(db.url, settings[key], args.runs, args.events)
            r["load1"] = load1
            seq.append(key)
            results.append(r)
            log(f"{i + 1}/{len(planned)} {key or 'ON':<20} {r['tp']:7.1f} runs/s  p50 {r['p50'] * 1e3:5.2f} ms  "
                f"p99 {r['p99'] * 1e3:5.2f} ms  cpu {r['cpu_ms']:.2f} ms/run  ({r['tp_s']:.0f}s + {r['lat_s']:.0f}s)")
        else:
            rounds_done = args.rounds
    finally:
        if not args.keep:
            db.drop()
    rows = {key: pair(seq, results, key) for key in keys}
    elapsed = time.perf_counter() - started
    command = h.command("bench.ablation").strip()
    load += " (at the end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + ")"
    meta = {"command": command, "date": date, "commit": h.describe(h.child_cwd()), "elapsed": elapsed, "load": load,
            "runs": args.runs, "events": args.events, "rounds": rounds_done, "planned": args.rounds,
            "budget": args.budget}
    section = render(rows, skipped, meta)
    Path("/tmp/bench-ablation.json").write_text(json.dumps({"meta": meta, "schedule": seq, "results": results},
                                                           indent=1))
    print()
    print(section.replace("**", ""))
    if args.output != "-":
        h.write_between(Path(args.output), "<!-- bench.ablation: begin (generated by python -m bench.ablation; edits "
                        "here are lost) -->", "<!-- bench.ablation: end -->", section)
        print(f"written to {args.output} (raw numbers: /tmp/bench-ablation.json)")


if __name__ == "__main__":
    main()
