"""The ten chaos scenarios of issue 6, each a function of its size returning a ``Result``.

The test suite runs shortened versions (``tests/chaos/test_chaos_*.py``); the soak
(``python -m tests.chaos.soak``) runs every scenario at full size and writes
``docs/reliability.md``. A scenario starts its own broker (a private Redis, or a
private RabbitMQ node) and, for the Postgres restart, its own Postgres server, so
a fault never reaches another test session's services.

``Base`` is what a scenario is given: a migrated database with the ledger table
(the test session's, or the soak's own) and a folder for logs.
"""

from __future__ import annotations

import random
import re
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from sqlalchemy import text

from motir_celery.dev.private import PrivatePostgres, PrivateRabbit, PrivateRedis
from motir_celery.store.models import Base as Schema

from . import jobs as _jobs  # noqa: F401  (the event jobs, so send_event here fans out to them)
from .harness import (
    WORKSPACES,
    ChaosEnv,
    Cluster,
    Feeder,
    Injector,
    Result,
    check,
    create_database,
    freeze,
    kill_and_replace,
    reset_tables,
    wait_settled,
)

#: Runs per event of each chaos event name (tests/chaos/jobs.py).
SUBSCRIBERS = {"chaos.work": 2, "chaos.slow": 1, "chaos.poison": 1, "chaos.clock": 1, "chaos.echo": 1}


@dataclass
class Base:
    database_url: str
    workdir: Path


# tests/chaos/cron_jobs.py; not imported here (see its docstring).
TICK, TICK_SKIP = "chaos.tick", "chaos.tick-skip"


def _tick_slots(env: ChaosEnv) -> tuple[int, int, int]:
    """(runs of the catch-up tick job, runs for an instant that is not a whole second,
    seconds from its first slot to its last inclusive): a gap means a missed slot."""
    with env.engine().connect() as conn:
        row = conn.execute(text("""
            SELECT count(*) AS slots,
                   count(*) FILTER (WHERE scheduled_for <> date_trunc('second', scheduled_for)) AS unaligned,
                   coalesce(extract(epoch FROM max(scheduled_for) - min(scheduled_for))::int + 1, 0) AS span
            FROM job_queue WHERE job_id = :j"""), {"j": TICK}).one()
    return int(row.slots), int(row.unaligned), int(row.span)


def _redis(base: Base, name: str) -> PrivateRedis:
    return PrivateRedis(base.workdir / name / "redis").start()


def _env(base: Base, name: str, broker_url: str, database_url: str | None = None, **kw: Any) -> ChaosEnv:
    return ChaosEnv(database_url or base.database_url, broker_url, base.workdir / name, **kw)


def _start_workers(cluster: Cluster, n: int, **kw: Any) -> None:
    procs = [cluster.worker(wait=False, **kw) for _ in range(n)]
    cluster.wait_ready(procs)


def _feed_with_faults(feeder: Feeder, injectors: list[Injector], env: ChaosEnv, *, expected: int,
                      fault_window: float, settle_timeout: float) -> tuple[int, float]:
    """Run the feeder with faults until it is done and the fault window has passed (or every
    run is final); stop the faults; wait for every run to settle. Returns (faults, settle s)."""
    start = time.monotonic()
    if feeder.ident is None:
        feeder.start()
    for inj in injectors:
        inj.start()
    feeder.join()
    while time.monotonic() - start < fault_window:
        if wait_settled(env, expected_runs=expected, timeout=0.5) < 0.5:
            break
    faults = sum(inj.stop() for inj in injectors)
    settle = wait_settled(env, expected_runs=feeder.runs_created, timeout=settle_timeout)
    time.sleep(env.sweep_interval + 0.5)  # one more sweep period: a stuck lease would show now
    return faults, settle


def _log_numbers(cluster: Cluster, pattern: str) -> int:
    """Sum of the integers captured by ``pattern`` in every process log."""
    return sum(int(m) for p in cluster.procs for m in re.findall(pattern, p.output()))


def _sweeper_notes(cluster: Cluster) -> list[str]:
    requeued = _log_numbers(cluster, r"SweepReport\(requeued=(\d+)")
    failed = _log_numbers(cluster, r"SweepReport\(requeued=\d+, failed=(\d+)")
    republished = _log_numbers(cluster, r"republished=(\d+)\)")
    return [f"sweeper: {requeued} expired leases requeued, {failed} failed into the DLQ; {republished} "
            f"re-publishes of queued runs whose last message was older than MOTIR_REPUBLISH_AFTER "
            f"(lost with a broker, or still waiting behind the backlog: the claim refuses the spare copy)"]


def _feeder_notes(feeder: Feeder) -> list[str]:
    notes = [f"{feeder.accepted} events sent ({feeder.runs_created} runs)"]
    if feeder.send_errors:
        first = feeder.errors[0].splitlines()[0][:120] if feeder.errors else ""
        notes.append(f"send_event raised {feeder.send_errors} times while a service was down "
                     f"(retried with the same idempotency key; e.g. `{first}`)")
    return notes


def _feeder_problems(feeder: Feeder) -> list[str]:
    if feeder.raised_after_commit:
        return [f"send_event raised after committing for {feeder.raised_after_commit} events "
                f"(the caller was told they failed; the retry found them recorded)"]
    return []


def _work(steps: int = 3, sleep: float = 0.03) -> Callable[[int], dict[str, Any]]:
    return lambda i: {"i": i, "steps": steps, "sleep": sleep, "fail_once": i % 10 == 3}


# --- 1. SIGKILL ---------------------------------------------------------------------


