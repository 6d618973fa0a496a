"""What one round trip to Postgres costs when the server was busy vs idle.

    python -m bench.wakeup

At low load (section 2 of the suite: one event every 20 ms) every process on
a run's path — the sender, Postgres, Redis, the worker's main process, its
pool child — has gone to sleep since the last run, and waking each one costs
more than the work it then does. This measures that on the machine at hand:
a ``SELECT 1`` and a one-row ``INSERT`` whose commit waits for the WAL flush,
each sent back to back and after a 20 ms pause, median of 300. Not part of
``python -m bench``; docs/performance.md quotes it in its notes.
"""

from __future__ import annotations

import os
import time

import psycopg
from sqlalchemy import make_url

from bench.stats import median


def _dsn() -> str:
    url = make_url(os.environ["MOTIR_DATABASE_URL"])
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def _round_trip_ms(conn: psycopg.Connection, sql: str, pause: float, n: int = 300) -> float:
    times = []
    for _ in range(n):
        if pause:
            time.sleep(pause)
        t0 = time.perf_counter()
        conn.execute(sql)
        times.append(time.perf_counter() - t0)
    return median(times) * 1e3


def main() -> None:
    with psycopg.connect(_dsn(), autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_wakeup (x int)")
        print("round trip, median ms        back to back   after 20 ms idle")
        for label, sql in (("SELECT 1", "SELECT 1"), ("INSERT, flushed commit", "INSERT INTO bench_wakeup VALUES (1)")):
            busy, idle = _round_trip_ms(conn, sql, 0.0), _round_trip_ms(conn, sql, 0.02)
            print(f"{label:28s} {busy:8.3f}       {idle:8.3f}   (x{idle / busy:.1f})")
        conn.execute("DROP TABLE bench_wakeup")


if __name__ == "__main__":
    main()
