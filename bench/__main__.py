"""The benchmark suite: one command, one table, ``docs/performance.md`` rewritten.

    python -m bench                 # full run (~20 min on 2 cores)
    python -m bench --quick         # smaller sizes, one round (~5 min)
    python -m bench --sections throughput,steps --runs 2000
    python -m bench --baseline /path/to/other/checkout   # adds that engine as a side (before/after)

Needs MOTIR_DATABASE_URL (a Postgres server; the suite creates and drops its
own databases on it) and CELERY_BROKER_URL (Redis). ``pgbench`` comes from
the PostgreSQL client packages (Debian: ``apt-get install postgresql-contrib``
or ``postgresql-client``); without it that row is skipped. Procrastinate and
DBOS are installed by the suite into ``bench/.peers-venv`` (pip, first run
only), never into the project's environment; ``--no-peers`` skips them.

Every figure is a median of several rounds, and every comparison a ratio of
two figures measured in the same run, sides interleaved round by round: the
machine is shared and absolute numbers drift. The sections and their methods
are documented in each module (``bench/throughput.py``, ``stepcost.py``,
``depth.py``, ``fanout.py``, ``beat.py``, ``memory.py``, ``peers/``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

from bench.common import DB, MOTIR_QUEUE, ROOT, admin_dsn, child_cwd, child_env, create_bench_database, drop_database
from bench.stats import median

SECTIONS = ("throughput", "latency", "steps", "cpu", "depth", "fanout", "beat", "memory")
NOTES_MARKER = "<!-- Everything below this line is kept when the suite rewrites this file. -->"


def prepare_environment() -> str:
    """Create the bench database and point the engine (this process and its workers) at it."""
    missing = [v for v in ("MOTIR_DATABASE_URL", "CELERY_BROKER_URL") if not os.environ.get(v)]
    if missing:
        sys.exit(f"set {' and '.join(missing)} (a Postgres server and a Redis broker); "
                 "`eval \"$(python -m motir_celery.dev.embedded env)\"` starts embedded ones")
    os.environ.setdefault("BENCH_SERVER_URL", os.environ["MOTIR_DATABASE_URL"])
    url = create_bench_database()
    os.environ.update(MOTIR_DATABASE_URL=url, MOTIR_IMPORTS="bench.workload", MOTIR_QUEUE=MOTIR_QUEUE)
    from motir_celery.settings import reset_settings

    reset_settings()
    import bench.workload  # noqa: F401

    return url


def _sizes(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    return {
        "runs": args.runs or (500 if quick else 2000),
        "dbos_runs": args.dbos_runs or (200 if quick else 600),
        "rounds": args.rounds or (1 if quick else 3),
        "latency_events": 100 if quick else 250,
        "latency_rounds": 1 if quick else 3,
        "depth": (10_000, 100_000) if quick else (10_000, 1_000_000),
        "memory": (1000, 3000) if quick else (1000, 10_000),
        "beat_slots": 500 if quick else 2000,
        "fanout_rounds": 10 if quick else 30,
        "step_rounds": 2 if quick else 5,
        "pgbench_s": 5 if quick else 10,
        "cpu_runs": 300 if quick else 1000,
        "cpu_rounds": 1 if quick else 2,
    }


# --- sections ---------------------------------------------------------------------

SIDE_ORDER = ("motir", "motir_events", "baseline", "plain", "plain_noack", "procrastinate", "dbos")
SIDE_NAMES = {"motir": "motir-celery (3 durable steps)",
              "motir_events": "motir-celery, Celery task events on (as while Flower watches)",
              "baseline": "motir-celery, baseline engine (--baseline)",
              "plain": "plain Celery (no durability)",
              "plain_noack": "plain Celery, Redis ack emulation off (as motir-celery's app sets it)", "procrastinate": "Procrastinate (1 task, no steps)",
              "dbos": "DBOS Transact (workflow of 3 steps)"}

#: (label, workers, concurrency per worker, DBOS worker_concurrency, pgbench clients)
CONFIGS = (("1 worker x 2", 1, 2, 2, 2), ("2 workers x 2", 2, 2, 8, 4))
DBOS_POLL = 0.05


@contextmanager
def _engine_at(path: str | None) -> Iterator[None]:
    """Run the durable side's workers on another checkout's engine (``--baseline``)."""
    if path is None:
        yield
        return
    os.environ["BENCH_ENGINE_PATH"] = path
    try:
        yield
    finally:
        del os.environ["BENCH_ENGINE_PATH"]


def section_throughput(url: str, sz: dict[str, Any], args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    from bench import peersenv, throughput

    out: dict[str, Any] = {}
    for i, (label, workers, conc, dbos_conc, clients) in enumerate(CONFIGS):
        names = ["motir"]
        if i == 0:  # the variants: first configuration only, to keep the run short
            names += ["motir_events"] + (["baseline"] if args.baseline else [])
        names += ["plain"] + (["plain_noack"] if i == 0 else []) + (["procrastinate", "dbos"] if args.peers else [])
        sides: dict[str, list[float]] = {k: [] for k in names}
        for r in range(sz["rounds"]):
            for side in names:
                t0 = time.perf_counter()
                if side in ("motir", "motir_events", "baseline"):
                    with _engine_at(args.baseline if side == "baseline" else None):
                        v = throughput.motir_round(
                            url, sz["runs"], workers, conc,
                            app="bench.motir_events_app" if side == "motir_events" else "motir_celery")
                elif side in ("plain", "plain_noack"):
                    v = throughput.plain_round(sz["runs"], workers, conc, env=child_env(
                        BENCH_NO_ACK_EMULATION="1") if side == "plain_noack" else None)
                elif side == "procrastinate":
                    v = peersenv.run("bench.peers.procrastinate_side", "throughput", "--admin-dsn", admin_dsn(),
                                     "--runs", sz["runs"], "--workers", workers, "--concurrency", conc,
                                     "--rounds", 1, *(["--reuse"] if r else []))["rounds"][0]
                else:
                    v = peersenv.run("bench.peers.dbos_side", "throughput", "--admin-dsn", admin_dsn(),
                                     "--runs", sz["dbos_runs"], "--workers", workers, "--concurrency", dbos_conc,
                                     "--poll", DBOS_POLL, "--rounds", 1, *(["--reuse"] if r else []))["rounds"][0]
                sides[side].append(v)
                log(f"  throughput [{label}] round {r + 1}: {side:<13} {v:7.1f} runs/s  ({time.perf_counter() - t0:.0f}s)")
        entry: dict[str, Any] = {k: {"median": median(v), "rounds": v} for k, v in sides.items()}
        entry["workers"], entry["concurrency"], entry["dbos_concurrency"] = workers, conc, dbos_conc
        if shutil.which("pgbench"):
            entry["pgbench"] = throughput.pgbench(url, clients, sz["pgbench_s"])
            log(f"  throughput [{label}] pgbench -c {clients}: {entry['pgbench']['tps']:.0f} commits/s")
        out[label] = entry
    return out


def section_latency(url: str, sz: dict[str, Any], args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    """The sides the targets compare (motir, plain Celery, Procrastinate; and the
    baseline) take turns, ``latency_rounds`` times: this machine's speed drifts by
    a millisecond within minutes, more than the gaps measured. Each side's p50 is
    the median of its rounds' p50s (p99 likewise); the rest run once."""
    from bench import peersenv, throughput

    n, interval = sz["latency_events"], 0.02
    turns: dict[str, Callable[[], dict]] = {"motir": lambda: throughput.motir_latency(url, n, interval, 2)}
    if args.baseline:
        turns["baseline"] = lambda: _baseline_latency(args.baseline, n, interval)
    turns["plain"] = lambda: throughput.plain_latency(n, interval, 2)
    if args.peers:
        turns["procrastinate"] = lambda: peersenv.run(
            "bench.peers.procrastinate_side", "latency", "--admin-dsn", admin_dsn(), "--events", n,
            "--interval", interval, "--concurrency", 2)
    rounds: dict[str, list[dict]] = {side: [] for side in turns}
    for _ in range(sz["latency_rounds"]):
        for side, measure in turns.items():
            rounds[side].append(measure())
    out: dict[str, Any] = {"events": n, "interval": interval, "rounds": sz["latency_rounds"]}
    for side, results in rounds.items():
        out[side] = {"p50": median([r["p50"] for r in results]), "p99": median([r["p99"] for r in results]),
                     "n": sum(r["n"] for r in results), "p50s": [r["p50"] for r in results]}
    out["motir_events"] = throughput.motir_latency(url, n, interval, 2, app="bench.motir_events_app")
    if args.peers:
        out["dbos"] = peersenv.run("bench.peers.dbos_side", "latency", "--admin-dsn", admin_dsn(), "--events", n,
                                   "--interval", interval, "--concurrency", 2, "--poll", DBOS_POLL)
    for side in SIDE_ORDER:
        if side in out:
            log(f"  latency {side:<13} p50 {out[side]['p50'] * 1e3:6.1f} ms  p99 {out[side]['p99'] * 1e3:6.1f} ms")
    return out