def sigkill(base: Base, *, runs: int = 1000, workers: int = 3, rate: float = 20.0,
            kill_every: tuple[float, float] = (2.0, 4.0), fault_window: float = 60.0,
            freeze_every: tuple[float, float] | None = None, steps: int = 3, step_sleep: float = 0.03) -> Result:
    """SIGKILL a random worker (main process and pool) every few seconds, restart it.
    With ``freeze_every``, also freeze a random worker (SIGSTOP) past its lease and thaw it."""
    name = "1-sigkill"
    reset_tables(base.database_url)
    redis = _redis(base, name)
    env = _env(base, name, redis.url)
    t0 = time.monotonic()
    try:
        with Cluster(env) as cluster:
            _start_workers(cluster, workers)
            feeder = Feeder(env, "chaos.work", runs // 2, rate, data=_work(steps, step_sleep))
            killer = Injector(kill_and_replace(cluster, signal.SIGKILL), kill_every, "sigkill")
            injectors = [killer]
            if freeze_every:
                injectors.append(Injector(freeze(cluster, env.lease + 2), freeze_every, "sigstop"))
            _, settle = _feed_with_faults(feeder, injectors, env, expected=runs, fault_window=fault_window,
                                          settle_timeout=120)
            c = check(env, subscribers=SUBSCRIBERS, expected_runs=runs)
            faults = f"{len(killer.done)} SIGKILL" + (f", {len(injectors[1].done)} SIGSTOP+SIGCONT (frozen "
                                                      f"{env.lease + 2:.0f} s)" if freeze_every else "")
            notes = _feeder_notes(feeder) + _sweeper_notes(cluster) + [
                f"{workers} workers x concurrency 2; settled {settle:.0f} s after the last fault"]
    finally:
        redis.close()
    return Result.from_check("1", "SIGKILL a random worker every few seconds" + (
        " (+ frozen workers)" if freeze_every else ""), c, faults,
                             time.monotonic() - t0, notes, _feeder_problems(feeder))


# --- 2. SIGTERM + time limits ---------------------------------------------------------


def sigterm(base: Base, *, runs: int = 400, slow: int = 40, workers: int = 3, rate: float = 10.0,
            term_every: tuple[float, float] = (4.0, 7.0), fault_window: float = 60.0) -> Result:
    """Warm shutdown (SIGTERM) of random workers mid-run; soft time limits firing inside
    steps; a few bodies ignore the soft limit and meet the hard one (pool process killed)."""
    name = "2-sigterm"
    reset_tables(base.database_url)
    redis = _redis(base, name)
    env = _env(base, name, redis.url)
    t0 = time.monotonic()
    try:
        with Cluster(env) as cluster:
            _start_workers(cluster, workers)
            feeder = Feeder(env, "chaos.work", runs // 2, rate, data=_work(3, 0.1))
            slow_feeder = Feeder(env, "chaos.slow", slow, max(slow / (runs / 2 / rate), 0.5),
                                 data=lambda i: {"long": 3.0, "stubborn": i % 4 == 0})
            slow_feeder.start()
            terminator = Injector(kill_and_replace(cluster, signal.SIGTERM), term_every, "sigterm")
            faults, settle = _feed_with_faults(feeder, [terminator], env, expected=runs + slow,
                                               fault_window=fault_window, settle_timeout=120)
            slow_feeder.join()
            settle += wait_settled(env, expected_runs=runs + slow, timeout=60)
            c = check(env, subscribers=SUBSCRIBERS, expected_runs=runs + slow)
            soft = _count_attempt_errors(env, "SoftTimeLimitExceeded")
            hard = cluster.logs("Hard time limit")
            warm = sum(1 for p in cluster.procs if p.kind == "worker" and not p.alive()
                       and p.popen.returncode == 0)
            notes = _feeder_notes(feeder) + _feeder_notes(slow_feeder) + _sweeper_notes(cluster) + [
                f"{faults} SIGTERM; {warm} workers completed a warm shutdown (exit 0)",
                f"soft time limit fired in {soft} attempts (retried); hard time limit killed {hard} pool processes",
            ]
            problems = _feeder_problems(feeder)
            if soft == 0:
                problems.append("no soft time limit fired: the scenario did not exercise it")
    finally:
        redis.close()
    return Result.from_check("2", "SIGTERM (warm shutdown) + soft/hard time limits", c,
                             f"{faults} SIGTERM, {soft} soft + {hard} hard time limits",
                             time.monotonic() - t0, notes, problems)


def _count_attempt_errors(env: ChaosEnv, kind: str) -> int:
    with env.engine().connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM job_run WHERE error ->> 'type' LIKE :k"),
                                {"k": f"%{kind}%"}).scalar_one())


# --- 3. broker restarts ---------------------------------------------------------------


def broker_restart(base: Base, *, broker: str = "redis", runs: int = 600, workers: int = 3, rate: float = 15.0,
                   restarts: int = 2, down_for: float = 2.0) -> Result:
    """Restart the broker mid-workload. Redis keeps nothing on disk: every queued and
    unacknowledged message is gone, and the sweeper must re-publish those runs.
    RabbitMQ (a private node): stop_app / start_app, connections drop, workers reconnect."""
    name = f"3-{broker}-restart"
    reset_tables(base.database_url)
    service: PrivateRedis | PrivateRabbit
    service = _redis(base, name) if broker == "redis" else PrivateRabbit().start()
    env = _env(base, name, service.url)
    t0 = time.monotonic()
    events = runs // 2
    try:
        with Cluster(env) as cluster:
            _start_workers(cluster, workers)
            feeder = Feeder(env, "chaos.work", events, rate, data=_work(3, 0.05))
            feeder.start()
            done = 0
            crashed: list[str] = []
            for k in range(restarts):
                # Restart at evenly spaced points of the feed: messages are queued and in flight.
                target = events * (k + 1) / (restarts + 1)
                while feeder.accepted < target and feeder.is_alive():
                    time.sleep(0.05)
                service.restart(down_for=down_for)
                done += 1
                time.sleep(1)
                crashed += cluster.supervise()
            feeder.join()
            crashed += cluster.supervise()
            faults, settle = _feed_with_faults(feeder, [], env, expected=runs, fault_window=0, settle_timeout=150)
            crashed += cluster.supervise()
            c = check(env, subscribers=SUBSCRIBERS, expected_runs=runs)
            notes = _feeder_notes(feeder) + _sweeper_notes(cluster) + [
                f"broker down {down_for:.0f} s each time; all runs final {settle:.0f} s after the feed ended"]
            if crashed:
                # Celery/kombu's reconnection, not the engine: counted and shown, and the worker is
                # replaced as a supervisor would; its runs are reclaimed by the others meanwhile.
                notes.append(f"{len(crashed)} worker process(es) died in the broker client while reconnecting "
                             f"and were restarted as a supervisor would ({'; '.join(crashed)})")
            problems = _feeder_problems(feeder)
    finally:
        service.close()
    label = "Redis (no persistence)" if broker == "redis" else "RabbitMQ (stop_app/start_app)"
    return Result.from_check("3a" if broker == "redis" else "3b", f"restart {label} mid-workload", c,
                             f"{done} {broker} restarts",
                             time.monotonic() - t0, notes, problems)


