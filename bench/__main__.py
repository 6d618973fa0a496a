"""The benchmark suite: one command, its block of ``docs/performance.md`` rewritten.

    python -m bench [--quick] [--sections throughput,steps] [--runs 2000] [--no-peers] [--baseline CHECKOUT]

Needs MOTIR_DATABASE_URL and CELERY_BROKER_URL; ``pgbench`` gives the commit ceiling (its row is
skipped without it); Procrastinate and DBOS run from ``bench/.peers-venv`` (``bench.peersenv``).
``--baseline`` adds another checkout's engine as a side (before/after). Every figure is a median
of rounds, every comparison a ratio of two figures of this run, the sides taking turns.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import itertools
import json
import multiprocessing as mp
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
SECTIONS = ("throughput", "io", "latency", "steps", "cpu", "depth", "fanout", "beat", "memory")
Log = Callable[[str], None]
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


def sizes(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick
    return {
        "runs": args.runs or (500 if q else 2000), "dbos_runs": args.dbos_runs or (200 if q else 600),
        "rounds": args.rounds or (1 if q else 3), "latency_events": 100 if q else 250, "latency_rounds": 1 if q else 3,
        "depth": (10_000, 100_000) if q else (10_000, 1_000_000), "memory": (1000, 3000) if q else (1000, 10_000),
        "beat_slots": 500 if q else 2000, "fanout_rounds": 10 if q else 30, "step_rounds": 2 if q else 5,
        "pgbench_s": 5 if q else 10, "cpu_runs": 300 if q else 1000, "cpu_rounds": 1 if q else 2,
        "io_runs": 600 if q else 2000,
    }


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
            pro = peer("bench.peers.procrastinate_side", "throughput", "--runs", sz["runs"], "--workers", workers,
                       "--concurrency", conc, "--rounds", 1)
            dbos = peer("bench.peers.dbos_side", "throughput", "--runs", sz["dbos_runs"], "--workers", workers,
                        "--concurrency", dbos_conc, "--poll", DBOS_POLL, "--rounds", 1)
            turns.update(procrastinate=lambda: pro()["rounds"][0], dbos=lambda: dbos()["rounds"][0])
        sides = h.interleave(turns, sz["rounds"], lambda m: log(f"  throughput [{label}] {m}"), lambda v: f"{v:7.1f} runs/s")
        out[label] = entry = {k: {"median": h.median(v), "rounds": v} for k, v in sides.items()}
        entry.update(workers=workers, concurrency=conc, dbos_concurrency=dbos_conc)
        if shutil.which("pgbench"):
            entry["pgbench"] = pgbench(db, clients, sz["pgbench_s"])
            log(f"  throughput [{label}] pgbench -c {clients}: {entry['pgbench']['tps']:.0f} commits/s")
    return out


#: The I/O-like workload (``harness.IO_JOB``) runs at this concurrency.
IO_CONCURRENCY = 8


def section_io(db: h.Database, sz: dict[str, Any], args: argparse.Namespace, log: Log) -> dict:
    """The I/O-like workload (three steps, each waiting 5 ms first: a job that mostly waits) drained as in
    section 1 by one worker of 8, against plain Celery running the same in one task
    (``bench/plain_io_app.py``), whose ceiling is 8 / 15 ms = 533 runs/s; the sides take turns."""
    engines = {"motir": None}
    if args.baseline and (Path(args.baseline) / "bench" / "io_jobs.py").is_file():
        engines["baseline"] = args.baseline  # (a checkout older than the workload has no side here)
    turns: dict[str, Callable[[], float]] = {
        name: (lambda s=h.Motir(db, job=h.IO_JOB, imports=h.IMPORTS, engine=engine):
               h.drain(s, sz["io_runs"], 1, IO_CONCURRENCY).rate) for name, engine in engines.items()}
    turns["plain"] = lambda: h.drain(h.PlainIO(), sz["io_runs"], 1, IO_CONCURRENCY).rate
    sides = h.interleave(turns, sz["rounds"], lambda m: log(f"  io {m}"), lambda v: f"{v:7.1f} runs/s")
    return {"runs": sz["io_runs"], "concurrency": IO_CONCURRENCY,
            **{k: {"median": h.median(v), "rounds": v} for k, v in sides.items()}}


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


# The sender is half of a latency: the baseline's publishes too, from a process that runs the
# baseline checkout's own code (its working directory first on the path: its motir_celery and bench).
_BASELINE_SENDER = ("import json, sys; from bench import harness as h; "
                    "print(json.dumps(h.latency(h.Motir(h.Database(sys.argv[1])), int(sys.argv[2]), float(sys.argv[3]))))")


def section_latency(db: h.Database, sz: dict[str, Any], args: argparse.Namespace, log: Log) -> dict:
    """``harness.latency``: the sides the targets compare take turns, ``latency_rounds`` times (this
    machine drifts by a millisecond within minutes); p50 and p99 are medians of the rounds'. The
    rest run once, after them."""
    n, interval = sz["latency_events"], 0.02

    def baseline() -> dict:
        done = subprocess.run([sys.executable, "-c", _BASELINE_SENDER, db.url, str(n), str(interval)],
                              env=h.child_env(args.baseline, BENCH_ENGINE_PATH=args.baseline), cwd=args.baseline,
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"baseline latency failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    turns: dict[str, Callable[[], dict]] = {"motir": lambda: h.latency(side("motir", db, args), n, interval)}
    if args.baseline:
        turns["baseline"] = baseline
    turns["plain"] = lambda: h.latency(side("plain", db, args), n, interval)
    if args.peers:
        turns["procrastinate"] = peer("bench.peers.procrastinate_side", "latency", "--events", n,
                                      "--interval", interval, "--concurrency", 2)
    out: dict[str, Any] = {"events": n, "interval": interval, "rounds": sz["latency_rounds"]}
    for name, rs in h.interleave(turns, sz["latency_rounds"]).items():
        out[name] = {"p50": h.median(r["p50"] for r in rs), "p99": h.median(r["p99"] for r in rs),
                     "n": sum(r["n"] for r in rs), "p50s": [r["p50"] for r in rs]}
    out["motir_events"] = h.latency(side("motir_events", db, args), n, interval)
    if args.peers:
        out["dbos"] = peer("bench.peers.dbos_side", "latency", "--events", n, "--interval", interval,
                           "--concurrency", 2, "--poll", DBOS_POLL)()
    for name in (s for s in SIDE_ORDER if s in out):
        log(f"  latency {name:<13} p50 {out[name]['p50'] * 1e3:6.1f} ms  p99 {out[name]['p99'] * 1e3:6.1f} ms")
    return out


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


#: 90 % finished runs (succeeded, with a result), 10 % queued, due and dispatched just now: a deep,
#: healthy backlog, nothing for the sweeper to re-publish (``queued_tenths``: 1; 0 all finished, 10 all queued).
DEPTH_SEED = """
    INSERT INTO job_queue (job_id, scheduled_for, event_name, max_attempts, retry_policy, state, attempts,
                           run_at, dispatched_at, created_at, finished_at, result)
    SELECT 'bench.depth', timestamptz '2000-01-01' + make_interval(secs => g), 'scheduled.bench.depth', 3,
           'transient', CASE WHEN g %% 10 < %(queued_tenths)s THEN 'queued' ELSE 'succeeded' END, CASE WHEN g %% 10 < %(queued_tenths)s THEN 0 ELSE 1 END,
           now() - interval '1 minute', now(), now() - interval '1 hour',
           CASE WHEN g %% 10 < %(queued_tenths)s THEN NULL ELSE now() - interval '30 minutes' END,
           CASE WHEN g %% 10 < %(queued_tenths)s THEN NULL ELSE jsonb_build_object('ok', true) END
    FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) g
