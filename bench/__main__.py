"""The benchmark suite: one command, one table, ``docs/performance.md`` rewritten.

    python -m bench                 # full run (~20 min on 2 cores)
    python -m bench --quick         # smaller sizes, one round (~5 min)
    python -m bench --sections throughput,steps --runs 2000
    python -m bench --baseline /path/to/other/checkout   # adds that engine as a side (before/after)

Needs MOTIR_DATABASE_URL (a Postgres server; the suite creates and drops its own
databases on it) and CELERY_BROKER_URL (Redis). ``pgbench`` (Debian:
postgresql-contrib) gives the commit ceiling; without it that row is skipped.
Procrastinate and DBOS are installed into ``bench/.peers-venv`` (pip, first run
only), never into the project's environment; ``--no-peers`` skips them. Every
figure is a median of rounds, and every comparison a ratio of two figures of this
run, the sides taking turns round by round (``harness.interleave``).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import itertools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from bench import harness as h
from bench import peersenv

DB = "motir_bench"
SECTIONS = ("throughput", "latency", "steps", "cpu", "depth", "fanout", "beat", "memory")
Log = Callable[[str], None]


def sizes(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    return {
        "runs": args.runs or (500 if quick else 2000), "dbos_runs": args.dbos_runs or (200 if quick else 600),
        "rounds": args.rounds or (1 if quick else 3), "latency_events": 100 if quick else 250,
        "latency_rounds": 1 if quick else 3, "depth": (10_000, 100_000) if quick else (10_000, 1_000_000),
        "memory": (1000, 3000) if quick else (1000, 10_000), "beat_slots": 500 if quick else 2000,
        "fanout_rounds": 10 if quick else 30, "step_rounds": 2 if quick else 5, "pgbench_s": 5 if quick else 10,
        "cpu_runs": 300 if quick else 1000, "cpu_rounds": 1 if quick else 2,
    }


SIDE_ORDER = ("motir", "motir_events", "baseline", "plain", "plain_noack", "procrastinate", "dbos")
SIDE_NAMES = {"motir": "motir-celery (3 durable steps)",
              "motir_events": "motir-celery, Celery task events on (as while Flower watches)",
              "baseline": "motir-celery, baseline engine (--baseline)",
              "plain": "plain Celery (no durability)",
              "plain_noack": "plain Celery, Redis ack emulation off (as motir-celery's app sets it)",
              "procrastinate": "Procrastinate (1 task, no steps)",
              "dbos": "DBOS Transact (workflow of 3 steps)"}
#: (label, workers, concurrency per worker, DBOS worker_concurrency, pgbench clients)
CONFIGS = (("1 worker x 2", 1, 2, 2, 2), ("2 workers x 2", 2, 2, 8, 4))
DBOS_POLL = 0.05


def side(name: str, db: h.Database, args: argparse.Namespace) -> h.Side:
    """The Celery sides: the engine, its variants (task events on; --baseline's engine), plain Celery."""
    if name == "motir_events":
        return h.Motir(db, app="bench.motir_app", env={"BENCH_TASK_EVENTS": "1"})
    if name == "baseline":
        return h.Motir(db, engine=args.baseline)
    if name.startswith("plain"):
        return h.Plain(env={"BENCH_NO_ACK_EMULATION": "1"} if name == "plain_noack" else {})
    return h.Motir(db)


def peer(module: str, section: str, *args: Any) -> Callable[[], Any]:
    """A peer's measurement, in its virtualenv; its first call sets its database up."""
    calls = itertools.count()
    return lambda: peersenv.run(module, section, "--admin-dsn", h.dsn(h.server_url()), *args,
                                  *(["--reuse"] if next(calls) else []))


# --- sections ---------------------------------------------------------------------


def section_throughput(db: h.Database, sz: dict[str, Any], args: argparse.Namespace, log: Log) -> dict:
    """N runs queued first, then the workers started and the backlog drained (``harness.drain``);
    the variants in the first configuration only, to keep the run short."""
    out: dict[str, Any] = {}
    for i, (label, workers, conc, dbos_conc, clients) in enumerate(CONFIGS):
        names = ["motir", *(["motir_events", *(["baseline"] if args.baseline else [])] if i == 0 else []),
                 "plain", *(["plain_noack"] if i == 0 else [])]
        turns: dict[str, Callable[[], float]] = {
            n: (lambda s=side(n, db, args): h.drain(s, sz["runs"], workers, conc).rate) for n in names}
        if args.peers:
            runs = ("--runs", sz["runs"], "--workers", workers, "--concurrency", conc, "--rounds", 1)
            pro = peer("bench.peers.procrastinate_side", "throughput", *runs)
            dbos = peer("bench.peers.dbos_side", "throughput", "--runs", sz["dbos_runs"], "--workers", workers,
                        "--concurrency", dbos_conc, "--poll", DBOS_POLL, "--rounds", 1)
            turns.update(procrastinate=lambda: pro()["rounds"][0], dbos=lambda: dbos()["rounds"][0])
        sides = h.interleave(turns, sz["rounds"], lambda m: log(f"  throughput [{label}] {m}"), lambda v: f"{v:7.1f} runs/s")
        entry: dict[str, Any] = {k: {"median": h.median(v), "rounds": v} for k, v in sides.items()}
        entry.update(workers=workers, concurrency=conc, dbos_concurrency=dbos_conc)
        if shutil.which("pgbench"):
            entry["pgbench"] = pgbench(db, clients, sz["pgbench_s"])
            log(f"  throughput [{label}] pgbench -c {clients}: {entry['pgbench']['tps']:.0f} commits/s")
        out[label] = entry
    return out


def pgbench(db: h.Database, clients: int, seconds: int) -> dict[str, Any]:
    """Commits/s of a one-row INSERT per transaction at ``clients`` connections: the ceiling."""
    u = urlsplit(h.dsn(db.url))
    db.rows("CREATE TABLE bench_pgbench (id bigserial PRIMARY KEY, v int NOT NULL, at timestamptz NOT NULL DEFAULT now())")
    with tempfile.NamedTemporaryFile("w", suffix=".sql") as fh:
        fh.write("INSERT INTO bench_pgbench (v) VALUES (1);\n")
        fh.flush()
        try:
            out = subprocess.run(
                ["pgbench", "-n", "-c", str(clients), "-j", str(clients), "-T", str(seconds), "-f", fh.name,
                 "-h", u.hostname or "127.0.0.1", "-p", str(u.port or 5432), "-U", u.username or "postgres", db.name],
                capture_output=True, text=True, env=h.child_env(PGPASSWORD=u.password or ""), check=True).stdout
        finally:
            db.rows("DROP TABLE bench_pgbench")
    return {"tps": float(re.search(r"tps = ([0-9.]+)", out).group(1)), "clients": clients}  # type: ignore[union-attr]


def section_latency(db: h.Database, sz: dict[str, Any], args: argparse.Namespace, log: Log) -> dict:
    """``harness.latency``: the sides the targets compare take turns, ``latency_rounds`` times (this
    machine drifts by a millisecond within minutes); p50 and p99 are medians of the rounds'. The
    rest run once, after them."""
    n, interval = sz["latency_events"], 0.02
    turns: dict[str, Callable[[], dict]] = {"motir": lambda: h.latency(side("motir", db, args), n, interval)}
    if args.baseline:
        turns["baseline"] = lambda: baseline_latency(args.baseline, db, n, interval)
    turns["plain"] = lambda: h.latency(side("plain", db, args), n, interval)
    if args.peers:
        turns["procrastinate"] = peer("bench.peers.procrastinate_side", "latency", "--events", n,
                                      "--interval", interval, "--concurrency", 2)
    rounds = h.interleave(turns, sz["latency_rounds"])
    out: dict[str, Any] = {"events": n, "interval": interval, "rounds": sz["latency_rounds"]}
    for name, results in rounds.items():
        out[name] = {"p50": h.median(r["p50"] for r in results), "p99": h.median(r["p99"] for r in results),
                     "n": sum(r["n"] for r in results), "p50s": [r["p50"] for r in results]}
    out["motir_events"] = h.latency(side("motir_events", db, args), n, interval)
    if args.peers:
        out["dbos"] = peer("bench.peers.dbos_side", "latency", "--events", n, "--interval", interval,
                           "--concurrency", 2, "--poll", DBOS_POLL)()
    for name in SIDE_ORDER:
        if name in out:
            log(f"  latency {name:<13} p50 {out[name]['p50'] * 1e3:6.1f} ms  p99 {out[name]['p99'] * 1e3:6.1f} ms")
    return out


# The sender is half of a latency: the baseline's publishes too, from a process whose
# motir_celery is the baseline's (imported before this checkout's bench is put first).
_BASELINE_SENDER = ("import json, sys; import motir_celery; sys.path.insert(0, sys.argv[1]); from bench import harness as h; "
                    "print(json.dumps(h.latency(h.Motir(h.Database(sys.argv[2])), int(sys.argv[3]), float(sys.argv[4]))))")


def baseline_latency(path: str, db: h.Database, n: int, interval: float) -> dict:
    done = subprocess.run([sys.executable, "-c", _BASELINE_SENDER, str(h.ROOT), db.url, str(n), str(interval)],
                          env=h.child_env(path, BENCH_ENGINE_PATH=path), cwd=path, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"baseline latency failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def section_steps(db: h.Database, sz: dict[str, Any], args: argparse.Namespace, log: Log) -> dict:
    """``bench.stepcost`` in a process of its own, on this engine and on the baseline's."""
    out = {}
    for name, engine in (("motir", None), *((("baseline", args.baseline),) if args.baseline else ())):
        proc = subprocess.run([sys.executable, "-m", "bench.stepcost", "--rounds", str(sz["step_rounds"])],
                              capture_output=True, text=True, env=h.child_env(engine), cwd=h.child_cwd(engine),
                              timeout=900)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-4000:])
        out[name] = r = json.loads(proc.stdout.strip().splitlines()[-1])
        log(f"  steps {name}: miss {r['miss_us']:.0f} us, hit {r['hit_us']:.2f} us; "
            + ", ".join(f"k={k}: {p['round_trips']} rt / {p['commits']} commits / {p.get('waits')} waits"
                        for k, p in r["fresh"].items()))
    return out