# --- 4. Postgres restart ----------------------------------------------------------------


def postgres_restart(base: Base, *, runs: int = 600, workers: int = 3, rate: float = 15.0,
                     modes: tuple[str, ...] = ("fast", "immediate"), down_for: float = 3.0) -> Result:
    """Restart a private Postgres mid-workload (a fast shutdown, then a crash-like
    immediate one): workers, a beat (per-second catch-up job) and the sweeper reconnect;
    nothing half-settled, no cron slot missed."""
    name = "4-postgres-restart"
    pg = PrivatePostgres().init()
    redis = _redis(base, name)
    t0 = time.monotonic()
    events = runs // 2
    try:
        url = create_database(pg.url(), "chaos")
        env = _env(base, name, redis.url, database_url=url, imports="tests.chaos.jobs,tests.chaos.cron_jobs")
        with Cluster(env) as cluster:
            _start_workers(cluster, workers)
            beat = cluster.beat()
            feeder = Feeder(env, "chaos.work", events, rate, data=_work(3, 0.05))
            feeder.start()
            for k, mode in enumerate(modes):
                target = events * (k + 1) / (len(modes) + 1)
                while feeder.accepted < target and feeder.is_alive():
                    time.sleep(0.05)
                pg.restart(down_for=down_for, mode=mode)
            feeder.join()
            time.sleep(6)  # the beat's retry period after a failed pass (5 s), then one more pass
            cluster.stop(beat)
            _, settle = _feed_with_faults(feeder, [], env, expected=runs, fault_window=0, settle_timeout=180)
            c = check(env, subscribers=SUBSCRIBERS, expected_runs=runs)
            slots, unaligned, span = _tick_slots(env)
            problems = _feeder_problems(feeder)
            if span - slots or unaligned:
                c.lost += span - slots
                problems.append(f"{TICK}: {span - slots} slots missed, {unaligned} unaligned, over {span} s")
            notes = _feeder_notes(feeder) + _sweeper_notes(cluster) + [
                f"restarts: {', '.join(modes)} shutdown, {down_for:.0f} s down each; "
                f"all runs final {settle:.0f} s after the feed ended",
                f"a beat ran throughout: {TICK} has {slots} slots over {span} s, none missed, one run each"]
            if feeder.raised_after_commit:
                # Not the broker bug of scenario 3: here the database went away between committing
                # and answering COMMIT. No client can know; the idempotency key is the answer.
                problems = [p for p in problems if not p.startswith("send_event raised after committing")]
                notes.append(f"{feeder.raised_after_commit} sends lost their COMMIT reply to the restart; "
                             f"the retry with the same idempotency key found them recorded, once")
            dead = [p.name for p in cluster.procs if p.kind == "worker" and not p.alive()]
            if dead:
                problems.append(f"workers exited instead of reconnecting: {dead}")
        from motir_celery.store.db import dispose_engines

        dispose_engines()
    finally:
        redis.close()
        pg.close()
    return Result.from_check("4", "restart Postgres mid-workload", c,
                             f"{pg.restarts} Postgres restarts ({'+'.join(modes)})",
                             time.monotonic() - t0, notes, problems)


# --- 5. duplicates and redelivery ---------------------------------------------------


def duplicates(base: Base, *, runs: int = 400, long_every: int = 10, workers: int = 3, rate: float = 15.0,
               copies: int = 3, visibility_timeout: float = 2.0, kill_at: float = 0.5) -> Result:
    """Every message published ``copies`` times; Redis's visibility timeout set to 2 s so a
    message held longer (long steps) is redelivered to another worker while it runs; one
    worker SIGKILLed half-way so its unacknowledged messages come back the same way."""
    name = "5-duplicates"
    reset_tables(base.database_url)
    redis = _redis(base, name)
    env = _env(base, name, redis.url, extra_env={"CHAOS_VISIBILITY_TIMEOUT": str(visibility_timeout)})
    t0 = time.monotonic()
    events = runs // 2
    try:
        with Cluster(env, app="tests.chaos.app") as cluster:
            _start_workers(cluster, workers)
            feeder = Feeder(env, "chaos.work", events, rate, copies=copies,
                            data=lambda i: ({"i": i, "steps": 2, "sleep": 2.0} if i % long_every == 0
                                            else {"i": i, "steps": 3, "sleep": 0.03}))
            feeder.start()
            while feeder.accepted < events * kill_at and feeder.is_alive():
                time.sleep(0.05)
            kill_and_replace(cluster, signal.SIGKILL)()
            _, settle = _feed_with_faults(feeder, [], env, expected=runs, fault_window=0, settle_timeout=120)
            time.sleep(visibility_timeout + 1)  # late redeliveries arrive, and must be refused
            c = check(env, subscribers=SUBSCRIBERS, expected_runs=runs)
            received = cluster.logs("] received")
            with env.engine().connect() as conn:
                attempts = conn.execute(text("SELECT count(*) FROM job_run")).scalar_one()
            notes = _feeder_notes(feeder) + _sweeper_notes(cluster) + [
                f"{received} deliveries for {attempts} attempts of {c.runs} runs: "
                f"{received - attempts} duplicate or stale deliveries, each refused by the claim",
                f"every message published {copies}x; visibility timeout {visibility_timeout:.0f} s; "
                f"every {long_every}th event holds its message ~4 s"]
            problems = _feeder_problems(feeder)
            if received <= attempts + (copies - 1) * events // 2:
                problems.append("fewer duplicate deliveries than published: the scenario did not duplicate")
    finally:
        redis.close()
    return Result.from_check("5", f"every message {copies}x + visibility-timeout redelivery", c,
                             f"{(copies - 1) * feeder.runs_created} duplicate publishes, "
                             f"{max(received - attempts - (copies - 1) * feeder.runs_created, 0)} redeliveries, 1 SIGKILL",
                             time.monotonic() - t0, notes, problems)


