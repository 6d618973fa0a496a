"""Retention at depth (issue 19): ``motir purge`` on 10M finished runs while workers take new ones.

    python -m bench.retention [--runs 10000000] [--no-write]    # --runs 200000: a quick pass

Needs CELERY_BROKER_URL and Debian's Postgres binaries (``harness.private_postgres``). The runs
are written with load-only settings (keys and indexes dropped, rebuilt from the catalogue, which
must then compare equal to the migration's); the server restarts with ``MEASURED`` for the live
part: workers timing their statements (``bench.jobs``), a window without purge, then purge A
without migration 0007's two DLQ indexes and purge B with them. docs/scaling.md has the result.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from bench import harness as h

DB = "motir_retention"
TABLES = ("job_event", "job_queue", "job_step", "job_run", "job_run_dlq")
#: Server settings while loading (on top of the harness's fsync=off, full_page_writes=off).
LOADING = ("shared_buffers=1GB", "wal_level=minimal", "max_wal_senders=0", "max_wal_size=16GB",
           "autovacuum=off", "checkpoint_timeout=30min")
#: Server settings of the measurement: durable commits, defaults elsewhere but for memory and WAL size.
MEASURED = ("fsync=on", "full_page_writes=on", "synchronous_commit=on", "shared_buffers=1GB",
            "max_wal_size=4GB", "autovacuum=on")
#: Migration 0007's indexes on the two job_run_dlq columns that reference job_queue (ON DELETE SET
#: NULL: without them every deleted run reads all of job_run_dlq). Pass A drops them, pass B makes them.
DLQ_FK_INDEXES = {"ix_job_run_dlq_replay_run": "replay_run_id", "ix_job_run_dlq_resumed_run": "resumed_run_id"}
log = h.logger("retention")


# --- the data ----------------------------------------------------------------------------------
#
# Run i (1..N) finished at T(i), spread evenly over the last --days days, oldest first.
#   i % 200 = 0 : failed after 3 attempts, one step stored, a DLQ entry (0.5 %); the entry was
#                 dismissed a day later unless i % 1000 = 0 (then still open: purge keeps the run)
#   i % 25 = 1  : a cron run (event_id NULL, scheduled_for its slot), one step, succeeded (4 %)
#   otherwise   : an event run (its own event, 1 in 10 with an idempotency key), two steps,
#                 one attempt, succeeded
# Shapes follow what the engine writes (store/sql: claim, store_step, settle_*; the DLQ's).

_T = "(%(anchor)s::timestamptz - make_interval(days => %(days)s) + make_interval(secs => i * %(step)s))"
_FAILED = "(i %% 200 = 0)"
_CRON = "(i %% 25 = 1)"
_OPEN = "(i %% 1000 = 0)"
_JOB = f"CASE WHEN {_CRON} THEN 'app.nightly-' || (i %% 4) ELSE 'app.job-' || (i %% 8) END"
_EVENT_NAME = f"CASE WHEN {_CRON} THEN 'scheduled.app.nightly-' || (i %% 4) ELSE 'app.event-' || (i %% 8) END"
_WS = f"CASE WHEN {_CRON} THEN NULL ELSE 'ws-' || (i %% 50) END"
_EVENT_DATA = "jsonb_build_object('n', i, 'workspace_id', 'ws-' || (i %% 50), 'order', 'ord-' || i, 'amount', i %% 977)"
_ERROR = ("jsonb_build_object('type', 'ValueError', 'message', 'upstream said no for ord-' || i, "
          "'traceback', repeat('  File \"app/jobs.py\", line 42, in charge\\n    raise ValueError(...)\\n', 6))")
_SERIES = "FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS i"

LOAD_SQL: dict[str, str] = {
    "job_event": f"""
        INSERT INTO job_event (id, name, data, workspace_id, idempotency_key, received_at)
        SELECT md5('e' || i)::uuid, 'app.event-' || (i %% 8), {_EVENT_DATA}, 'ws-' || (i %% 50),
               CASE WHEN i %% 10 = 0 THEN 'key-' || i END, {_T} - interval '5 ms'
        {_SERIES} WHERE NOT {_CRON}""",
    "job_queue": f"""
        INSERT INTO job_queue (id, job_id, event_id, event_name, workspace_id, scheduled_for, skip_overlap, state,
                               priority, deferrals, run_at, attempts, max_attempts, retry_policy, claim_token,
                               claimed_by, lease_expires_at, dispatched_at, result, created_at, finished_at,
                               detached)
        SELECT md5('r' || i)::uuid, {_JOB}, CASE WHEN {_CRON} THEN NULL ELSE md5('e' || i)::uuid END,
               {_EVENT_NAME}, {_WS}, CASE WHEN {_CRON} THEN {_T} END, false,
               CASE WHEN {_FAILED} THEN 'failed' ELSE 'succeeded' END, 0, 0,
               {_T} + CASE WHEN {_FAILED} THEN interval '30 s' ELSE interval '0 s' END,
               CASE WHEN {_FAILED} THEN 3 ELSE 1 END, 3, 'transient', NULL,
               'w' || (i %% 4) || '@host-' || (i %% 3), NULL,
               {_T} + CASE WHEN {_FAILED} THEN interval '30 s' ELSE interval '0 s' END,
               CASE WHEN {_FAILED} THEN NULL ELSE jsonb_build_object('n', i) END, {_T},
               {_T} + CASE WHEN {_FAILED} THEN interval '31 s' ELSE interval '200 ms' END, false
        {_SERIES}""",
    "job_step": f"""
        INSERT INTO job_step (run_id, step_id, workspace_id, output, attempt, started_at, completed_at)
        SELECT md5('r' || i)::uuid, s.step_id, {_WS}, jsonb_build_object('step', s.step_id, 'n', i), 1,
               {_T} + s.k * interval '50 ms', {_T} + s.k * interval '50 ms' + interval '10 ms'
        {_SERIES} CROSS JOIN (VALUES ('one', 1), ('two', 2)) AS s(step_id, k)
        WHERE s.k = 1 OR NOT ({_CRON} OR {_FAILED})""",
    "job_run": f"""
        INSERT INTO job_run (run_id, attempt, workspace_id, job_id, event_name, worker, outcome, error,
                             started_at, finished_at)
        SELECT md5('r' || i)::uuid, a, {_WS}, {_JOB}, {_EVENT_NAME}, 'w' || (i %% 4) || '@host-' || (i %% 3),
               CASE WHEN NOT {_FAILED} THEN 'succeeded' WHEN a < 3 THEN 'retrying' ELSE 'failed' END,
               CASE WHEN {_FAILED} THEN {_ERROR} END,
               {_T} + (a - 1) * interval '15 s' + interval '10 ms', {_T} + (a - 1) * interval '15 s' + interval '200 ms'
        {_SERIES} CROSS JOIN LATERAL generate_series(1, CASE WHEN {_FAILED} THEN 3 ELSE 1 END) AS a""",
    "job_run_dlq": f"""
        INSERT INTO job_run_dlq (id, run_id, workspace_id, function_id, event_id, event_name, event_data,
                                 idempotency_key, failure, attempts, first_failed_at, last_failed_at,
                                 dismissed_at, dismissed_by)
        SELECT md5('d' || i)::uuid, md5('r' || i)::uuid, {_WS}, {_JOB}, md5('e' || i)::uuid, {_EVENT_NAME},
               {_EVENT_DATA}, CASE WHEN i %% 10 = 0 THEN 'key-' || i END, {_ERROR}, 3,
               {_T} + interval '1 s', {_T} + interval '31 s',
               CASE WHEN NOT {_OPEN} THEN least({_T} + interval '1 day', %(anchor)s::timestamptz) END,
               CASE WHEN NOT {_OPEN} THEN 'ops' END
        {_SERIES} WHERE {_FAILED}""",
}

_CATALOGUE = """
    SELECT 'constraint' AS kind, c.conrelid::regclass::text AS tbl, c.conname AS name, c.contype::text AS type,
           pg_get_constraintdef(c.oid) AS def, c.convalidated AS valid,
           CASE WHEN c.contype IN ('p', 'u') THEN pg_get_indexdef(c.conindid) END AS indexdef
    FROM pg_constraint c
    WHERE (c.conrelid::regclass::text = ANY(%(tables)s) AND c.contype IN ('p', 'u', 'f'))
       OR (c.confrelid::regclass::text = ANY(%(tables)s) AND c.contype = 'f')  -- other tables' keys into ours
    UNION ALL
    SELECT 'index', i.indrelid::regclass::text, x.relname, NULL, pg_get_indexdef(i.indexrelid), true, NULL
    FROM pg_index i JOIN pg_class x ON x.oid = i.indexrelid
    WHERE i.indrelid::regclass::text = ANY(%(tables)s)
      AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid AND c.contype IN ('p', 'u'))
    ORDER BY 1, 2, 3