def section_cpu(db: h.Database, sz: dict[str, Any], args: argparse.Namespace, log: Log) -> dict:
    """CPU per run of one worker (prefork x 2) by process, from the kernel (``harness.Meter``): steadier
    than wall-clock rates on a shared machine. Plain Celery is the floor (no database)."""
    names = ["motir", *(["baseline"] if args.baseline else []), "motir_events", "plain"]
    rounds = h.interleave({n: (lambda s=side(n, db, args): h.drain(s, sz["cpu_runs"], cpu=True).cpu) for n in names},
                          sz["cpu_rounds"])
    variants = {n: {m: h.median(r[m] for r in rs) for m in rs[0]} for n, rs in rounds.items()}
    for n, v in variants.items():
        log(f"  cpu {n:<15} " + ", ".join(f"{m} {x:.2f}" for m, x in v.items()))
    return {"runs": sz["cpu_runs"], "rounds": sz["cpu_rounds"], "variants": variants}


def section_depth(db: h.Database, sz: dict[str, Any], args: argparse.Namespace, log: Log) -> dict:
    from bench import depth

    r = depth.measure(db, *sz["depth"])
    log(f"  depth {r['small']} -> {r['large']}: " + ", ".join(f"{k} x{v:.2f}" for k, v in r["ratio"].items()))
    return r