"""


def depth_timings(runs: int = 300, sweeps: int = 20) -> dict[str, float]:
    """Fresh runs claimed and settled with the engine's statements on one autocommit connection, as a
    worker does, and the sweeper's two statements in their own transactions; medians, ms."""
    from motir_celery.store.sql import flow, maintenance, producer, worker

    engine = h.held()  # runs written, their messages held
    sql, tuning = engine.sql_engine(), engine.tuning

    t: dict[str, list[float]] = {"send_ms": [], "claim_ms": [], "settle_ms": [], "throttle_ms": [], "gather_ms": [],
                                 "next_ms": [], "cancel_ms": [], "reclaim_ms": [], "republish_ms": []}
    ids = []
    for i in range(runs):
        t0 = time.perf_counter()
        ids.append(engine.send_event("bench.three", {"n": i}).run_ids[0])
        t["send_ms"].append(time.perf_counter() - t0)
    # Flow control's lookups by key (jobs with throttle= / debounce=): a throttled claim's count of the
    # runs of its key waiting ahead, and a send's gather of its new run into its key's open one.
    gathered = [engine.send_event("bench.three", {"n": i}).run_ids[0] for i in range(runs)]
    with sql.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        waiting = conn.exec_driver_sql(
            "INSERT INTO job_queue (job_id, event_name, max_attempts, retry_policy, flow_wait, throttle_key) "
            "SELECT 'bench.throttled', 'e', 3, 'transient', 'throttle', 'k' FROM generate_series(1, 20) "
            "RETURNING id").scalars().all()[-1]
        for run_id in gathered:
            t0 = time.perf_counter()
            flow.throttle_state(conn, waiting, "bench.throttled", "k", None, 5, 60.0)
            t1 = time.perf_counter()
            flow.gather(conn, [(run_id, "debounce", "k", 60.0, 600.0)])
            t["throttle_ms"].append(t1 - t0)
            t["gather_ms"].append(time.perf_counter() - t1)
        # concurrency=: a freed slot's next run of the key (each then claimed, as its worker would).
        conn.exec_driver_sql(
            "INSERT INTO job_queue (job_id, event_name, max_attempts, retry_policy, concurrency_key) "
            f"SELECT 'bench.limited', 'e', 3, 'transient', '' FROM generate_series(1, {runs})")
        for _ in range(runs):
            t0 = time.perf_counter()
            picked = worker.next_in_line(conn, "bench.limited", "", None)
            t["next_ms"].append(time.perf_counter() - t0)
            conn.exec_driver_sql("UPDATE job_queue SET state = 'running' WHERE id = %(id)s", {"id": picked})
        # cancel_on: an event's cancel of the depth job's active runs that carry its key (the lookup is
        # the cost: none carries one), with the job's whole history (DEPTH_SEED) behind it.
        for i in range(runs):
            t0 = time.perf_counter()
            producer.cancel_by_key(conn, "bench.depth", f"key-{i}", None, None)
            t["cancel_ms"].append(time.perf_counter() - t0)
    with sql.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for run_id in ids:
            t0 = time.perf_counter()
            c = worker.claim(conn, run_id, job_id="bench.three", worker="bench/depth", lease_seconds=60,
                             async_commit=tuning.claim_async_commit)
            t1 = time.perf_counter()
            assert c is not None and worker.settle_succeeded(conn, c, '{"ok":true}',
                                                             async_commit=tuning.settle_async_commit)
            t["claim_ms"].append(t1 - t0)
            t["settle_ms"].append(time.perf_counter() - t1)
    for _ in range(sweeps):
        for key, sweep in (("reclaim_ms", lambda c: maintenance.reclaim_expired(c)),
                           ("republish_ms", lambda c: maintenance.republish_due(c, after_seconds=3600))):
            with sql.begin() as conn:
                t0 = time.perf_counter()
                found = sweep(conn)
                t[key].append(time.perf_counter() - t0)
                assert key == "reclaim_ms" or not found
    return {k: h.median(v) * 1e3 for k, v in t.items()}