"""


def parallel(url: str, tasks: list[tuple[str, list[tuple[str, dict[str, Any]]]]], *, setup: tuple[str, ...] = (),
             transaction: bool = True, sessions: int = 2) -> dict[str, float]:
    """Each task's statements in order on one of ``sessions`` connections at once, a task in one
    transaction (or none: VACUUM); seconds per task."""
    todo, lock, took, errors = list(tasks), threading.Lock(), {}, []

    def worker() -> None:
        with h.connect(url) as conn:
            for statement in setup:
                conn.execute(statement)  # type: ignore[arg-type]
            while True:
                with lock:
                    if not todo or errors:
                        return
                    label, statements = todo.pop(0)
                t0 = time.monotonic()
                try:
                    with conn.transaction() if transaction else nullcontext():
                        for sql, params in statements:
                            for one in filter(str.strip, sql.split(";\n")):
                                conn.execute(one, params if "%(" in one else None)  # type: ignore[arg-type]
                except BaseException as exc:  # noqa: BLE001 — raised below, in the caller
                    errors.append(exc)
                    return
                took[label] = time.monotonic() - t0

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return took


@dataclass
class Load:
    runs: int
    seconds: dict[str, float] = field(default_factory=dict)
    anchor: datetime | None = None
    rows: dict[str, int] = field(default_factory=dict)


def load(url: str, runs: int, days: int) -> Load:
    """The schema's keys and indexes dropped, the rows written, the keys and indexes rebuilt
    from their catalogue definitions, and the catalogue compared with the migration's."""
    out = Load(runs)

    def timed(name: str, *work: Any) -> None:
        t0 = time.monotonic()
        for w in work:
            w()
        out.seconds[name] = time.monotonic() - t0

    with h.connect(url) as conn:
        out.anchor = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        before = conn.execute(_CATALOGUE, {"tables": list(TABLES)}).fetchall()
    fks = [(t, n, d) for k, t, n, ty, d, _, _ in before if k == "constraint" and ty == "f"]
    keys = [(t, n, ty) for k, t, n, ty, _, _, _ in before if k == "constraint" and ty in ("p", "u")]
    with h.connect(url) as conn:
        timed("drop", *(lambda t=t, n=n: conn.execute(f'ALTER TABLE {t} DROP CONSTRAINT "{n}"') for t, n, *_ in fks + keys),
              *(lambda n=n: conn.execute(f'DROP INDEX "{n}"') for k, _, n, *_ in before if k == "index"))
    # Rows: each table in slices of 2M runs, all in one transaction that first TRUNCATEs the
    # table (wal_level=minimal then writes no WAL for it); two tables at a time.
    step = days * 86400.0 / runs
    chains = [(f"rows:{table}", [((f"TRUNCATE {table};\n" if lo == 1 else "") + LOAD_SQL[table],
                                  {"anchor": out.anchor, "days": days, "step": step, "lo": lo,
                                   "hi": min(lo + 2_000_000 - 1, runs)}) for lo in range(1, runs + 1, 2_000_000)])
              for table in ("job_queue", "job_step", "job_event", "job_run", "job_run_dlq")]
    timed("rows", lambda: out.seconds.update(parallel(url, chains, setup=("SET synchronous_commit = off",))))
    # Indexes (the constraints' own by their index definitions), the biggest tables first, so the
    # two sessions finish together.
    weight = {"job_step": 4, "job_queue": 3, "job_run": 2, "job_event": 2, "job_run_dlq": 0}
    index_jobs = [(f"index:{n}", [(ix if k == "constraint" else d, {})]) for k, t, n, ty, d, _, ix in
                  sorted(before, key=lambda r: -weight.get(r[1], 0)) if k == "index" or ty in ("p", "u")]
    timed("indexes", lambda: parallel(url, index_jobs, setup=("SET maintenance_work_mem = '1GB'",
                                                              "SET max_parallel_maintenance_workers = 0")))
    with h.connect(url) as conn:
        word = {"p": "PRIMARY KEY", "u": "UNIQUE"}
        timed("foreign keys",
              *(lambda t=t, n=n, ty=ty: conn.execute(f'ALTER TABLE {t} ADD CONSTRAINT "{n}" {word[ty]} USING INDEX "{n}"')
                for t, n, ty in keys),
              *(lambda t=t, n=n, d=d: conn.execute(f'ALTER TABLE {t} ADD CONSTRAINT "{n}" {d} NOT VALID') for t, n, d in fks),
              lambda: parallel(url, [(f"validate:{n}", [(f'ALTER TABLE {t} VALIDATE CONSTRAINT "{n}"', {})])
                                     for t, n, _ in fks], setup=("SET work_mem = '256MB'",)))
        after = conn.execute(_CATALOGUE, {"tables": list(TABLES)}).fetchall()
    if sorted(after) != sorted(before):
        raise RuntimeError(f"the rebuilt schema differs from the migration's:\n{set(before) ^ set(after)}")
    timed("vacuum freeze", lambda: parallel(url, [(f"vacuum:{t}", [(f"VACUUM (FREEZE, ANALYZE) {t}", {})]) for t in
                                                  ("job_step", "job_queue", "job_run", "job_event", "job_run_dlq")],
                                            setup=("SET maintenance_work_mem = '1GB'",), transaction=False))
    out.rows = {t: int(h.Database(url).value(f"SELECT count(*) FROM {t}")) for t in TABLES}
    return out


