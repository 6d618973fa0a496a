"""DBOS side (``bench.peers.main``): workflows enqueued with ``DBOSClient`` (one insert each), each worker a
``bench.peers.dbos_app`` process (``--concurrency``: its worker_concurrency; ``--poll``: its queue polling).

    python -m bench.peers.dbos_side throughput|latency --admin-dsn DSN [--runs 5000 --workers 2 --poll 0.01 ...]
"""

from __future__ import annotations

import psycopg

from bench import harness as h
from bench.peers import PYTHON, Peer, count, database, main, processes

DB = "motir_bench_dbos"


class Dbos(Peer):
    """A ``harness.Side``: the three functions as a DBOS workflow of three steps."""

    def __init__(self, admin_dsn: str, reuse: bool, poll: float) -> None:
        from dbos import DBOSClient

        from bench.peers.dbos_app import QUEUE, VERSION

        self.dsn, self.poll = database(admin_dsn, DB, reuse=reuse), poll
        info = psycopg.conninfo.conninfo_to_dict(self.dsn)
        self.url = (f"postgresql://{info.get('user', 'postgres')}{':' + str(info['password']) if info.get('password') else ''}"
                    f"@{info.get('host', '127.0.0.1')}:{info.get('port', 5432)}/{info['dbname']}")
        if not reuse:  # one launch creates DBOS's schema and registers the queue; then it exits
            with self.workers(1, 2, "dbos") as procs:
                procs.wait_logged("ready")
        self.client = DBOSClient(system_database_url=self.url, application_name="motirbench")
        self.options = {"workflow_name": "three", "queue_name": QUEUE, "app_version": VERSION}

    def reset(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("TRUNCATE dbos.workflow_status CASCADE")

    def send(self, i: int) -> str:
        return str(self.client.enqueue(self.options, i).get_workflow_id())  # type: ignore[arg-type]

    def settled(self) -> int:
        return count(self.dsn, "SELECT count(*) FROM dbos.workflow_status WHERE status = 'SUCCESS'")

    def finished(self) -> dict[str, float]:
        with psycopg.connect(self.dsn) as conn:
            return {r[0]: r[1] / 1000 for r in conn.execute(
                "SELECT workflow_uuid, updated_at FROM dbos.workflow_status WHERE status = 'SUCCESS'")}

    def workers(self, n: int, concurrency: int, tag: str = "dbos") -> h.Procs:
        return processes(tag, [[PYTHON, "-m", "bench.peers.dbos_app"]] * n, [
            {"BENCH_PEER_URL": self.url, "BENCH_DBOS_EXECUTOR": f"bench-{i}", "BENCH_DBOS_CONCURRENCY": str(concurrency),
             "BENCH_DBOS_POLL": str(self.poll)} for i in range(n)])


if __name__ == "__main__":
    main(lambda a: Dbos(a.admin_dsn, a.reuse, a.poll), 900, poll=(float, 0.01)).client.destroy()
