"""The peers: the same workload on Procrastinate and on DBOS Transact.

These modules run inside ``bench/.peers-venv`` (made by ``bench.peersenv``), never in the
project's environment, and import nothing from motir_celery (``bench.harness`` imports only
the standard library and psycopg at its top, for them). Each side is a small command that
prints one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Mapping, Sequence

import psycopg

from bench import harness as h


def database(admin_dsn: str, name: str, *, reuse: bool) -> str:
    """The DSN of database ``name`` on the admin DSN's server: made afresh unless ``reuse``."""
    if not reuse:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')
    return psycopg.conninfo.make_conninfo(**{**psycopg.conninfo.conninfo_to_dict(admin_dsn), "dbname": name})


def processes(tag: str, cmds: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]]) -> h.Procs:
    procs = h.Procs(tag)
    for cmd, env in zip(cmds, envs):
        procs.start(cmd, {**os.environ, "PYTHONPATH": str(h.ROOT), **env}, h.ROOT)
    return procs


def count(dsn: str, sql: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql).fetchone()  # type: ignore[arg-type]
        return int(row[0]) if row else 0


class Peer:
    """What the peers' sides (``harness.Side``) share: a backlog sent one by one, no backends of ours to meter."""

    def prequeue(self, n: int, offset: int = 0) -> None:
        for i in range(offset, offset + n):
            self.send(i)

    def send(self, i: int) -> str:
        raise NotImplementedError

    def backends(self) -> list[int]:
        return []


def main(make: Callable[[argparse.Namespace], Any], timeout: float, **extra: tuple[type, Any]) -> Any:
    """A driver's command (``bench/__main__.py`` builds its line): its side made from the arguments
    (``extra``: its own options, as name=(type, default)), the section run, one JSON object printed."""
    p = argparse.ArgumentParser()
    p.add_argument("section", choices=["throughput", "latency"])
    p.add_argument("--admin-dsn", required=True)
    p.add_argument("--reuse", action="store_true", help="reuse the database a previous call set up")
    for name, (kind, default) in {"runs": (int, 5000), "workers": (int, 1), "concurrency": (int, 2),
                                  "rounds": (int, 3), "events": (int, 250), "interval": (float, 0.02),
                                  "timeout": (float, timeout), **extra}.items():
        p.add_argument(f"--{name}", type=kind, default=default)
    args = p.parse_args()
    side = make(args)
    if args.section == "throughput":
        result: Any = {"rounds": [h.drain(side, args.runs, args.workers, args.concurrency, timeout=args.timeout).rate
                                  for _ in range(args.rounds)]}
    else:
        result = h.latency(side, args.events, args.interval, args.concurrency)
    print(json.dumps(result), flush=True)
    return side


PYTHON = sys.executable