def section_fanout(db: h.Database, sz: dict[str, Any], args: argparse.Namespace, log: Log) -> dict:
    """One event with 50 subscribers: ``send_event`` writes the event and its runs in one transaction,
    then publishes 50 messages (purged after); with publishing, and database only (``publish=None``)."""
    import motir_celery
    from bench import workload
    from motir_celery.core.producer import events

    workload.fanout_subscribers()
    motir = h.Motir(db)
    motir.reset()
    motir_celery.send_event(workload.FANOUT_EVENT, {"warm": True})  # pool, prepared statements, broker connection
    times: dict[str, list[float]] = {"with": [], "db": []}
    for i in range(sz["fanout_rounds"]):
        for kind, publish in (("with", motir_celery.send_event), ("db", events.send_event)):
            t0 = time.perf_counter()
            r = publish(workload.FANOUT_EVENT, {"i": i}, **({} if kind == "with" else {"publish": None}))
            times[kind].append(time.perf_counter() - t0)
            assert len(r.run_ids) == workload.FANOUT
    motir.reset()
    rows, t, d = workload.FANOUT + 1, h.median(times["with"]), h.median(times["db"])
    log(f"  fan-out x{workload.FANOUT}: {t * 1e3:.1f} ms ({rows / t:.0f} rows/s); db only {d * 1e3:.1f} ms")
    return {"subscribers": workload.FANOUT, "ms": t * 1e3, "rows_per_s": rows / t, "db_ms": d * 1e3,
            "db_rows_per_s": rows / d}


def section_beat(db: h.Database, sz: dict[str, Any], args: argparse.Namespace, log: Log) -> dict:
    from bench import beat

    r = beat.measure(db, sz["beat_slots"])
    log(f"  beat x{r['beats']}: {r['calls_per_s']:.0f} calls/s, {r['slots_per_s']:.0f} slots/s")
    return r