def section_depth(db: h.Database, sz: dict[str, Any], args: argparse.Namespace, log: Log) -> dict:
    """Claim + settle and the sweeper's statements with ``small`` vs ``large`` rows in job_queue (``DEPTH_SEED``)."""
    small, large = sz["depth"]

    def seed(lo: int, hi: int, queued_tenths: int) -> None:
        for a in range(lo, hi + 1, 200_000):
            db.rows(DEPTH_SEED, {"lo": a, "hi": min(hi, a + 199_999), "queued_tenths": queued_tenths})

    db.truncate()
    timings = []
    for lo, hi in ((1, small), (small + 1, large)):
        seed(lo, hi, 1)
        db.rows("VACUUM ANALYZE job_queue")
        timings.append(depth_timings())
    # The same depth, its statistics taken while nothing was queued (a quiet spell), then the backlog:
    # what a queue looks like after an outage. Autovacuum off meanwhile, so no ANALYZE hides it.
    db.truncate()
    db.rows("ALTER TABLE job_queue SET (autovacuum_enabled = false)")
    try:
        seed(1, large - large // 10, 0)
        db.rows("VACUUM ANALYZE job_queue")
        seed(large - large // 10 + 1, large, 10)
        timings.append(depth_timings())
    finally:
        db.rows("ALTER TABLE job_queue RESET (autovacuum_enabled)")
    db.truncate()
    shallow, deep, quiet = timings
    r = {"small": small, "large": large, "shallow": shallow, "deep": deep, "quiet": quiet,
         "ratio": {k: deep[k] / shallow[k] for k in shallow}, "quiet_ratio": {k: quiet[k] / shallow[k] for k in shallow}}
    log(f"  depth {small} -> {large}: " + ", ".join(f"{k} x{v:.2f}" for k, v in r["ratio"].items()))
    log("  depth, statistics of a quiet queue: " + ", ".join(f"{k} x{v:.2f}" for k, v in r["quiet_ratio"].items()))
    return r


def section_fanout(db: h.Database, sz: dict[str, Any], args: argparse.Namespace, log: Log) -> dict:
    """One event with 50 subscribers: ``send_event`` writes the event and its runs in one transaction,
    then publishes 50 messages (purged after); with publishing, and database only (messages held)."""
    import motir_celery
    from bench import workload

    workload.fanout_subscribers()
    motir = h.Motir(db)
    motir.reset()
    motir_celery.send_event(workload.FANOUT_EVENT, {"warm": True})  # pool, prepared statements, broker connection
    times: dict[str, list[float]] = {"with": [], "db": []}
    held = h.held()
    held.send_event(workload.FANOUT_EVENT, {"warm": True})
    for i in range(sz["fanout_rounds"]):
        for kind, send in (("with", motir_celery.send_event), ("db", held.send_event)):
            t0 = time.perf_counter()
            r = send(workload.FANOUT_EVENT, {"i": i})
            times[kind].append(time.perf_counter() - t0)
            assert len(r.run_ids) == workload.FANOUT
    motir.reset()
    rows, t, d = workload.FANOUT + 1, h.median(times["with"]), h.median(times["db"])
    log(f"  fan-out x{workload.FANOUT}: {t * 1e3:.1f} ms ({rows / t:.0f} rows/s); db only {d * 1e3:.1f} ms")
    return {"subscribers": workload.FANOUT, "ms": t * 1e3, "rows_per_s": rows / t, "db_ms": d * 1e3,
            "db_rows_per_s": rows / d}


def section_beat(db: h.Database, sz: dict[str, Any], args: argparse.Namespace, log: Log) -> dict:
    """3 beat processes (spawned, a pool each) walk the same cron slots in the same order: every slot
    must come out exactly once (one ``Queued``, the others ``AlreadyQueued``)."""
    slots, beats, ctx = sz["beat_slots"], 3, mp.get_context("spawn")
    db.truncate()
    out, start_at = ctx.Queue(), time.time() + 3.0
    procs = [ctx.Process(target=h.beat, args=(db.url, "bench.beat", slots, start_at, out)) for _ in range(beats)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    rows = db.value("SELECT count(*) FROM job_queue WHERE job_id = 'bench.beat'")
    db.truncate()
    queued, elapsed = sum(r[0] for r in results), max(r[1] for r in results)
    if queued != slots or rows != slots:
        raise RuntimeError(f"beat: {queued} Queued and {rows} rows for {slots} slots")
    r = {"beats": beats, "slots": slots, "calls_per_s": beats * slots / elapsed, "slots_per_s": slots / elapsed}
    log(f"  beat x{beats}: {r['calls_per_s']:.0f} calls/s, {r['slots_per_s']:.0f} slots/s")
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
        "motir-celery": h.describe(),
        "libraries": ", ".join(f"{p} {md.version(p)}" for p in ("celery", "kombu", "SQLAlchemy", "psycopg", "redis")),
        "pgbench": subprocess.run(["pgbench", "--version"], capture_output=True, text=True).stdout.strip()
        if shutil.which("pgbench") else "not installed (apt-get install postgresql-contrib)",
    }
    if peers:
        env["peers (bench/.peers-venv)"] = ", ".join(f"{k} {v}" for k, v in peersenv.versions().items())
    return env


def _row(*cells: Any) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def _protocol(p: dict[str, int]) -> str:
    return f"{p['round_trips']} / {p['commits']}"


def render(results: dict[str, Any], env: dict[str, str], command: str, elapsed: float) -> str:
    """The suite's block of docs/performance.md."""
    md = ["### The suite (generated)", "",
          f"Generated by `{command}` ({elapsed / 60:.1f} min). Figures are medians of the rounds listed; every "
          "ratio compares two figures from this same run (sides interleaved round by round), because the machine "
          "is shared and absolute numbers drift.", "", "| | |", "|---|---|"]
    md += [_row(k, v) for k, v in env.items()]

    if tp := results.get("throughput"):
        md += ["", "#### 1. Throughput (3-step job, queued first, then drained)", "",
               "runs/s over the 5%..95% span of the drain; DBOS drains fewer runs per round (it is ~10x slower) "
               f"and runs at its best tuning found here (queue polling {DBOS_POLL}s; worker_concurrency "
               "2 with one process, 8 with two).", "", _row("side", *tp), "|---|" + "---:|" * len(tp)]
        md += [_row(SIDE_NAMES[s], *(f"**{e[s]['median']:.0f}** ({', '.join(f'{x:.0f}' for x in e[s]['rounds'])})"
                                     if s in e else "" for e in tp.values()))
               for s in SIDE_ORDER if any(s in e for e in tp.values())]
        pgb = any("pgbench" in e for e in tp.values())
        if pgb:
            md.append(_row("pgbench, 1-row INSERT per commit (commits/s)", *(
                f"{e['pgbench']['tps']:.0f} (-c {e['pgbench']['clients']})" if "pgbench" in e else "" for e in tp.values())))
        md += ["", _row("ratio", *tp), "|---|" + "---:|" * len(tp)]
        for name, mine, other in (("motir / plain Celery", "motir", "plain"),
                                  ("motir / Procrastinate", "motir", "procrastinate"), ("motir / DBOS", "motir", "dbos"),
                                  ("motir / baseline engine (before -> after)", "motir", "baseline"),
                                  ("motir / plain Celery with Redis ack emulation off", "motir", "plain_noack"),
                                  ("motir task-events-on / plain Celery", "motir_events", "plain")):
            ratios = {label: e[mine]["median"] / e[other]["median"] for label, e in tp.items() if other in e and mine in e}
            if ratios:
                md.append(_row(name, *(f"{ratios[label]:.2f}" if label in ratios else "" for label in tp)))
        if pgb:  # 3 flushed commits a run: the three step records (the claim's and the settle's are not flushed)
            md.append(_row("motir runs/s x 3 flushed commits / pgbench commits/s (share of the commit ceiling)", *(
                f"{e['motir']['median'] * 3 / e['pgbench']['tps']:.2f}" if "pgbench" in e else "" for e in tp.values())))

    if io := results.get("io"):
        md += ["", f"#### 1b. I/O-like workload (3 steps, each waiting 5 ms first; 1 worker x {io['concurrency']})", "",
               f"runs/s over the 5%..95% span of a drain of {io['runs']:,} runs; plain Celery runs the same waits and "
               f"functions in one task. Its ceiling: {io['concurrency']} / 15 ms = {io['concurrency'] / 0.015:.0f} runs/s.",
               "", "| side | runs/s | per round |", "|---|---:|---|"]
        md += [_row(SIDE_NAMES[s], f"**{io[s]['median']:.0f}**", ", ".join(f"{x:.0f}" for x in io[s]["rounds"]))
               for s in SIDE_ORDER if s in io]
        ratio = io["motir"]["median"] / io["plain"]["median"]
        md += ["", "| ratio | |", "|---|---:|", _row("motir / plain Celery", f"{ratio:.2f}")]
        if "baseline" in io:
            md.append(_row("motir / baseline engine (before -> after)", f"{io['motir']['median'] / io['baseline']['median']:.2f}"))

    if lat := results.get("latency"):
        md += ["", f"#### 2. Latency at low load (one event every {lat['interval'] * 1e3:.0f} ms, {lat['events']} events, "
               "1 worker x 2)", "",
               f"Sides with a p50 per round took turns, {lat.get('rounds', 1)} rounds; their p50 and p99 are the "
               "medians over the rounds. The others ran once, after them.", "",
               "| side | p50 ms | p99 ms | p50 per round, ms |", "|---|---:|---:|---|"]
        md += [_row(SIDE_NAMES[s], f"{lat[s]['p50'] * 1e3:.1f}", f"{lat[s]['p99'] * 1e3:.1f}",
                    ", ".join(f"{x * 1e3:.1f}" for x in lat[s].get("p50s", []))) for s in SIDE_ORDER if s in lat]

    if st := results.get("steps"):
        r = st["motir"]
        md += ["", "#### 3. Step cost", "",
               "Time per `step.run` (median inside a 100-step run; miss = body + stored record, hit = replay from "
               "the memo loaded with the claim), and what one attempt sends to Postgres, counted from libpq's "
               "protocol trace (round trip = Query or Sync; commit = a transaction that wrote: bench/stepcost.py).", "",
               "| engine | miss us/step | hit us/step | " + " | ".join(f"k={k} new: round trips / commits"
                                                                  for k in r["fresh"])
               + f" | replay of k={list(r['replay'])[-1]} hits |", "|---|---:|---:|" + "---:|" * (len(r["fresh"]) + 1)]
        for name, s in st.items():
            md.append(f"| {SIDE_NAMES[name]} | {s['miss_us']:.0f} | {s['hit_us']:.1f} | "
                      + " | ".join(map(_protocol, s["fresh"].values())) + f" | {_protocol(list(s['replay'].values())[-1])} |")
        over = {int(k): p["round_trips"] - int(k) for k, p in r["fresh"].items()}
        md += ["", "Round trips a run of k new steps: k + " + "/".join(sorted({str(v) for v in over.values()}))
               + f" at k = {', '.join(map(str, over))}; a replay's, whatever k: "
               + "/".join(sorted({str(p['round_trips']) for p in r['replay'].values()})) + "."]

    if cp := results.get("cpu"):
        md += ["", f"#### 3b. CPU per run (1 worker x 2, {cp['runs']:,} runs, median of {cp['rounds']} rounds)", "",
               "CPU seconds (user + system) per run, read from the kernel: steadier than wall-clock rates on a shared "
               "machine, though still +-15% between invocations.", "",
               "| engine | worker main process ms | pool children ms | Postgres backends ms | total ms |",
               "|---|---:|---:|---:|---:|"]
        md += [_row(SIDE_NAMES[k], f"{v['main_ms']:.2f}", f"{v['children_ms']:.2f}", f"{v['postgres_ms']:.2f}",
                    f"**{v['total_ms']:.2f}**") for k, v in cp["variants"].items()]

    if dp := results.get("depth"):
        md += ["", f"#### 4. Scale with depth ({dp['small']:,} vs {dp['large']:,} rows in job_queue: 90% finished, "
               "10% queued and due)", "", "The last two columns: the same large table, its statistics taken while "
               "nothing was queued and the backlog queued after (ANALYZE then sees no queued run).", "",
               "| statement | ms at small | ms at large | ratio | large, statistics of a quiet queue | ratio |",
               "|---|---:|---:|---:|---:|---:|"]
        for k, name in {"send_ms": "send_event (one subscriber)", "claim_ms": "claim (+ memo preload)",
                        "settle_ms": "settle (succeeded)", "throttle_ms": "throttle=: the runs of a key waiting ahead",
                        "gather_ms": "debounce=: a new run gathered into its key's open one",
                        "next_ms": "concurrency=: a freed slot's next run of the key",
                        "cancel_ms": "cancel_on: an event's cancel of its key's active runs",
                        "reclaim_ms": "sweeper: reclaim expired leases",
                        "republish_ms": "sweeper: re-publish lost messages"}.items():
            md.append(_row(name, f"{dp['shallow'][k]:.2f}", f"{dp['deep'][k]:.2f}", f"{dp['ratio'][k]:.2f}",
                           f"{dp['quiet'][k]:.2f}", f"{dp['quiet_ratio'][k]:.2f}"))

    if fo := results.get("fanout"):
        md += ["", f"#### 5. Fan-out (1 event x {fo['subscribers']} subscribers)", "",
               "| send_event | ms | rows/s |", "|---|---:|---:|",
               f"| with publishing ({fo['subscribers']} messages) | {fo['ms']:.1f} | {fo['rows_per_s']:.0f} |",
               f"| database only (messages held) | {fo['db_ms']:.1f} | {fo['db_rows_per_s']:.0f} |"]

    if bt := results.get("beat"):
        md += ["", f"#### 6. Beat ({bt['beats']} concurrent beats on the same {bt['slots']} slots)", "",
               f"- `enqueue_scheduled` calls/s (all beats): **{bt['calls_per_s']:.0f}**",
               f"- distinct slots enqueued/s: **{bt['slots_per_s']:.0f}** (each slot exactly once: checked)"]

    if mem := results.get("memory"):
        md += ["", "#### 7. Memory (one worker, prefork x 2)", "", "| runs | pool child RSS MiB | child peak MiB | "
               "main process RSS MiB |", "|---:|---:|---:|---:|"]
        md += [_row(f"{s['runs']:,}", f"{s['child_rss_kb'] / 1024:.1f}", f"{s['child_hwm_kb'] / 1024:.1f}",
                    f"{s['main_rss_kb'] / 1024:.1f}") for s in mem["samples"]]
        md += ["", f"Growth from the first to the last: {mem['growth'] * 100:+.1f}% (child), "
               f"{mem['main_growth'] * 100:+.1f}% (main process)."]
    return "\n".join(md) + "\n"


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
    parser.add_argument("--output", default=str(h.PERFORMANCE_DOC),
                        help="the doc whose suite block is rewritten (default docs/performance.md; '-' for none)")
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

    if peers := args.peers and bool({"throughput", "latency"} & set(sections)):
        peersenv.ensure()
    db = h.Database.create(DB)
    h.use_engine(db.url, h.MOTIR_QUEUE)
    env, sz, results = environment(db, peers), sizes(args), {}
    try:
        for name in sections:
            log(f"{name} ...")
            results[name] = globals()[f"section_{name}"](db, sz, args, log)
    finally:
        if not args.keep:
            db.drop()
            for peer_db in ("motir_bench_procrastinate", "motir_bench_dbos"):
                h.drop_database(peer_db)
    markdown = render(results, env, ("python -m bench " + " ".join(sys.argv[1:])).strip(), time.perf_counter() - started)
    Path("/tmp/bench-results.json").write_text(json.dumps({"env": env, "results": results}, indent=1, default=str))
    h.write_block("bench", markdown, Path(args.output) if args.output != "-" else h.PERFORMANCE_DOC,
                  write=args.output != "-")


if __name__ == "__main__":
    main()