# --- 6. three beats -------------------------------------------------------------------


def three_beats(base: Base, *, seconds: float = 120.0, beats: int = 3, workers: int = 2,
                kill_beat_at: float = 0.5) -> Result:
    """Three ``celery beat`` processes on a per-second schedule; one is SIGKILLed half-way
    and restarted. Exactly one run per (job, slot), and no slot of the catch-up job missed."""
    name = "6-three-beats"
    reset_tables(base.database_url)
    redis = _redis(base, name)
    env = _env(base, name, redis.url, imports="tests.chaos.jobs,tests.chaos.cron_jobs")
    t0 = time.monotonic()
    problems: list[str] = []
    try:
        with Cluster(env) as cluster:
            _start_workers(cluster, workers)
            procs = [cluster.beat(wait=False) for _ in range(beats)]
            cluster.wait_ready(procs)
            started = time.monotonic()
            time.sleep(seconds * kill_beat_at)
            victim = random.choice(procs)
            victim.signal(signal.SIGKILL)
            victim.wait(10)
            time.sleep(1.5)
            cluster.beat()
            time.sleep(max(seconds - (time.monotonic() - started), 0))
            for p in cluster.alive("beat", ready=False):
                cluster.stop(p, signal.SIGTERM)
            wait_settled(env, expected_runs=None, timeout=60)
            time.sleep(env.sweep_interval + 1.5)
            c = check(env)
            slots, unaligned, span = _tick_slots(env)
            with env.engine().connect() as conn:
                skip = conn.execute(text("""
                    SELECT count(*) AS slots, count(*) FILTER (WHERE state = 'cancelled') AS skipped,
                           count(*) FILTER (WHERE state = 'succeeded') AS ran
                    FROM job_queue WHERE job_id = :j"""), {"j": TICK_SKIP}).one()
                overlapping = conn.execute(text("""
                    SELECT count(*) FROM job_run a JOIN job_run b
                      ON a.job_id = b.job_id AND a.run_id < b.run_id
                    WHERE a.job_id = :j
                      AND tstzrange(a.started_at, coalesce(a.finished_at, now()))
                       && tstzrange(b.started_at, coalesce(b.finished_at, now()))"""), {"j": TICK_SKIP}).scalar_one()
                attempts_per_slot = conn.execute(text(
                    "SELECT count(*) FROM job_queue WHERE job_id = :j AND attempts > 1"), {"j": TICK}).scalar_one()
            missed = span - slots
            if missed:
                c.lost += missed
                problems.append(f"{missed} slots of {TICK} (catch-up 30 s) have no run between its first and last")
            if unaligned:
                problems.append(f"{unaligned} runs of {TICK} for an instant that is not a slot")
            if overlapping:
                problems.append(f"{overlapping} pairs of overlap='skip' runs ran at the same time")
            queued_logs = cluster.logs("motir: queued chaos.")
            notes = [
                f"{beats} beats for {seconds:.0f} s (+1 restarted after a SIGKILL), {workers} workers",
                f"{TICK}: {slots} slots over {span} s, one run each; beats logged {queued_logs} 'queued' "
                f"answers in total (the rest of their inserts were AlreadyQueued); {attempts_per_slot} runs retried",
                f"{TICK_SKIP} (overlap='skip', ~1.5 s per run): {skip.slots} slots = {skip.ran} runs + "
                f"{skip.skipped} skipped (cancelled rows); 0 overlapping runs" if not overlapping else "",
            ]
    finally:
        redis.close()
    return Result.from_check("6", f"{beats} beats on a per-second schedule", c,
                             f"{beats} concurrent beats, 1 beat SIGKILL", time.monotonic() - t0,
                             [n for n in notes if n], problems)


# --- 7. poison ------------------------------------------------------------------------


