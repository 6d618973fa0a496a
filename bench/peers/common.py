"""Helpers for the peers' drivers (stdlib + psycopg only)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import psycopg

ROOT = Path(__file__).resolve().parents[2]


def recreate_database(admin_dsn: str, name: str) -> str:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    info = psycopg.conninfo.conninfo_to_dict(admin_dsn)
    info["dbname"] = name
    return psycopg.conninfo.make_conninfo(**info)


@contextmanager
def processes(cmds: list[list[str]], env: dict[str, str] | list[dict[str, str]], tag: str) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = []
    try:
        for i, cmd in enumerate(cmds):
            log = open(f"/tmp/bench-{tag}-{i}.log", "wb")
            e = env[i] if isinstance(env, list) else env
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=e, cwd=ROOT))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def wait_until(check: Callable[[], bool], procs: list[subprocess.Popen[bytes]], timeout: float, tag: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        for i, p in enumerate(procs):
            if p.poll() is not None:
                raise RuntimeError(f"{tag} process {i} exited: " + Path(f"/tmp/bench-{tag}-{i}.log").read_text()[-3000:])
        if time.monotonic() > deadline:
            raise TimeoutError(f"{tag}: not done after {timeout}s")
        time.sleep(0.1)


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT)
    e.update(extra)
    return e


def emit(result: Any) -> None:
    print(json.dumps(result), flush=True)


def python() -> str:
    return sys.executable


def arguments(*, timeout: float, **extra: tuple[type, Any]) -> argparse.ArgumentParser:
    """The command line both peers' drivers take (``bench/peersenv.py`` builds it);
    ``extra``: a driver's own options, as name=(type, default)."""
    p = argparse.ArgumentParser()
    p.add_argument("section", choices=["throughput", "latency"])
    p.add_argument("--admin-dsn", required=True)
    p.add_argument("--runs", type=int, default=5000)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--events", type=int, default=250)
    p.add_argument("--interval", type=float, default=0.02)
    p.add_argument("--timeout", type=float, default=timeout)
    p.add_argument("--reuse", action="store_true", help="reuse the database a previous call set up")
    for name, (kind, default) in extra.items():
        p.add_argument(f"--{name}", type=kind, default=default)
    return p
