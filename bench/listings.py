"""Listings at depth (issue 47): the operator's and one tenant's newest runs, with and without 0020's indexes.

    python -m bench.listings [--runs 10000000] [--tenants 100] [--repeat 15]    # --runs 1000000: a quick pass

Needs MOTIR_DATABASE_URL (a server: its own ``motir_bench_listings`` database, dropped at the end).
``--runs`` runs spread over ``--tenants`` workspaces, 90 % finished, one created a second apart
(the shape of issue 47's measurement), then the median of ``--repeat`` calls of ``LIST_RUNS``
(limit 50) for each listing: the operator's (no filter), an operator's ``--workspace``, and one
tenant's under row-level security (``SET ROLE motir_app``) with its workspace named as the
dashboard names it, and with the policy alone. The same again with ``ix_job_queue_recent`` and
``ix_job_queue_workspace_recent`` dropped: the listings as they were before 0020.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench import harness as h
from motir_celery.store.sql import reads as reads_sql

DB = "motir_bench_listings"
log = h.logger("listings")
INDEXES = ("ix_job_queue_recent", "ix_job_queue_workspace_recent")
#: (what, LIST_RUNS's workspace filter, the tenant whose policy applies: None for the operator's login)
LISTINGS = (("the operator's newest runs", None, None),
            ("an operator's --workspace", "ws-7", None),
            ("one tenant's, its workspace named (the dashboard)", "ws-7", "ws-7"),
            ("one tenant's, its policy alone", None, "ws-7"))


def fill(db: h.Database, runs: int, tenants: int) -> None:
    db.rows("""
        INSERT INTO job_queue (job_id, event_name, workspace_id, state, max_attempts, retry_policy, created_at,
                               finished_at)
        SELECT 'job.' || (i %% 20), 'bench', 'ws-' || (i %% %(tenants)s), s.state, 3, 'transient',
               now() - make_interval(secs => %(n)s - i),
               CASE WHEN s.state = 'succeeded' THEN now() - make_interval(secs => %(n)s - i) END
        FROM generate_series(1, %(n)s) AS i,
             LATERAL (SELECT CASE WHEN i %% 10 = 0 THEN 'queued' ELSE 'succeeded' END AS state) AS s
        """, {"n": runs, "tenants": tenants})
    db.rows("VACUUM ANALYZE job_queue")


def median_ms(db: h.Database, workspace: str | None, tenant: str | None, repeat: int) -> float:
    params: dict[str, Any] = {"job": None, "state": None, "workspace": workspace, "since": None, "limit": 50}
    with h.connect(db.url, autocommit=False) as conn:
        if tenant is not None:
            conn.execute("SET ROLE motir_app")
            conn.execute("SELECT set_config('motir.workspace_id', %s, false)", (tenant,))
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            conn.execute(reads_sql.LIST_RUNS.sql, params).fetchall()
            times.append((time.perf_counter() - started) * 1000)
        conn.rollback()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.listings", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10_000_000)
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    with h.Database.create(DB) as db:
        started = time.monotonic()
        fill(db, args.runs, args.tenants)
        log(f"{args.runs:,} runs over {args.tenants} workspaces in {time.monotonic() - started:.0f} s")
        found = {}
        for phase in ("with", "without"):
            if phase == "without":
                db.rows("; ".join(f"DROP INDEX {name}" for name in INDEXES))
            for what, workspace, tenant in LISTINGS:
                found[(phase, what)] = median_ms(db, workspace, tenant, args.repeat)
    print(f"LIST_RUNS (limit 50), {args.runs:,} runs, {args.tenants} workspaces, median of {args.repeat}:")
    for what, _, _ in LISTINGS:
        print(f"  {what:52s} {found[('with', what)]:9.2f} ms   without 0020's indexes: "
              f"{found[('without', what)]:9.2f} ms")


if __name__ == "__main__":
    main()