def sizes(url: str) -> dict[str, dict[str, int]]:
    with h.connect(url) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        rows = {r[0]: r[1:] for r in conn.execute(
            "SELECT c.relname, pg_relation_size(c.oid), pg_indexes_size(c.oid), pg_total_relation_size(c.oid),"
            " s.n_live_tup, s.n_dead_tup, s.n_tup_del, s.autovacuum_count, s.vacuum_count"
            " FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid WHERE c.relname = ANY(%s)", (list(TABLES),))}
    names = ("heap", "indexes", "total", "live", "dead", "deleted", "autovacuums", "vacuums")
    return {t: dict(zip(names, map(int, rows[t]))) for t in TABLES}


# --- the live part -------------------------------------------------------------------------


@dataclass
class Window:
    t0: float = 0.0  # time.time()
    t1: float = 0.0
    db0: datetime | None = None
    db1: datetime | None = None

    def open(self, url: str) -> None:
        self.t0, self.db0 = time.time(), _db_now(url)

    def close(self, url: str) -> None:
        self.t1, self.db1 = time.time(), _db_now(url)


def _db_now(url: str) -> datetime:
    return h.Database(url).value("SELECT now()")  # type: ignore[no-any-return]


def window_stats(url: str, w: Window, times: list[tuple[str, float, float]]) -> dict[str, Any]:
    """Live runs created and finished in the window, created→finished p50/p99 (database clock), and
    each timed statement's (count, p50, p99, max) from the workers' files."""
    in_window = "created_at >= %(a)s AND created_at < %(b)s"
    row = h.Database(url).rows(
        f"""SELECT count(*) FILTER (WHERE {in_window}), count(*) FILTER (WHERE finished_at >= %(a)s AND finished_at < %(b)s),
                   percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - created_at)) FILTER (WHERE {in_window}),
                   percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - created_at)) FILTER (WHERE {in_window})
            FROM job_queue WHERE job_id = 'retention.live'""", {"a": w.db0, "b": w.db1})[0]
    assert w.db0 is not None and w.db1 is not None
    seconds = (w.db1 - w.db0).total_seconds()
    out: dict[str, Any] = {"seconds": seconds, "created": int(row[0]), "finished": int(row[1]),
                           "e2e_p50": float(row[2] or "nan"), "e2e_p99": float(row[3] or "nan")}
    for name in ("claim", "store_step", "settle_succeeded"):
        vals = [d for n, at, d in times if n == name and w.t0 <= at < w.t1]
        out[name] = (len(vals), h.percentile(vals, 50), h.percentile(vals, 99), max(vals) if vals else float("nan"))
    return out