def section_memory(db: h.Database, sz: dict[str, Any], args: argparse.Namespace, log: Log) -> dict:
    """RSS (VmRSS) and peak (VmHWM) of one worker's main process and pool children after each
    checkpoint; the runs queued in slices of 2,000 on the one worker that lives through it."""
    motir, samples, done = h.Motir(db), [], 0
    motir.reset()
    with motir.workers(1, 2, "memory") as procs:
        for target in sz["memory"]:
            while done < target:
                batch = min(2000, target - done)
                motir.prequeue(batch, done)
                done += batch
                h.settle(motir, procs, done)
            main, *children = h.rss_tree(procs.pids[0])
            samples.append({"runs": target, "main_rss_kb": main[1], "child_rss_kb": max(c[1] for c in children),
                            "child_hwm_kb": max(c[2] for c in children)})
    first, last = samples[0], samples[-1]
    log("  memory: " + ", ".join(f"{s['runs']} runs: child {s['child_rss_kb'] / 1024:.1f} MiB" for s in samples))
    return {"samples": samples, "growth": last["child_rss_kb"] / first["child_rss_kb"] - 1,
            "main_growth": last["main_rss_kb"] / first["main_rss_kb"] - 1}


# --- report -----------------------------------------------------------------------


def _out(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment(db: h.Database, peers: bool) -> dict[str, str]:
    import redis

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) // 1024 // 1024
    pg = ", ".join(f"{k}={db.value(f'SHOW {k}')}" for k in ("synchronous_commit", "fsync", "shared_buffers",
                                                             "max_connections"))
    env = {
        "date": h.now(),
        "machine": f"{cpu}, {os.cpu_count()} cores, {mem} GiB RAM, {platform.system()} {platform.release()}",
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        "postgres": f"{db.value('SHOW server_version')} ({pg})",
        "redis": redis.Redis.from_url(os.environ["CELERY_BROKER_URL"]).info("server").get("redis_version", "?"),
        "motir-celery": _out(["git", "-C", str(h.ROOT), "describe", "--always", "--dirty"]) or "?",
        "libraries": ", ".join(f"{p} {md.version(p)}" for p in ("celery", "kombu", "SQLAlchemy", "psycopg", "redis")),
        "pgbench": _out(["pgbench", "--version"]) or "not installed (apt-get install postgresql-contrib)",
    }
    if peers:
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
    """The suite's file, up to its notes marker; what is below the marker is kept."""
    old = path.read_text() if path.exists() else ""
    notes = old.split(h.NOTES_MARKER, 1)[1] if h.NOTES_MARKER in old else "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown + "\n" + h.NOTES_MARKER + notes)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes and one round (a few minutes)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--runs", type=int, help="runs per throughput round (default 2000; --quick 500)")
    parser.add_argument("--dbos-runs", type=int, help="runs per DBOS throughput round (default 600; --quick 200)")
    parser.add_argument("--rounds", type=int, help="throughput rounds per side (default 3; --quick 1)")
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="skip Procrastinate and DBOS")
    parser.add_argument("--baseline", help="path of another checkout whose motir_celery runs as an extra side")
    parser.add_argument("--output", default=str(h.ROOT / "docs" / "performance.md"),
                        help="markdown report (default docs/performance.md; '-' for none)")
    parser.add_argument("--keep", action="store_true", help="keep the bench databases afterwards")
    args = parser.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    if args.baseline:
        args.baseline = str(Path(args.baseline).resolve())
        if not (Path(args.baseline) / "motir_celery").is_dir():
            parser.error(f"--baseline {args.baseline}: no motir_celery package there")
    h.need("MOTIR_DATABASE_URL", "CELERY_BROKER_URL")
    if not shutil.which("pgbench"):
        print("pgbench not found: the commit-ceiling row is skipped (Debian: apt-get install postgresql-contrib)",
              file=sys.stderr)
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f}s] {msg}", flush=True)

    peers = args.peers and bool({"throughput", "latency"} & set(sections))
    if peers:
        peersenv.ensure()
    db = h.Database.create(DB)
    h.use_engine(db.url, h.MOTIR_QUEUE)
    env = environment(db, peers)
    sz = sizes(args)
    results: dict[str, Any] = {}
    try:
        for name in sections:
            log(f"{name} ...")
            results[name] = globals()[f"section_{name}"](db, sz, args, log)
    finally:
        if not args.keep:
            db.drop()
            for peer_db in ("motir_bench_procrastinate", "motir_bench_dbos"):
                h.drop_database(peer_db)
    text_out, markdown = render(results, env, ("python -m bench " + " ".join(sys.argv[1:])).strip(),
                                time.perf_counter() - started)
    Path("/tmp/bench-results.json").write_text(json.dumps({"env": env, "results": results}, indent=1, default=str))
    print()
    print(text_out)
    if args.output != "-":
        write_report(Path(args.output), markdown)
        print(f"written to {args.output} (raw numbers: /tmp/bench-results.json)")


if __name__ == "__main__":
    main()