# The sender is half of a latency: the baseline's send_event publishes too, from a
# process whose motir_celery is the baseline's (imported before bench is found on ROOT).
_BASELINE_SENDER = (
    "import json, os, sys; import motir_celery; sys.path.insert(0, sys.argv[1]); from bench import throughput; "
    "print(json.dumps(throughput.motir_latency(os.environ['MOTIR_DATABASE_URL'], int(sys.argv[2]), "
    "float(sys.argv[3]), 2)))"
)


def _baseline_latency(path: str, n: int, interval: float) -> dict:
    """motir_latency with both the sender and the workers on the baseline's engine."""
    with _engine_at(path):
        done = subprocess.run([sys.executable, "-c", _BASELINE_SENDER, str(ROOT), str(n), str(interval)],
                              env=child_env(), cwd=child_cwd(), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"baseline latency failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _stepcost(rounds: int, engine_path: str | None, **extra: str) -> dict:
    env = child_env(**extra)
    if engine_path:
        env["PYTHONPATH"] = os.pathsep.join([engine_path, str(ROOT)])
    proc = subprocess.run([sys.executable, "-m", "bench.stepcost", "--rounds", str(rounds)], capture_output=True,
                          text=True, env=env, cwd=engine_path or ROOT, timeout=900)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def section_steps(url: str, sz: dict[str, Any], args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    out = {"motir": _stepcost(sz["step_rounds"], None)}
    if args.baseline:
        out["baseline"] = _stepcost(sz["step_rounds"], args.baseline)
    for side, r in out.items():
        log(f"  steps {side}: miss {r['miss_us']:.0f} us, hit {r['hit_us']:.2f} us; "
            + ", ".join(f"k={k}: {p['round_trips']} rt / {p['commits']} commits / {p.get('waits')} waits"
                        for k, p in r["fresh"].items()))
    return out


def section_cpu(url: str, sz: dict[str, Any], args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    from bench import cpu

    variants: dict[str, tuple[str | None, str, dict[str, str]]] = {"motir": (None, "motir_celery", {})}
    if args.baseline:
        variants["baseline"] = (args.baseline, "motir_celery", {})
    variants["motir_events"] = (None, "bench.motir_events_app", {})
    variants["plain"] = (None, "bench.plain_app", {})
    r = cpu.measure(url, variants, runs=sz["cpu_runs"], rounds=sz["cpu_rounds"], engine_at=_engine_at)
    for k, v in r["variants"].items():
        log(f"  cpu {k:<15} " + ", ".join(f"{m} {x:.2f}" for m, x in v.items()))
    return r


def section_depth(url: str, sz: dict[str, Any], args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    from bench import depth

    r = depth.measure(url, *sz["depth"])
    log(f"  depth {r['small']} -> {r['large']}: " + ", ".join(f"{k} x{v:.2f}" for k, v in r["ratio"].items()))
    return r


def section_fanout(url: str, sz: dict[str, Any], args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    from bench import fanout

    r = fanout.measure(url, sz["fanout_rounds"])
    log(f"  fan-out x{r['subscribers']}: {r['ms']:.1f} ms ({r['rows_per_s']:.0f} rows/s); db only {r['db_ms']:.1f} ms")
    return r


def section_beat(url: str, sz: dict[str, Any], args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    from bench import beat

    r = beat.measure(url, sz["beat_slots"])
    log(f"  beat x{r['beats']}: {r['calls_per_s']:.0f} calls/s, {r['slots_per_s']:.0f} slots/s")
    return r


def section_memory(url: str, sz: dict[str, Any], args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    from bench import memory

    r = memory.measure(url, sz["memory"])
    log("  memory: " + ", ".join(f"{s['runs']} runs: child {s['child_rss_kb'] / 1024:.1f} MiB" for s in r["samples"]))
    return r


# --- report -----------------------------------------------------------------------


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment(url: str, peers: bool) -> dict[str, str]:
    import importlib.metadata as md

    import redis
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next((int(line.split()[1]) // 1024 // 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), 0)
    engine = create_engine(url, poolclass=NullPool)
    with engine.connect() as conn:
        pg = conn.execute(text("SHOW server_version")).scalar_one()
        pg_settings = ", ".join(f"{k}={conn.execute(text(f'SHOW {k}')).scalar_one()}"
                                for k in ("synchronous_commit", "fsync", "shared_buffers", "max_connections"))
    engine.dispose()
    rinfo = redis.Redis.from_url(os.environ["CELERY_BROKER_URL"]).info("server")
    env = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu}, {os.cpu_count()} cores, {mem} GiB RAM, {platform.system()} {platform.release()}",
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        "postgres": f"{pg} ({pg_settings})",
        "redis": rinfo.get("redis_version", "?"),
        "motir-celery": _run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"]) or "?",
        "libraries": ", ".join(f"{p} {md.version(p)}" for p in ("celery", "kombu", "SQLAlchemy", "psycopg", "redis")),
        "pgbench": _run(["pgbench", "--version"]) or "not installed (apt-get install postgresql-contrib)",
    }
    if peers:
        from bench import peersenv

        env["peers (bench/.peers-venv)"] = ", ".join(f"{k} {v}" for k, v in peersenv.versions().items())
    return env


def _ok(flag: bool) -> str:
    return "met" if flag else "MISSED"


def render(results: dict[str, Any], env: dict[str, str], command: str, elapsed: float) -> tuple[str, str]:
    """(plain-text table for the terminal, markdown for docs/performance.md)."""
    md: list[str] = []
    targets: list[tuple[str, str, str]] = []  # (target, measured, verdict)
    md += ["# Performance", "",
           "Generated by the benchmark suite; do not edit above the notes marker. Regenerate with:", "",
           f"    {command}", "",
           f"Run took {elapsed / 60:.1f} min. Figures are medians of the rounds listed; every ratio compares two "
           "figures from this same run (sides interleaved round by round), because the machine is shared and "
           "absolute numbers drift.", "", "## Machine and versions", "", "| | |", "|---|---|"]
    md += [f"| {k} | {v} |" for k, v in env.items()]

    tp = results.get("throughput")
    if tp:
        md += ["", "## 1. Throughput (3-step job, queued first, then drained)", "",
               "runs/s over the 5%..95% span of the drain; DBOS drains fewer runs per round (it is ~10x slower) "
               f"and runs at its best tuning found here (queue polling {DBOS_POLL}s; worker_concurrency "
               "2 with one process, 8 with two).", ""]
        md += ["| side | " + " | ".join(tp) + " |", "|---|" + "---:|" * len(tp)]
        for side in SIDE_ORDER:
            if any(side in e for e in tp.values()):
                cells = []
                for e in tp.values():
                    if side in e:
                        rounds = ", ".join(f"{x:.0f}" for x in e[side]["rounds"])
                        cells.append(f"**{e[side]['median']:.0f}** ({rounds})")
                    else:
                        cells.append("")
                md.append(f"| {SIDE_NAMES[side]} | " + " | ".join(cells) + " |")
        if any("pgbench" in e for e in tp.values()):
            md.append("| pgbench, 1-row INSERT per commit (commits/s) | " + " | ".join(
                f"{e['pgbench']['tps']:.0f} (-c {e['pgbench']['clients']})" if "pgbench" in e else ""
                for e in tp.values()) + " |")
        md += ["", "| ratio | " + " | ".join(tp) + " |", "|---|" + "---:|" * len(tp)]
        ratio_rows = [("motir / plain Celery", "motir", "plain", 0.6),
                      ("motir / Procrastinate", "motir", "procrastinate", 1.0),
                      ("motir / DBOS", "motir", "dbos", 3.0),
                      ("motir / baseline engine (before -> after)", "motir", "baseline", None),
                      ("motir / plain Celery with Redis ack emulation off", "motir", "plain_noack", None),
                      ("motir task-events-on / plain Celery", "motir_events", "plain", None)]
        for name, mine, other, target in ratio_rows:
            if not any(other in e and mine in e for e in tp.values()):
                continue
            cells = []
            for label, e in tp.items():
                if other in e and mine in e:
                    r = e[mine]["median"] / e[other]["median"]
                    cells.append(f"{r:.2f}")
                    if target is not None:
                        targets.append((f"throughput {name} >= {target} [{label}]", f"{r:.2f}", _ok(r >= target)))
                else:
                    cells.append("")
            md.append(f"| {name} | " + " | ".join(cells) + " |")
        if any("pgbench" in e for e in tp.values()):
            # 1 flushed commit per run: the settle, which carries the three fast steps held
            # (the claim's commit is not flushed).
            md.append("| motir runs/s x 1 flushed commit / pgbench commits/s (share of the commit ceiling) | " + " | ".join(
                f"{e['motir']['median'] / e['pgbench']['tps']:.2f}" if "pgbench" in e else ""
                for e in tp.values()) + " |")

    lat = results.get("latency")
    if lat:
        md += ["", f"## 2. Latency at low load (one event every {lat['interval'] * 1e3:.0f} ms, {lat['events']} events, "
               "1 worker x 2)", "",
               f"Sides with a p50 per round took turns, {lat.get('rounds', 1)} rounds; their p50 and p99 are the "
               "medians over the rounds. The others ran once, after them.", "",
               "| side | p50 ms | p99 ms | p50 per round, ms |", "|---|---:|---:|---|"]
        for side in SIDE_ORDER:
            if side in lat:
                per_round = ", ".join(f"{x * 1e3:.1f}" for x in lat[side].get("p50s", []))
                md.append(f"| {SIDE_NAMES[side]} | {lat[side]['p50'] * 1e3:.1f} | {lat[side]['p99'] * 1e3:.1f} "
                          f"| {per_round} |")
        m = lat["motir"]["p50"]
        if "procrastinate" in lat:
            targets.append(("latency p50 <= Procrastinate's", f"{m * 1e3:.1f} vs {lat['procrastinate']['p50'] * 1e3:.1f} ms",
                            _ok(m <= lat["procrastinate"]["p50"])))
        targets.append(("latency p50 <= 2x plain Celery's", f"{m * 1e3:.1f} vs 2 x {lat['plain']['p50'] * 1e3:.1f} ms",
                        _ok(m <= 2 * lat["plain"]["p50"])))

    st = results.get("steps")
    if st:
        md += ["", "## 3. Step cost", "",
               "Time per `step.run` (median inside a 100-step run; miss = body + stored write, hit = replay from "
               "the memo loaded with the claim), and what one attempt sends to Postgres, counted from libpq's "
               "protocol trace (round trip = Query or Sync; commit = a transaction that wrote; waits = turns from "
               "sending to reading, at most the answers the attempt waited for: see bench/stepcost.py).", "",
               "| engine | miss us/step | hit us/step | " + " | ".join(
                   f"k={k} new: rt / commits (waits)" for k in st["motir"]["fresh"]) + " | replay of k=" +
               f"{list(st['motir']['replay'])[-1]} hits: rt / commits (waits) |",
               "|---|---:|---:|" + "---:|" * (len(st["motir"]["fresh"]) + 1)]
        for side, r in st.items():
            last = list(r["replay"])[-1]
            md.append(f"| {SIDE_NAMES[side]} | {r['miss_us']:.0f} | {r['hit_us']:.1f} | "
                      + " | ".join(_protocol(p) for p in r["fresh"].values()) + f" | {_protocol(r['replay'][last])} |")
            if "slow" in r:  # (an engine older than the slow runs has none)
                md.append(f"| {SIDE_NAMES[side]}, step bodies of 2 ms | | | "
                          + " | ".join(_protocol(p) for p in r["slow"].values()) + " | |")
        r = st["motir"]
        for what, field in (("round trips", "round_trips"), ("commits", "commits")):
            shown, worst = [], 0
            for bodies, runs in (("fast bodies", r["fresh"]), ("2 ms bodies", r.get("slow", {}))):
                if runs:
                    counts = {int(k): p[field] for k, p in runs.items()}
                    worst = max(worst, *(n - k for k, n in counts.items()))
                    shown.append(f"{bodies}: " + ", ".join(f"{n} at k={k}" for k, n in counts.items()))
            targets.append((f"<= k+2 {what} per run of k new steps", "; ".join(shown), _ok(worst <= 2)))
        hits = {k: p["round_trips"] for k, p in r["replay"].items()}
        extra = max(hits.values()) - min(hits.values())
        targets.append(("0 extra round trips for memo hits", f"{extra} extra over {', '.join(f'k={k}' for k in hits)}",
                        _ok(extra == 0)))

    cp = results.get("cpu")
    if cp:
        md += ["", f"## 3b. CPU per run (1 worker x 2, {cp['runs']:,} runs, median of {cp['rounds']} rounds)", "",
               "CPU seconds (user + system) per run, read from the kernel: steadier than wall-clock rates on a shared "
               "machine, though still +-15% between invocations.", "",
               "| engine | worker main process ms | pool children ms | Postgres backends ms | total ms |",
               "|---|---:|---:|---:|---:|"]
        for k, v in cp["variants"].items():
            md.append(f"| {SIDE_NAMES[k]} | {v['main_ms']:.2f} | {v['children_ms']:.2f} | {v['postgres_ms']:.2f} | "
                      f"**{v['total_ms']:.2f}** |")

    dp = results.get("depth")
    if dp:
        md += ["", f"## 4. Scale with depth ({dp['small']:,} vs {dp['large']:,} rows in job_queue: 90% finished, "
               "10% queued and due)", "", "| statement | ms at small | ms at large | ratio |", "|---|---:|---:|---:|"]
        names = {"claim_ms": "claim (+ memo preload)", "settle_ms": "settle (succeeded)",
                 "reclaim_ms": "sweeper: reclaim expired leases", "republish_ms": "sweeper: re-publish lost messages"}
        for k, name in names.items():
            md.append(f"| {name} | {dp['shallow'][k]:.2f} | {dp['deep'][k]:.2f} | {dp['ratio'][k]:.2f} |")
            targets.append((f"depth ratio <= 1.2: {name}", f"{dp['ratio'][k]:.2f}", _ok(dp["ratio"][k] <= 1.2)))

    fo = results.get("fanout")
    if fo:
        md += ["", f"## 5. Fan-out (1 event x {fo['subscribers']} subscribers)", "",
               "| send_event | ms | rows/s |", "|---|---:|---:|",
               f"| with publishing ({fo['subscribers']} messages) | {fo['ms']:.1f} | {fo['rows_per_s']:.0f} |",
               f"| database only (publish=None) | {fo['db_ms']:.1f} | {fo['db_rows_per_s']:.0f} |"]

    bt = results.get("beat")
    if bt:
        md += ["", f"## 6. Beat ({bt['beats']} concurrent beats on the same {bt['slots']} slots)", "",
               f"- `enqueue_scheduled` calls/s (all beats): **{bt['calls_per_s']:.0f}**",
               f"- distinct slots enqueued/s: **{bt['slots_per_s']:.0f}** (each slot exactly once: checked)"]

    mem = results.get("memory")
    if mem:
        md += ["", "## 7. Memory (one worker, prefork x 2)", "", "| runs | pool child RSS MiB | child peak MiB | "
               "main process RSS MiB |", "|---:|---:|---:|---:|"]
        for s in mem["samples"]:
            md.append(f"| {s['runs']:,} | {s['child_rss_kb'] / 1024:.1f} | {s['child_hwm_kb'] / 1024:.1f} | "
                      f"{s['main_rss_kb'] / 1024:.1f} |")
        first, last = mem["samples"][0]["runs"], mem["samples"][-1]["runs"]
        targets.append((f"worker RSS flat (+-10%) from run {first:,} to {last:,}",
                        f"{mem['growth'] * 100:+.1f}% (child), {mem['main_growth'] * 100:+.1f}% (main)",
                        _ok(abs(mem["growth"]) <= 0.10 and abs(mem["main_growth"]) <= 0.10)))

    if targets:
        md += ["", "## Targets", "", "| target | measured | |", "|---|---|---|"]
        md += [f"| {t} | {m} | {v} |" for t, m, v in targets]
    markdown = "\n".join(md) + "\n"
    text_out = markdown.replace("**", "")
    return text_out, markdown


def _protocol(p: dict[str, int]) -> str:
    return f"{p['round_trips']} / {p['commits']}" + (f" ({p['waits']})" if "waits" in p else "")


def write_report(path: Path, markdown: str) -> None:
    notes = ""
    if path.exists():
        old = path.read_text()
        if NOTES_MARKER in old:
            notes = old.split(NOTES_MARKER, 1)[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown + "\n" + NOTES_MARKER + (notes or "\n"))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes and one round (a few minutes)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--runs", type=int, help="runs per throughput round (default 2000; --quick 500; "
                        "the issue's 5000 fits too, in ~35 min)")
    parser.add_argument("--dbos-runs", type=int, help="runs per DBOS throughput round (default 600; --quick 200)")
    parser.add_argument("--rounds", type=int, help="throughput rounds per side (default 3; --quick 1)")
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="skip Procrastinate and DBOS")
    parser.add_argument("--baseline", help="path of another checkout whose motir_celery runs as an extra side")
    parser.add_argument("--output", default=str(ROOT / "docs" / "performance.md"),
                        help="markdown report (default docs/performance.md; '-' for none)")
    parser.add_argument("--keep", action="store_true", help="keep the bench databases afterwards")
    args = parser.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    if args.baseline:
        args.baseline = str(Path(args.baseline).resolve())
        if not (Path(args.baseline) / "motir_celery").is_dir():
            parser.error(f"--baseline {args.baseline}: no motir_celery package there")
    if not shutil.which("pgbench"):
        print("pgbench not found: the commit-ceiling row is skipped "
              "(Debian: apt-get install postgresql-contrib, or postgresql-client)", file=sys.stderr)

    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f}s] {msg}", flush=True)

    if args.peers and {"throughput", "latency"} & set(sections):
        from bench import peersenv

        peersenv.ensure()
    url = prepare_environment()
    env = environment(url, args.peers and bool({"throughput", "latency"} & set(sections)))
    sz = _sizes(args)
    results: dict[str, Any] = {}
    fns = {"throughput": section_throughput, "latency": section_latency, "steps": section_steps, "cpu": section_cpu,
           "depth": section_depth, "fanout": section_fanout, "beat": section_beat, "memory": section_memory}
    try:
        for name in sections:
            log(f"{name} ...")
            results[name] = fns[name](url, sz, args, log)
    finally:
        if not args.keep:
            drop_database(DB)
            for peer in ("motir_bench_procrastinate", "motir_bench_dbos"):
                drop_database(peer)
    elapsed = time.perf_counter() - started
    command = "python -m bench " + " ".join(sys.argv[1:])
    text_out, markdown = render(results, env, command.strip(), elapsed)
    Path("/tmp/bench-results.json").write_text(json.dumps({"env": env, "results": results}, indent=1, default=str))
    print()
    print(text_out)
    if args.output != "-":
        write_report(Path(args.output), markdown)
        print(f"written to {args.output} (raw numbers: /tmp/bench-results.json)")


if __name__ == "__main__":
    main()