class _Stop(Exception):
    pass


@dataclass
class PurgeRun:
    label: str
    older_than: timedelta
    selected: int = 0  # runs older than the cut at the start (finished; incl. those kept for open DLQ)
    seconds: float = 0.0
    complete: bool = False
    batches: list[tuple[str, float, int]] = field(default_factory=list)  # (kind, seconds since start, done)
    deleted: dict[str, int] = field(default_factory=dict)  # n_tup_del delta per table
    window: Any = None  # Window, then its window_stats

    def phases(self) -> dict[str, tuple[int, float, list[float]]]:
        """kind -> (rows, seconds, per-batch seconds) from the progress calls."""
        out: dict[str, tuple[int, float, list[float]]] = {}
        prev = 0.0
        for kind, at, n in self.batches:
            times = out.get(kind, (0, 0.0, []))[2] + [at - prev]
            out[kind], prev = (n, sum(times), times), at
        return out

    @property
    def sustained(self) -> float | None:
        """Runs/s of the runs phase, each with its children and (since the runs' batches delete
        them) its events; None before a batch finished."""
        n, secs, _ = self.phases().get("runs", (0, 0.0, []))
        return n / secs if n and secs else None


def run_purge(settings: Any, p: PurgeRun, cap: float, batch_size: int) -> None:
    from motir_celery.ops.purge import purge

    t0 = time.monotonic()

    def progress(kind: str, done: int) -> None:
        p.batches.append((kind, time.monotonic() - t0, done))
        if time.monotonic() - t0 > cap:
            raise _Stop

    try:
        purge(p.older_than, batch_size=batch_size, progress=progress, settings=settings)
        p.complete = True
    except _Stop:
        pass
    p.seconds = time.monotonic() - t0


