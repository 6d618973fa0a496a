"""One clock (DESIGN.md invariant 6): the database's ``now()`` and ``timestamptz``.

The same scenario — a cron run for a fixed slot, one run due and one backing
off, a claim of each — is played under a UTC session in a UTC process and under
session ``TimeZone = 'America/New_York'`` in a process with ``TZ=Asia/Kolkata``.
What it observes must be identical instants, durations and due-ness; each
scenario also proves its zones were really in force, so it cannot pass by
accident of running everything in UTC.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, Iterator
from zoneinfo import ZoneInfo

from sqlalchemy import DateTime, create_engine, text
from sqlalchemy.engine import Engine
from sqlalchemy.pool import NullPool

from motir_celery.store.models import Base
from motir_celery.store.sql.producer import enqueue_scheduled
from motir_celery.store.sql.worker import claim

# A slot given in a third zone: only its instant may matter. January: no DST anywhere involved.
SLOT = datetime(2030, 1, 15, 9, 30, tzinfo=ZoneInfo("Europe/Berlin"))
LEASE = 30.0


@contextmanager
def process_tz(zone: str) -> Iterator[None]:
    old = os.environ.get("TZ")
    os.environ["TZ"] = zone
    time.tzset()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = old
        time.tzset()


def _play(database_url: str, session_zone: str, process_zone: str, label: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Insert, reschedule, claim and read back; returns (observations, proof the zones applied)."""
    with process_tz(process_zone):
        eng = create_engine(database_url, poolclass=NullPool)
        try:
            with eng.connect() as conn:
                conn.execute(text(f"SET TimeZone = '{session_zone}'"))
                conn.commit()
                due_job, later_job = f"clock.{label}.due", f"clock.{label}.later"
                with conn.begin():
                    due = enqueue_scheduled(conn, due_job, SLOT, max_attempts=3, policy="transient")
                    later = enqueue_scheduled(conn, later_job, SLOT, max_attempts=3, policy="transient")
                    db_now = conn.execute(text("SELECT now()")).scalar_one()
                    # Bound from Python as aware instants in yet another zone: the offset travels with them.
                    kolkata = ZoneInfo("Asia/Kolkata")
                    for run, at in ((due, db_now - timedelta(seconds=2)), (later, db_now + timedelta(hours=1))):
                        conn.execute(text("UPDATE job_queue SET run_at = :at WHERE id = :id"),
                                     {"at": at.astimezone(kolkata), "id": run.run_id})  # type: ignore[union-attr]
                with conn.begin():
                    got_due = claim(conn, due.run_id, job_id=due_job, worker="w",  # type: ignore[union-attr]
                                    lease_seconds=LEASE, async_commit=True)
                    got_later = claim(conn, later.run_id, job_id=later_job, worker="w",  # type: ignore[union-attr]
                                      lease_seconds=LEASE, async_commit=True)
                    lease_left = conn.execute(
                        text("SELECT lease_expires_at - now() FROM job_queue WHERE id = :id"), {"id": due.run_id}  # type: ignore[union-attr]
                    ).scalar_one()
                with conn.begin():
                    rows = {
                        r.job_id: r
                        for r in conn.execute(text(
                            "SELECT job_id, scheduled_for, extract(epoch FROM scheduled_for) AS slot_epoch, "
                            "run_at, created_at, scheduled_for::text AS slot_text "
                            "FROM job_queue WHERE job_id IN (:a, :b)"
                        ), {"a": due_job, "b": later_job})
                    }
                    shown_zone = conn.execute(text("SHOW TimeZone")).scalar_one()
        finally:
            eng.dispose()
        proof = {
            "session TimeZone": shown_zone,
            "slot offset as loaded": rows[due_job].scheduled_for.utcoffset(),
            "slot as the session prints it": rows[due_job].slot_text,
            "process offset": timedelta(seconds=time.localtime().tm_gmtoff),
        }
    observed = {
        "slots": sorted(r.scheduled_for for r in rows.values()),
        "slot epochs": sorted(float(r.slot_epoch) for r in rows.values()),
        "claimed slot": got_due.scheduled_for if got_due else None,
        "claimed": (got_due is not None, got_later is not None),
        "attempt": got_due.attempt if got_due else None,
        "run_at from now": {
            "due": rows[due_job].run_at - db_now,
            "later": rows[later_job].run_at - db_now,
        },
        "lease left": lease_left,
    }
    return observed, proof


def test_instants_and_due_ness_are_identical_under_non_utc_session_and_process_zones(
    database_url: str, engine: Engine
) -> None:
    utc, utc_proof = _play(database_url, "UTC", "UTC", "utc")
    local, local_proof = _play(database_url, "America/New_York", "Asia/Kolkata", "local")

    # The zones were really in force...
    assert utc_proof == {
        "session TimeZone": "UTC",
        "slot offset as loaded": timedelta(0),
        "slot as the session prints it": "2030-01-15 08:30:00+00",
        "process offset": timedelta(0),
    }
    assert local_proof == {
        "session TimeZone": "America/New_York",
        "slot offset as loaded": timedelta(hours=-5),
        "slot as the session prints it": "2030-01-15 03:30:00-05",
        "process offset": timedelta(hours=5, minutes=30),
    }
    # ...and changed nothing that means anything.
    assert local == utc
    assert utc["slots"] == [SLOT, SLOT]
    assert utc["claimed slot"] == SLOT
    assert utc["slot epochs"] == [SLOT.timestamp()] * 2
    assert utc["claimed"] == (True, False)  # due-ness is run_at <= the database's now()
    assert utc["run_at from now"] == {"due": timedelta(seconds=-2), "later": timedelta(hours=1)}
    assert utc["lease left"] == timedelta(seconds=LEASE)

    # Written under New York / Kolkata, read back in a UTC session: the same instants.
    with engine.connect() as conn:
        conn.execute(text("SET TimeZone = 'UTC'"))
        slots = conn.execute(text("SELECT scheduled_for FROM job_queue WHERE job_id LIKE 'clock.local.%'")).scalars().all()
        conn.rollback()
    assert slots == [SLOT, SLOT]


def test_every_timestamp_is_timestamptz_in_the_models_and_the_database(engine: Engine) -> None:
    declared = {
        f"{table.name}.{column.name}"
        for table in Base.metadata.tables.values()
        for column in table.columns
        if isinstance(column.type, DateTime)
    }
    naive = [c for c in declared if not Base.metadata.tables[c.split(".")[0]].c[c.split(".")[1]].type.timezone]
    assert naive == []
    with engine.connect() as conn:
        live = dict(conn.execute(text(
            "SELECT table_name || '.' || column_name, data_type FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name LIKE 'job\\_%' AND data_type LIKE 'timestamp%'"
        )).all())
    assert set(live) == declared and len(declared) >= 15
    assert set(live.values()) == {"timestamp with time zone"}
