"""One sweep per period across the fleet (migration 0007, core/sweeper.py): the
sweep slot decides, under concurrency, against the real Postgres."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Engine

import tests.fixtures.jobs  # noqa: F401  (registers the test jobs)
from motir_celery.core.engine import Engine as MotirEngine
from motir_celery.core.worker.sweeper import SweepReport
from motir_celery.settings import Settings
from motir_celery.testing import Held
from tests.conftest import celery_worker, wait_for
from tests.fixtures.engines import holding


def _period() -> Settings:
    """A 30 s sweep period (read after conftest pointed MOTIR_DATABASE_URL at the test database)."""
    return Settings.from_env({**os.environ, "MOTIR_SWEEP_INTERVAL": "30"})


def _host(published: Held | None = None) -> MotirEngine:
    """One host's engine on a 30 s sweep period, its messages held in ``published``."""
    return MotirEngine(_period(), host=published if published is not None else Held())


def _stale_runs(engine: Engine, n: int) -> set[Any]:
    quiet = holding()
    run_ids = {quiet.send_event("test.three", {"i": i}).run_ids[0] for i in range(n)}
    with engine.begin() as conn:
        conn.execute(text("UPDATE job_queue SET dispatched_at = now() - interval '5 minutes'"))
    return run_ids


def _sweep_at_once(hosts: int, **kwargs: Any) -> tuple[list[SweepReport], list[Any]]:
    """``hosts`` sweepers released together, as a fleet whose periods line up."""
    published = Held()  # every host's messages, in one list (appends are atomic)
    lock = threading.Lock()
    start = threading.Barrier(hosts)
    reports: list[SweepReport] = []

    def host() -> None:
        sweeping = _host(published)
        start.wait()
        report = sweeping.sweep(**kwargs)
        with lock:
            reports.append(report)

    threads = [threading.Thread(target=host) for _ in range(hosts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(reports) == hosts
    return reports, [run_id for run_id, _job, _countdown in published]


def test_eight_hosts_sweeping_in_one_period_make_one_sweep_that_does_the_whole_work(engine: Engine) -> None:
    stale = _stale_runs(engine, 25)
    reports, published = _sweep_at_once(8, once_per_period=True, batch=10)
    assert sorted(r.swept for r in reports) == [False] * 7 + [True]
    (winner,) = [r for r in reports if r.swept]
    # The one sweep took every stale run, batch after batch (10 + 10 + 5), once each.
    assert winner.republished == 25 and sorted(map(str, published)) == sorted(map(str, stale))
    assert all(r.republished == 0 for r in reports if not r.swept)


def test_a_second_sweep_within_the_period_does_nothing_and_one_after_it_runs(engine: Engine) -> None:
    assert _host().sweep(once_per_period=True).swept
    assert not _host().sweep(once_per_period=True).swept
    with engine.begin() as conn:  # the period passes (on the database clock, which decides)
        conn.execute(text("UPDATE job_sweep SET swept_at = now() - interval '28 seconds'"))
    assert _host().sweep(once_per_period=True).swept  # 28 s >= 0.9 x 30 s
    with engine.connect() as conn:
        by = conn.execute(text("SELECT swept_by FROM job_sweep WHERE name = 'fleet'")).scalar_one()
    assert by.endswith(f"/{os.getpid()}")


def test_a_direct_sweep_ignores_the_slot_as_hosts_of_the_previous_release_do(engine: Engine) -> None:
    _stale_runs(engine, 3)
    assert _host().sweep(once_per_period=True).swept
    reports, published = _sweep_at_once(2, batch=10)
    # Unslotted sweeps all run; SKIP LOCKED and the stamp still send each stale run once.
    assert all(r.swept for r in reports) and len(published) == 0  # the slotted sweep stamped them


def test_the_sweep_slot_is_the_engines_alone_and_the_engine_may_read_the_schema_version(engine: Engine) -> None:
    with engine.connect() as conn:
        rights = conn.execute(text(
            "SELECT has_table_privilege('motir_app', 'job_sweep', 'SELECT'),"
            " has_table_privilege('motir_app', 'job_sweep', 'UPDATE'),"
            " has_table_privilege('motir_engine', 'job_sweep', 'UPDATE'),"
            " has_table_privilege('motir_engine', 'job_sweep', 'DELETE'),"
            " has_table_privilege('motir_engine', 'alembic_version', 'SELECT'),"
            " has_table_privilege('motir_engine', 'alembic_version', 'UPDATE'),"
            " has_table_privilege('motir_app', 'alembic_version', 'SELECT')")).one()
    # The engine reads the schema version (motir doctor with the workers' login), nothing more.
    assert tuple(rights) == (False, False, True, False, True, False, False)


def test_two_worker_processes_take_the_slot_in_turn_and_never_twice_in_one_period(
        engine: Engine, broker_url: str, tmp_path: Path) -> None:
    """Real workers sweep through the slot: every sweep is a new row version, at least
    0.9 × the 1 s period after the one before, whichever worker took it."""
    with engine.begin() as conn:  # a history of the slot's takers, kept by the test only
        conn.execute(text(
            "CREATE TABLE IF NOT EXISTS test.sweeps (at timestamptz, by text);"
            " TRUNCATE test.sweeps;"
            " CREATE OR REPLACE FUNCTION test.log_sweep() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN INSERT INTO test.sweeps VALUES (NEW.swept_at, NEW.swept_by); RETURN NEW; END $$;"
            " CREATE OR REPLACE TRIGGER log_sweep AFTER UPDATE ON job_sweep"
            " FOR EACH ROW WHEN (NEW.name = 'fleet')"  # the slot's row ('stats' is the rollup's watermark)
            " EXECUTE FUNCTION test.log_sweep();"
            " GRANT USAGE ON SCHEMA test TO motir_engine; GRANT INSERT ON test.sweeps TO motir_engine"))
    try:
        with celery_worker(tmp_path, broker=broker_url, name="a", sweep_interval=1.0), \
                celery_worker(tmp_path, broker=broker_url, name="b", sweep_interval=1.0):
            wait_for(lambda: _count(engine, "SELECT count(*) FROM test.sweeps") >= 6, timeout=30,
                     what="six sweeps")
        with engine.connect() as conn:
            at = conn.execute(text("SELECT at FROM test.sweeps ORDER BY at")).scalars().all()
            takers = set(conn.execute(text("SELECT by FROM test.sweeps")).scalars())
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP TRIGGER IF EXISTS log_sweep ON job_sweep"))
    gaps = [(b - a).total_seconds() for a, b in zip(at, at[1:])]
    assert min(gaps) >= 0.9, gaps  # two workers sweeping on their own would make gaps near 0
    assert len(takers) >= 1 and all("/" in t for t in takers)


def _count(engine: Engine, sql: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(sql)).scalar_one())