def live(url: str, ld: Load, args: Any) -> dict[str, Any]:
    from motir_celery.settings import Settings, reset_settings
    from motir_celery.store.db import dispose_engines
    from motir_celery.store.sql.maintenance import PURGE_EVENTS

    out: dict[str, Any] = {"before": sizes(url), "passes": []}
    queue = f"bench-retention-{uuid.uuid4().hex[:8]}"
    folder = Path(tempfile.mkdtemp(prefix="motir-retention-"))
    os.chmod(folder, 0o777)
    env = h.engine_env(url, queue, "bench.jobs", RETENTION_TIMINGS=str(folder), PYTHONUNBUFFERED="1")
    settings = Settings.from_env({k: v for k, v in env.items() if k != "RETENTION_TIMINGS"})
    feeder = h.Feeder(settings, "retention.live", rate=args.rate, batch=500,
                      data=lambda n: {"n": n, "workspace_id": f"ws-{n % 50}"})
    base, db = Window(), h.Database(url)
    assert ld.anchor is not None
    oldest = ld.anchor - timedelta(days=args.days)
    finished = "SELECT count(*) FROM job_queue WHERE job_id = 'retention.live' AND finished_at IS NOT NULL"

    def one_pass(label: str, days: float, cap: float) -> None:
        p = PurgeRun(label, _db_now(url) - (oldest + timedelta(days=days)), window=Window())
        p.selected = int(db.value("SELECT count(*) FROM job_queue WHERE finished_at < now() - %s", (p.older_than,)))
        dels0 = sizes(url)
        log(f"purge {label}: runs finished before {p.older_than} ago ({p.selected:,} runs), at most {cap:.0f} s ...")
        p.window.open(url)
        run_purge(settings, p, cap, args.batch_size)
        p.window.close(url)
        time.sleep(1.5)  # table statistics are flushed within a second of a backend's commit
        dels1 = sizes(url)
        p.deleted = {t: dels1[t]["deleted"] - dels0[t]["deleted"] for t in TABLES}
        log(f"purge {label} {'done' if p.complete else 'stopped'} after {p.seconds:.0f} s: {p.deleted}")
        out["passes"].append(p)

    try:
        with h.workers("motir_celery", queue, 2, 1, env=env, tag="retention") as procs:
            feeder.start()
            procs.wait(lambda: db.value(finished) >= 20, 120, poll=0.5)
            log("workers up; warming up")
            time.sleep(args.warmup)
            base.open(url)
            time.sleep(args.baseline)
            base.close(url)
            cut = _db_now(url) - (oldest + timedelta(days=2 * args.purge_days))
            with h.connect(url) as conn, conn.transaction(force_rollback=True):  # one batch of the events pass
                t0 = time.monotonic()
                conn.execute(PURGE_EVENTS.sql, {"age": cut.total_seconds(), "batch": 1000})
                out["sweep_seconds"] = time.monotonic() - t0
            log(f"one batch of the events pass: {out['sweep_seconds']:.1f} s")
            with h.connect(url) as conn:
                for name in DLQ_FK_INDEXES:
                    conn.execute(f"DROP INDEX CONCURRENTLY {name}")
            one_pass("A (before 0007: the DLQ's links unindexed)", args.purge_days, args.schema_seconds)
            t0 = time.monotonic()
            with h.connect(url) as conn:
                for name, column in DLQ_FK_INDEXES.items():
                    conn.execute(f"CREATE INDEX CONCURRENTLY {name} ON job_run_dlq ({column}) WHERE {column} IS NOT NULL")
            out["index_seconds"] = time.monotonic() - t0
            one_pass("B (0007: with the 2 indexes on job_run_dlq)", 2 * args.purge_days, args.purge_seconds)
            sent = feeder.stop()
            procs.wait(lambda: db.value(finished) >= sent, 300, poll=0.5)
    finally:
        feeder.halt.set()
        dispose_engines()
        reset_settings()
    out["after"] = after = sizes(url)
    times = [(parts[0], float(parts[1]), float(parts[2])) for path in folder.glob("*.txt")
             for line in path.read_text().splitlines() if len(parts := line.split()) == 3]
    shutil.rmtree(folder, ignore_errors=True)
    out["base"] = window_stats(url, base, times)
    for p in out["passes"]:
        p.window = window_stats(url, p.window, times)
    deleted = {t: sum(p.deleted.get(t, 0) for p in out["passes"]) for t in TABLES}

    log(f"waiting up to {args.autovacuum_wait:.0f} s for autovacuum ...")
    deadline = time.monotonic() + args.autovacuum_wait
    while time.monotonic() < deadline and not all(
            sizes(url)[t]["autovacuums"] > after[t]["autovacuums"] for t in TABLES if deleted.get(t)):
        time.sleep(5)
    now_sizes, out["how"], out["vacuum_seconds"] = sizes(url), {}, 0.0
    with h.connect(url) as conn:
        for t in TABLES:
            if now_sizes[t]["autovacuums"] > after[t]["autovacuums"]:
                out["how"][t] = "autovacuum"
            elif deleted.get(t):
                t0 = time.monotonic()
                conn.execute(f"VACUUM {t}")
                took = time.monotonic() - t0
                out["vacuum_seconds"] += took
                out["how"][t] = f"explicit VACUUM, {took:.0f} s"
            else:
                out["how"][t] = "nothing deleted"
        conn.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")  # heap free space, reading only pages not all-visible
        out["free"] = {t: float(conn.execute("SELECT approx_free_percent FROM pgstattuple_approx(%s::regclass)",
                                             (t,)).fetchone()[0]) for t in TABLES}  # type: ignore[index]
    out["vacuumed"] = sizes(url)
    return out