def poison(base: Base, *, poisons: int = 5, runs: int = 300, workers: int = 2, rate: float = 15.0) -> Result:
    """A job that SIGKILLs its worker process on every attempt, among healthy runs."""
    name = "7-poison"
    reset_tables(base.database_url)
    redis = _redis(base, name)
    env = _env(base, name, redis.url, lease=2.0, sweep_interval=0.5)
    t0 = time.monotonic()
    try:
        with Cluster(env) as cluster:
            _start_workers(cluster, workers)
            poison_feeder = Feeder(env, "chaos.poison", poisons, 2.0)
            feeder = Feeder(env, "chaos.work", runs // 2, rate, data=_work())
            poison_feeder.start()
            _, settle = _feed_with_faults(feeder, [], env, expected=runs + poisons, fault_window=0,
                                          settle_timeout=120)
            poison_feeder.join()
            c = check(env, subscribers=SUBSCRIBERS, expected_runs=runs + poisons)
            with env.engine().connect() as conn:
                rows = conn.execute(text("""
                    SELECT q.state, q.attempts, q.max_attempts, d.failure ->> 'type' AS failure,
                           (SELECT count(*) FROM test.side_effect x WHERE x.run_id = q.id::text AND x.step = 'die') AS dies,
                           (SELECT count(*) FROM test.side_effect x WHERE x.run_id = q.id::text AND x.step = 'ok') AS oks
                    FROM job_queue q LEFT JOIN job_run_dlq d ON d.run_id = q.id
                    WHERE q.job_id = 'chaos.poison'""")).all()
                healthy_failed = conn.execute(text(
                    "SELECT count(*) FROM job_queue WHERE job_id <> 'chaos.poison' AND state <> 'succeeded'")).scalar_one()
            problems = _feeder_problems(feeder)
            for r in rows:
                if r.state != "failed" or r.failure != "LeaseExpired" or r.dies != r.max_attempts or r.oks != 1:
                    problems.append(f"poison run: state={r.state} attempts={r.attempts}/{r.max_attempts} "
                                    f"failure={r.failure} die-executions={r.dies} ok-executions={r.oks}")
            if healthy_failed:
                problems.append(f"{healthy_failed} healthy runs did not succeed")
            killed = sum(r.dies for r in rows)  # each 'die' execution SIGKILLed its pool process
            notes = _feeder_notes(feeder) + _sweeper_notes(cluster) + [
                f"{len(rows)} poison runs: each killed its pool process {rows[0].max_attempts if rows else '?'} times, "
                f"then failed into the DLQ (LeaseExpired); step 'ok' ran once each (memoized across attempts)",
                f"{killed} pool processes killed in total; {runs} healthy runs all succeeded"
                if not healthy_failed else ""]
    finally:
        redis.close()
    return Result.from_check("7", "poison job (kills its worker process every attempt)", c,
                             f"{killed} pool processes SIGKILLed by {poisons} poison runs",
                             time.monotonic() - t0, [n for n in notes if n], problems)


# --- 8. clock ----------------------------------------------------------------------------


ZONES = ("America/Los_Angeles", "Asia/Kolkata", "Pacific/Chatham")
SESSION_ZONE = "America/St_Johns"


def clock(base: Base, *, runs: int = 200, workers: int = 3, rate: float = 10.0, delay: float = 1.5,
          kill_every: tuple[float, float] = (3.0, 5.0), fault_window: float = 30.0) -> Result:
    """Workers in three process time zones (TZ), every session in a fourth (TimeZone via the
    connection's options): backoffs (RetryAfterError) and lease expiry must be measured on the
    database's clock alone — attempt n+1 never starts before attempt n's end + delay, and a
    lease is never reclaimed before it expired."""
    name = "8-clock"
    reset_tables(base.database_url)
    redis = _redis(base, name)
    sep = "&" if "?" in base.database_url else "?"
    url = f"{base.database_url}{sep}options=-c%20TimeZone%3D{SESSION_ZONE.replace('/', '%2F')}"
    env = _env(base, name, redis.url, database_url=url, extra_env={"PGTZ": SESSION_ZONE})
    t0 = time.monotonic()
    problems: list[str] = []
    try:
        with Cluster(env) as cluster:
            procs = [cluster.worker(wait=False, env={"TZ": zone}) for zone in ZONES[:workers]]
            cluster.wait_ready(procs)
            cluster.worker_defaults["env"] = {"TZ": ZONES[1]}  # replacements after a kill
            feeder = Feeder(env, "chaos.clock", runs, rate,
                            data=lambda i: {"delay": delay, "sleep": 4.0 if i % 5 == 0 else 0.0})
            killer = Injector(kill_and_replace(cluster, signal.SIGKILL), kill_every, "sigkill")
            faults, settle = _feed_with_faults(feeder, [killer], env, expected=runs, fault_window=fault_window,
                                               settle_timeout=120)
            c = check(env, subscribers=SUBSCRIBERS, expected_runs=runs)
            with env.engine().connect() as conn:
                zone = conn.execute(text("SHOW TimeZone")).scalar_one()
                early = conn.execute(text("""
                    SELECT count(*) FROM job_run a JOIN job_run b ON b.run_id = a.run_id AND b.attempt = a.attempt + 1
                    WHERE a.outcome = 'retrying' AND a.error ->> 'type' LIKE '%RetryAfterError'
                      AND b.started_at < a.finished_at + make_interval(secs => :d)"""), {"d": delay}).scalar_one()
                retried = conn.execute(text(
                    "SELECT count(*) FROM job_run WHERE outcome = 'retrying'")).scalar_one()
                premature = conn.execute(text("""
                    SELECT count(*) FROM job_run WHERE outcome = 'lost'
                      AND finished_at < started_at + make_interval(secs => :lease)"""),
                    {"lease": env.lease}).scalar_one()
                lost_attempts = conn.execute(text("SELECT count(*) FROM job_run WHERE outcome = 'lost'")).scalar_one()
                future = conn.execute(text("""
                    SELECT count(*) FROM job_run WHERE started_at > now() OR finished_at > now()""")).scalar_one()
                zones_seen = sorted(z for (z,) in conn.execute(text(
                    "SELECT DISTINCT result ->> 'tz' FROM job_queue WHERE state = 'succeeded'")).all())
            if zone != SESSION_ZONE:
                problems.append(f"the session TimeZone was {zone}, not {SESSION_ZONE}: the scenario proves nothing")
            if early:
                problems.append(f"{early} retries started before their RetryAfterError delay had passed (DB clock)")
            if premature:
                problems.append(f"{premature} leases reclaimed before they expired")
            if future:
                problems.append(f"{future} attempts stamped in the database's future")
            if len(zones_seen) < 2:
                problems.append(f"runs finished under zones {zones_seen} only")
            notes = _feeder_notes(feeder) + [
                f"worker TZ {', '.join(ZONES)}; session TimeZone {zone}; runs finished under {zones_seen}",
                f"{retried} RetryAfterError({delay}s) retries, 0 started early; {lost_attempts} attempts lost to "
                f"SIGKILL, none reclaimed before its {env.lease:.0f} s lease expired" if not (early or premature) else ""]
    finally:
        redis.close()
    return Result.from_check("8", "clock: workers in 3 TZs, session TimeZone non-UTC", c,
                             f"{faults} SIGKILL, 3 process zones + 1 session zone", time.monotonic() - t0,
                             [n for n in notes if n], problems)


# --- 9. bad input -------------------------------------------------------------------------


SQL_NASTY = "x'); DROP TABLE job_queue; --\\\"%_$1"


def bad_input(base: Base, *, runs: int = 200, workers: int = 2, rate: float = 20.0) -> Result:
    """Garbage at every entry point while a healthy workload runs. Each must get a clear
    error (raised before anything is written) or a logged drop; nothing else disturbed."""
    import kombu

    from motir_celery.errors import PayloadError, WorkspaceError
    from motir_celery.store.db import workspace_session

    name = "9-bad-input"
    reset_tables(base.database_url)
    redis = _redis(base, name)
    env = _env(base, name, redis.url)
    limit = env.settings().max_payload_bytes
    t0 = time.monotonic()
    cases: list[str] = []
    problems: list[str] = []

    def expect_error(label: str, exc_types: tuple[type[BaseException], ...], fn: Callable[[], Any],
                     must_mention: str = "") -> None:
        try:
            fn()
        except exc_types as exc:
            if must_mention and must_mention not in str(exc):
                problems.append(f"{label}: error does not say why: {exc}")
            else:
                cases.append(f"{label} -> {type(exc).__name__}")
            return
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{label}: unexpected {type(exc).__name__}: {exc}")
            return
        problems.append(f"{label}: accepted")

    try:
        with Cluster(env) as cluster:
            _start_workers(cluster, workers)
            pids = sorted(p.pid for p in cluster.alive("worker"))
            settings = env.settings()
            sender = env.publishing()  # an engine of our own on the scenario's broker
            feeder = Feeder(env, "chaos.work", runs // 2, rate, data=_work())
            feeder.start()
            with env.engine().connect() as conn:
                before = conn.execute(text("SELECT count(*) FROM job_event WHERE name <> 'chaos.work'")).scalar_one()

            def send(name_: Any, data: Any, **kw: Any) -> Any:
                return sender.send_event(name_, data, **kw)

            # non-JSON and oversized payloads: refused before anything is written
            expect_error("data = a set", (PayloadError,), lambda: send("chaos.echo", {"s": {1, 2}}), "not JSON")
            expect_error("data = NaN", (PayloadError,), lambda: send("chaos.echo", {"x": float("nan")}), "not JSON")
            expect_error("data = bytes", (PayloadError,), lambda: send("chaos.echo", b"\x00\xff"), "not JSON")
            expect_error("data with a NUL character", (PayloadError,), lambda: send("chaos.echo", {"x": "a\x00b"}))
            expect_error(f"data over MOTIR_MAX_PAYLOAD_BYTES ({limit})", (PayloadError,),
                         lambda: send("chaos.echo", {"x": "y" * (limit + 1)}), "limit")
            # bad event names
            for bad in ("", "   ", None, 42, "n" * 201):
                expect_error(f"event name {bad!r:.20}", (PayloadError,), lambda b=bad: send(b, {}))
            # invalid workspace ids
            for ws in ("", " padded", "tab\there", "nul\x00", "w" * 201, 123, ["a"]):
                expect_error(f"workspace_id {ws!r:.20}", (WorkspaceError,),
                             lambda w=ws: send("chaos.echo", {}, workspace_id=w))
                expect_error(f"workspace_session({ws!r:.20})", (WorkspaceError,),
                             lambda w=ws: workspace_session(w, settings=settings).__enter__())
            expect_error("idempotency_key = ''", (PayloadError,), lambda: send("chaos.echo", {}, idempotency_key=""))
            with env.engine().connect() as conn:
                after = conn.execute(text("SELECT count(*) FROM job_event WHERE name <> 'chaos.work'")).scalar_one()
            if after != before:
                problems.append(f"refused sends wrote {after - before} events")

            # an unknown event name is recorded with no run (an event log entry, not an error)
            r = send("chaos.nobody-listens", {"x": 1})
            cases.append(f"unknown event name -> recorded, {len(r.runs)} runs")
            if r.runs:
                problems.append("an event nobody subscribes to made runs")

            # SQL metacharacters in every string field: stored verbatim, nothing executed
            nasty = send("chaos.echo", {SQL_NASTY: SQL_NASTY, "steps": [SQL_NASTY.replace(":", ""), "ok"],
                                        "value": SQL_NASTY},
                         workspace_id=SQL_NASTY, idempotency_key=SQL_NASTY)
            (nasty_run,) = nasty.run_ids
            # a step output over the limit: StepOutputError -> the run fails into the DLQ, clearly
            (big_run,) = send("chaos.echo", {"steps": ["ok"], "output_bytes": limit + 10}).run_ids

            # raw messages a worker must drop, with a log line, and carry on
            app_conn = kombu.Connection(env.broker_url)
            producer = app_conn.Producer()
            q = kombu.Queue(env.queue, routing_key=env.queue)
            raw = [
                ("non-JSON message body", b"\x80\x81 not json {", "application/json", None),
                ("JSON that is not a task", b'{"hello": "world"}', "application/json", None),
            ]
            for label, body, ctype, headers in raw:
                producer.publish(body, routing_key=env.queue, content_type=ctype, content_encoding="binary",
                                 declare=[q], headers=headers or {})
                cases.append(f"{label} -> moved to {env.queue}.malformed by the worker (logged)")
            from motir_celery.adapter.celery_app import create_app

            app = create_app(settings)
            forged = [
                ("unknown job id (task name)", "motir.chaos.no-such-job", [str(uuid.uuid4())]),
                ("forged run id (a random UUID)", "motir.chaos.work", [str(uuid.uuid4())]),
                ("malformed run id", "motir.chaos.work", ["'; DROP TABLE job_queue; --"]),
                ("run id of another job's run", "motir.chaos.audit", [str(nasty_run)]),
                ("run id of a finished run", "motir.chaos.echo", [str(nasty_run)]),
                ("no arguments", "motir.chaos.work", []),
                ("a dict as the run id", "motir.chaos.work", [{"id": 1}]),
                ("a huge argument", "motir.chaos.work", ["z" * (2 * limit)]),
            ]
            for label, task, args in forged:
                app.send_task(task, args=args)
                cases.append(f"{label} -> logged drop")
            # replay audit with metacharacters in the actor
            time.sleep(2)
            wait_settled(env, expected_runs=None, timeout=60)
            with env.engine().connect() as conn:
                dlq_id = conn.execute(text("SELECT id FROM job_run_dlq WHERE run_id = :r"), {"r": big_run}).scalar()
                failure = conn.execute(text("SELECT failure ->> 'message' FROM job_run_dlq WHERE run_id = :r"),
                                       {"r": big_run}).scalar()
            if dlq_id is None or not failure or "limit" not in failure:
                problems.append(f"oversized step output: DLQ row {dlq_id}, failure {failure!r}")
            else:
                cases.append("step output over the limit -> run failed into the DLQ with StepOutputError")
                replay = sender.replay_dlq(dlq_id, actor=SQL_NASTY)
                if replay.status != "replayed":
                    problems.append(f"replay with a nasty actor: {replay.status}")

            feeder.join()
            wait_settled(env, expected_runs=None, timeout=90)
            # what the nasty event stored must be exactly what was sent
            with env.engine().connect() as conn:
                ev = conn.execute(text("SELECT name, data, workspace_id, idempotency_key FROM job_event "
                                       "WHERE idempotency_key = :k"), {"k": SQL_NASTY}).one()
                steps = sorted(conn.execute(text("SELECT step_id FROM job_step WHERE run_id = :r"),
                                            {"r": nasty_run}).scalars())
                state = conn.execute(text("SELECT state FROM job_queue WHERE id = :r"), {"r": nasty_run}).scalar_one()
                tables = conn.execute(text("SELECT count(*) FROM pg_tables WHERE tablename = ANY(:t)"),
                                      {"t": list(Schema.metadata.tables)}).scalar_one()
            if (ev.data.get(SQL_NASTY) != SQL_NASTY or ev.workspace_id != SQL_NASTY
                    or ev.idempotency_key != SQL_NASTY or state != "succeeded"
                    or steps != sorted([SQL_NASTY.replace(":", ""), "ok"]) or tables != len(Schema.metadata.tables)):
                problems.append(f"SQL metacharacters: event {ev}, steps {steps}, state {state}, {tables} tables")
            else:
                cases.append("SQL metacharacters in name/data/workspace/key/step ids/actor -> stored verbatim")
            with workspace_session(SQL_NASTY, settings=settings) as s:
                own = s.execute(text("SELECT count(*) FROM job_queue")).scalar_one()
            if own != 1:
                problems.append(f"the reader of the nasty workspace sees {own} runs, not its 1")
            time.sleep(1)
            # The two raw messages (a non-JSON body, JSON that is not a task) are moved aside to
            # <queue>.malformed by the worker's guard (adapter/guard.py), one ERROR line each.
            logs = {
                "non-JSON body and not-a-task": (cluster.logs("a malformed message on queue"), 2),
                "unknown task": (cluster.logs("Received unregistered task"), 1),
                "malformed run id": (cluster.logs("malformed run id"), 1),
            }
            for label, (n, least) in logs.items():
                if n < least:
                    problems.append(f"no log line for the dropped {label} ({n} of {least})")
            longest = max((len(line) for p in cluster.procs for line in p.output().splitlines()), default=0)
            if longest > 20_000:
                problems.append(f"a bad input was echoed into a worker log in full ({longest} characters on one line)")
            if sorted(p.pid for p in cluster.alive("worker")) != pids or cluster.logs("exited with 'signal"):
                problems.append("a worker process died or was replaced")
            c = check(env, subscribers=SUBSCRIBERS, tenancy=True)
            # the nasty workspace is not one of WORKSPACES: its event counts as cross-tenant nowhere
            notes = [f"{len(cases)} bad inputs, each refused or dropped: " + "; ".join(cases),
                     f"{feeder.runs_created} healthy runs alongside, all succeeded; the workers never restarted"]
    finally:
        redis.close()
    return Result.from_check("9", "bad input at every entry point", c, f"{len(cases)} bad inputs",
                             time.monotonic() - t0, notes, problems)


# --- 10. tenancy under load ----------------------------------------------------------------


def tenancy(base: Base, *, runs: int = 600, readers: int = 3, workers: int = 3, rate: float = 20.0,
            kill_every: tuple[float, float] = (4.0, 7.0)) -> Result:
    """App-role readers of workspace A poll every table (workspace_session, RLS enforced)
    while B's runs churn on the same connection pools, under SIGKILLs."""
    from motir_celery.store.db import workspace_session

    name = "10-tenancy"
    reset_tables(base.database_url)
    redis = _redis(base, name)
    env = _env(base, name, redis.url)
    t0 = time.monotonic()
    stop = threading.Event()
    seen = {"polls": 0, "foreign": 0, "own": 0, "system_visible": 0, "errors": 0}
    lock = threading.Lock()
    settings = env.settings()

    def reader(ws: str | None) -> None:
        while not stop.is_set():
            try:
                with workspace_session(ws, settings=settings) as s:
                    foreign = own = 0
                    for table in ("job_event", "job_queue", "job_step", "job_run", "job_run_dlq"):
                        row = s.execute(text(
                            f"SELECT count(*) FILTER (WHERE workspace_id IS DISTINCT FROM CAST(:ws AS text) "
                            f"OR CAST(:ws AS text) IS NULL) AS foreign_, "
                            f"count(*) FILTER (WHERE workspace_id = :ws) AS own FROM {table}"), {"ws": ws}).one()
                        foreign, own = foreign + row.foreign_, own + row.own
                    # asking for B by name must not help either
                    foreign += s.execute(text("SELECT count(*) FROM job_queue WHERE workspace_id = 'ws-b'")).scalar_one()
                with lock:
                    seen["polls"] += 1
                    seen["foreign"] += foreign
                    seen["own"] += own
                time.sleep(0.01)  # leave the 2 cores to the workers too
            except Exception:  # noqa: BLE001
                with lock:
                    seen["errors"] += 1
                time.sleep(0.1)

    try:
        with Cluster(env) as cluster:
            _start_workers(cluster, workers)
            b_feeder = Feeder(env, "chaos.work", runs // 2 * 9 // 10, rate, data=_work(3, 0.02),
                              workspace=lambda i: "ws-b")
            a_feeder = Feeder(env, "chaos.work", runs // 2 // 10, rate / 9, data=_work(3, 0.02),
                              workspace=lambda i: "ws-a")
            threads = [threading.Thread(target=reader, args=("ws-a",), daemon=True) for _ in range(readers)]
            threads.append(threading.Thread(target=reader, args=(None,), daemon=True))  # no workspace: sees nothing
            for t in threads:
                t.start()
            a_feeder.start()
            killer = Injector(kill_and_replace(cluster, signal.SIGKILL), kill_every, "sigkill")
            expected = (b_feeder.count + a_feeder.count) * 2
            faults, settle = _feed_with_faults(b_feeder, [killer], env, expected=expected, fault_window=0,
                                               settle_timeout=120)
            a_feeder.join()
            wait_settled(env, expected_runs=expected, timeout=60)
            stop.set()
            for t in threads:
                t.join(timeout=10)
            c = check(env, subscribers=SUBSCRIBERS, expected_runs=expected)
            c.cross_tenant += seen["foreign"]
            problems = _feeder_problems(b_feeder)
            if seen["own"] == 0:
                problems.append("the readers of ws-a never saw a row of their own: the check was vacuous")
            if seen["errors"]:
                problems.append(f"{seen['errors']} reader polls failed")
            notes = [f"{seen['polls']} polls by {readers} readers of ws-a (5 tables each) + 1 reader with no "
                     f"workspace, while {b_feeder.runs_created} ws-b runs churned: {seen['own']} own rows read, "
                     f"{seen['foreign']} rows of another workspace"] + _sweeper_notes(cluster)
    finally:
        stop.set()
        redis.close()
    return Result.from_check("10", "tenancy under load (readers of A while B churns)", c,
                             f"{faults} SIGKILL, {seen['polls']} app-role polls", time.monotonic() - t0,
                             notes, problems)


# --- 12. who goes next: admission on, across three workspaces ------------------------------


def fair_share(base: Base, *, runs: int = 600, workers: int = 3, rate: float = 20.0, copies: int = 2,
               kill_every: tuple[float, float] = (3.0, 5.0), fault_window: float = 40.0, limit: int = 10,
               cap: int = 2, restart_every: tuple[float, float] | None = None) -> Result:
    """Admission on (core/admission.py): the fleet's in-flight limit ``limit``, ws-a weight 3, ws-b
    weight 1, ws-c capped at ``cap``; every message published ``copies`` times, a random worker
    SIGKILLed every few seconds and, with ``restart_every``, Redis (no persistence: the messages in
    it are lost) restarted that often. Every invariant of the other scenarios holds, no run is left
    held, and ws-c never has more than ``cap`` runs running (sampled every 10 ms)."""
    name = "12-fair-share"
    reset_tables(base.database_url)
    redis = _redis(base, name)
    env = _env(base, name, redis.url)
    with env.engine().begin() as conn:
        conn.execute(text("TRUNCATE job_quota, job_admission"))
        conn.execute(text("INSERT INTO job_admission (name, max_in_flight) VALUES ('fleet', :n)"), {"n": limit})
        conn.execute(text("INSERT INTO job_quota (workspace_id, weight, max_running) "
                          "VALUES ('ws-a', 3, NULL), ('ws-b', 1, NULL), ('ws-c', 1, :cap)"), {"cap": cap})
    peak = {"ws-c": 0, "held": 0}
    stop = threading.Event()

    def sample() -> None:
        eng = env.engine()
        while not stop.is_set():
            with eng.connect() as conn:
                n, held_now = conn.execute(text(
                    "SELECT count(*) FILTER (WHERE workspace_id = 'ws-c' AND state = 'running'), "
                    "count(*) FILTER (WHERE dispatched_at = 'infinity' AND state = 'queued') "
                    "FROM job_queue WHERE state IN ('queued', 'running')")).one()
            peak["ws-c"] = max(peak["ws-c"], int(n))
            peak["held"] = max(peak["held"], int(held_now))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True, name="cap-sampler")
    t0 = time.monotonic()
    try:
        with Cluster(env) as cluster:
            _start_workers(cluster, workers)
            sampler.start()
            feeder = Feeder(env, "chaos.work", runs // 2, rate, copies=copies, data=_work())
            killer = Injector(kill_and_replace(cluster, signal.SIGKILL), kill_every, "sigkill")
            injectors = [killer]
            if restart_every:
                def restart() -> str:
                    redis.restart(down_for=2.0)
                    cluster.supervise()  # a worker that died in its broker client is replaced
                    return "redis restart"
                injectors.append(Injector(restart, restart_every, "redis"))
            _, settle = _feed_with_faults(feeder, injectors, env, expected=runs, fault_window=fault_window,
                                          settle_timeout=180)
            restarts = len(injectors[1].done) if restart_every else 0
            c = check(env, subscribers=SUBSCRIBERS, expected_runs=runs)
            with env.engine().connect() as conn:
                held = conn.execute(text("SELECT count(*) FROM job_queue WHERE dispatched_at = 'infinity'")).scalar_one()
            notes = _feeder_notes(feeder) + _sweeper_notes(cluster) + [
                f"admission on: at most {limit} in flight; ws-a weight 3, ws-b 1, ws-c capped at {cap} "
                f"(peak running {peak['ws-c']}); up to {peak['held']} runs held at once; every message the "
                f"producer published, {copies}x; {workers} workers x 2; "
                f"settled {settle:.0f} s after the last fault"]
            problems = _feeder_problems(feeder)
            if peak["ws-c"] > cap:
                problems.append(f"ws-c had {peak['ws-c']} runs running at once, over its cap of {cap}")
            if held:
                problems.append(f"{held} runs still held by admission after everything settled")
            if not peak["held"]:
                problems.append("no run was ever held: the scenario did not exercise admission")
    finally:
        stop.set()
        redis.close()
        with env.engine().begin() as conn:
            conn.execute(text("TRUNCATE job_quota, job_admission"))
    return Result.from_check("12", f"admission on across 3 workspaces + SIGKILL + every message {copies}x"
                             + (" + Redis restarts" if restart_every else ""), c,
                             f"{len(killer.done)} SIGKILL, the producer's messages {copies}x"
                             + (f", {restarts} Redis restarts" if restart_every else ""),
                             time.monotonic() - t0, notes, problems)


ALL: dict[str, Callable[..., Result]] = {
    "sigkill": sigkill,
    "sigterm": sigterm,
    "redis": lambda base, **kw: broker_restart(base, broker="redis", **kw),
    "rabbitmq": lambda base, **kw: broker_restart(base, broker="rabbitmq", **kw),
    "postgres": postgres_restart,
    "duplicates": duplicates,
    "beats": three_beats,
    "poison": poison,
    "clock": clock,
    "bad_input": bad_input,
    "tenancy": tenancy,
    "fair_share": fair_share,
}

__all__ = ["Base", "ALL", "SUBSCRIBERS", "WORKSPACES"]
