"""What one round trip to Postgres costs when the server was busy vs idle: ``python -m bench.wakeup``.

At low load (the suite's latency section: one event every 20 ms) every process on a
run's path has gone to sleep since the last run, and waking each one costs more than the
work it then does. This measures that on the machine at hand: a ``SELECT 1`` and a one-row
``INSERT`` whose commit waits for the WAL flush, each back to back and after a 20 ms
pause, median of 300. Not part of ``python -m bench``; docs/performance.md quotes it.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from bench import harness as h


def round_trip_ms(conn: psycopg.Connection[Any], sql: str, pause: float, n: int = 300) -> float:
    times = []
    for _ in range(n):
        time.sleep(pause)
        t0 = time.perf_counter()
        conn.execute(sql)
        times.append(time.perf_counter() - t0)
    return h.median(times) * 1e3


def main() -> None:
    h.parser("bench.wakeup", __doc__, write=None).parse_args()
    h.need("MOTIR_DATABASE_URL")
    with h.Database.create("motir_bench_wakeup", migrate=False) as db, h.connect(db.url) as conn:
        conn.execute("CREATE TABLE bench_wakeup (x int)")  # logged: its INSERT's commit waits for the flush
        print("round trip, median ms        back to back   after 20 ms idle")
        for label, sql in (("SELECT 1", "SELECT 1"), ("INSERT, flushed commit", "INSERT INTO bench_wakeup VALUES (1)")):
            busy, idle = round_trip_ms(conn, sql, 0.0), round_trip_ms(conn, sql, 0.02)
            print(f"{label:28s} {busy:8.3f}       {idle:8.3f}   (x{idle / busy:.1f})")


if __name__ == "__main__":
    main()