# --- the report ----------------------------------------------------------------------------


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f}"


def _ms(x: float) -> str:
    return "—" if x != x else f"{x * 1000:.1f}"


def render(r: dict[str, Any], ld: Load, args: Any, *, command: str, started: str, machine: str) -> str:
    load_s = {k: v for k, v in ld.seconds.items() if not k.startswith("rows:")}
    lines = [
        f"Measured {started} on {machine} with `{command}`.", "",
        f"**Load**: {ld.runs:,} finished runs over {args.days} days — " + ", ".join(f"{ld.rows[t]:,} {t}" for t in TABLES)
        + f" — in {sum(load_s.values()) / 60:.1f} min (" + ", ".join(f"{k} {v:.0f} s" for k, v in load_s.items())
        + "; keys and indexes rebuilt from the migration's own definitions, catalogue compared equal).", "",
        "Server settings measured: " + ", ".join(f"`{s}`" for s in MEASURED)
        + "; everything else Postgres 15's defaults (autovacuum included: scale factor 0.2, cost limit 200).", "",
        f"Live load: 2 `celery worker` processes (`-c 1`), `retention.live` (2 steps) sent at {args.rate:.0f} runs/s. "
        "Statement latencies are the workers' own round trips (claim, each step write, settle), "
        "created→finished is `job_queue.finished_at - created_at` (the database's clock).", "",
        "| window | seconds | live runs created/s | finished/s | claim p50 / p99 ms | step write p50 / p99 ms "
        "| settle p50 / p99 ms | created→finished p50 / p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, w in [("no purge", r["base"])] + [(f"during purge {p.label}", p.window) for p in r["passes"]]:
        c, st, se = w["claim"], w["store_step"], w["settle_succeeded"]
        lines.append(f"| {name} | {w['seconds']:.0f} | {w['created'] / w['seconds']:.0f} "
                     f"| {w['finished'] / w['seconds']:.0f} | {_ms(c[1])} / {_ms(c[2])} "
                     f"| {_ms(st[1])} / {_ms(st[2])} | {_ms(se[1])} / {_ms(se[2])} "
                     f"| {_ms(w['e2e_p50'])} / {_ms(w['e2e_p99'])} |")
    lines += ["", "| purge | phase | rows deleted | seconds | rows/s | batches | batch p50 / max s |",
              "|---|---|---|---|---|---|---|"]
    for p in r["passes"]:
        ph = p.phases()
        for kind in ("runs", "dlq", "events"):
            if kind in ph:
                n, secs, times = ph[kind]
                lines.append(f"| {p.label} | {kind} | {n:,} | {secs:.1f} | {f'{n / secs:,.0f}' if secs > 0 else '—'} "
                             f"| {len(times)} | {statistics.median(times):.2f} / {max(times):.2f} |")
            else:
                lines.append(f"| {p.label} | {kind} | not reached | — | — | — | — |")
    lines.append("")
    for p in r["passes"]:
        d, sus = p.deleted, p.sustained
        lines.append(
            f"* **{p.label}**: cut at {p.older_than.total_seconds() / 86400:.2f} days ({p.selected:,} runs older); "
            f"{'finished' if p.complete else f'stopped after {p.seconds:.0f} s'}. Rows deleted (`n_tup_del`): "
            + ", ".join(f"{t} {d.get(t, 0):,}" for t in TABLES)
            + (f". Sustained **{sus:,.0f} runs/s** with their "
               f"{(d.get('job_step', 0) + d.get('job_run', 0)) / max(d.get('job_queue', 1), 1):.1f} child rows "
               f"and {d.get('job_event', 0) / max(d.get('job_queue', 1), 1):.2f} events each "
               f"(×{sus / 500:.2g} the 500 runs/s of the issue)." if sus else "."))
    lines += [f"* Between the two: `CREATE INDEX CONCURRENTLY` of the two indexes, {r['index_seconds']:.1f} s.",
              f"* The events pass's statement (purge's step 3: it reads all of `job_event`, no index on "
              f"`received_at`), one batch timed at this depth before the purges and rolled back: "
              f"**{r['sweep_seconds']:.1f} s**. Before this change purge ran it once per 1,000 events; it now runs once "
              "per purge, after the runs' batches took their events.", "",
              "| table | heap MB before / after purge / after vacuum | indexes MB | total MB "
              "| dead rows after purge | heap free after vacuum | vacuum |", "|---|---|---|---|---|---|---|"]
    for t in TABLES:
        b, a, v = r["before"][t], r["after"][t], r["vacuumed"][t]
        lines.append(f"| {t} | " + " | ".join(" / ".join(_mb(s[k]) for s in (b, a, v)) for k in ("heap", "indexes", "total"))
                     + f" | {a['dead']:,} | {r['free'].get(t, float('nan')):.1f} % | {r['how'][t]} |")
    if r["vacuum_seconds"]:
        lines += ["", f"Explicit VACUUMs took {r['vacuum_seconds']:.0f} s in all (no cost delay: a manual VACUUM's default)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = h.parser("bench.retention", __doc__)
    parser.add_argument("--runs", type=int, default=10_000_000)
    parser.add_argument("--days", type=int, default=60, help="finished_at spread over this many days")
    parser.add_argument("--rate", type=float, default=100.0, help="live runs sent per second")
    parser.add_argument("--warmup", type=float, default=20.0)
    parser.add_argument("--baseline", type=float, default=60.0, help="seconds of the window without purge")
    parser.add_argument("--purge-days", type=float, default=3.0,
                        help="purge A takes the oldest this many days, purge B the next as many")
    parser.add_argument("--schema-seconds", type=float, default=120.0,
                        help="stop purge A (before 0007: no DLQ link indexes) after this long")
    parser.add_argument("--purge-seconds", type=float, default=300.0,
                        help="stop purge B (with the two DLQ indexes) after this long")
    parser.add_argument("--batch-size", type=int, default=1000, help="purge's batch (its default: 1000)")
    parser.add_argument("--autovacuum-wait", type=float, default=90.0)
    args = parser.parse_args(argv)
    h.need("CELERY_BROKER_URL")
    need = args.runs * 1800 * 2  # ~1.2 KB a run on disk (measured at 200k), WAL and rebuilds: twice that
    if need > (free_disk := shutil.disk_usage(tempfile.gettempdir()).free) * 0.6:
        parser.error(f"{args.runs:,} runs need ~{need / 1e9:.0f} GB; {free_disk / 1e9:.0f} GB free")
    started, command = h.now(), h.command("bench.retention", argv)
    with h.private_postgres(*LOADING) as pg:
        with h.connect(pg.url()) as conn:
            conn.execute(f'CREATE DATABASE "{DB}"')
        url = pg.url(DB)
        from motir_celery.store.migrate import upgrade

        upgrade(url)
        log(f"loading {args.runs:,} runs ...")
        ld = load(url, args.runs, args.days)
        log(f"loaded: {ld.rows} {ld.seconds}")
        pg.settings = MEASURED
        pg.restart(down_for=0.5)
        machine = h.machine(url)
        block = render(live(url, ld, args), ld, args, command=command, started=started, machine=machine)
    h.write_block("bench.retention", block, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
