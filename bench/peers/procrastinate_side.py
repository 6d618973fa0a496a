"""Procrastinate side (``bench.peers.main``): ``procrastinate worker`` processes (asyncio; the sync task
runs in a thread), ``--concurrency`` jobs at once each, LISTEN/NOTIFY on (its default).

    python -m bench.peers.procrastinate_side throughput|latency --admin-dsn DSN [--runs 5000 --workers 1 ...]
"""

from __future__ import annotations

import os

import psycopg

from bench import harness as h
from bench.peers import PYTHON, Peer, count, database, main, processes

DB = "motir_bench_procrastinate"


class Procrastinate(Peer):
    """A ``harness.Side``: the three functions as one Procrastinate task."""

    def __init__(self, admin_dsn: str, reuse: bool) -> None:
        os.environ["BENCH_PEER_DSN"] = self.dsn = database(admin_dsn, DB, reuse=reuse)
        from bench.peers.procrastinate_app import app, three

        self.app, self.three = app.open(), three  # open for the driver's lifetime
        if not reuse:
            app.schema_manager.apply_schema()

    def reset(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("TRUNCATE procrastinate_jobs CASCADE")

    def prequeue(self, n: int, offset: int = 0) -> None:
        for i in range(offset, offset + n, 1000):
            self.three.batch_defer(*({"n": k} for k in range(i, min(offset + n, i + 1000))))

    def send(self, i: int) -> str:
        return str(self.three.defer(n=i))

    def settled(self) -> int:
        return count(self.dsn, "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'")

    def finished(self) -> dict[str, float]:
        with psycopg.connect(self.dsn) as conn:
            return {str(r[0]): r[1] for r in conn.execute(
                "SELECT job_id, extract(epoch FROM at)::float8 FROM procrastinate_events WHERE type = 'succeeded'")}

    def workers(self, n: int, concurrency: int, tag: str = "procrastinate") -> h.Procs:
        return processes(tag, [[PYTHON, "-m", "procrastinate", "--app", "bench.peers.procrastinate_app.app",
                                "--log-level", "warning", "worker", "-q", "bench", "-c", str(concurrency),
                                "-n", f"bench-{i}"] for i in range(n)], [{"BENCH_PEER_DSN": self.dsn}] * n)


if __name__ == "__main__":
    main(lambda a: Procrastinate(a.admin_dsn, reuse=a.reuse and a.section == "throughput"), 600)
