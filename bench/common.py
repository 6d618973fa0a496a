"""What every section of the suite shares: the bench database, workers, queues, RSS."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from sqlalchemy import create_engine, make_url, text
from sqlalchemy.pool import NullPool

ROOT = Path(__file__).resolve().parent.parent
DB = "motir_bench"
MOTIR_QUEUE = "bench-motir"
PLAIN_QUEUE = "bench-plain"
LOG_DIR = Path("/tmp")


def child_cwd() -> Path:
    """``python -m`` puts its working directory first on sys.path: to run another
    checkout's engine (BENCH_ENGINE_PATH), start the child there."""
    return Path(os.environ.get("BENCH_ENGINE_PATH") or ROOT)


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # BENCH_ENGINE_PATH puts another checkout's motir_celery first (before/after runs).
    paths = [p for p in (os.environ.get("BENCH_ENGINE_PATH"), str(ROOT)) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra)
    return env


def server_url() -> str:
    """The Postgres server the suite was pointed at (MOTIR_DATABASE_URL before the suite replaced it)."""
    return os.environ.get("BENCH_SERVER_URL") or os.environ["MOTIR_DATABASE_URL"]


def admin_dsn() -> str:
    """The server URL as a libpq DSN (for psycopg in the peers venv, and pgbench)."""
    url = make_url(server_url())
    parts = [f"host={url.host or '127.0.0.1'}", f"port={url.port or 5432}", f"user={url.username or 'postgres'}",
             f"dbname={url.database or 'postgres'}"]
    if url.password:
        parts.append(f"password={url.password}")
    return " ".join(parts)


def create_bench_database(name: str = DB) -> str:
    """A fresh database at head, on the same server as MOTIR_DATABASE_URL; returns its URL."""
    server = make_url(server_url())
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    url = server.set(database=name).render_as_string(hide_password=False)
    from motir_celery.store.migrate import upgrade

    upgrade(url)
    return url


def drop_database(name: str) -> None:
    admin = create_engine(make_url(server_url()), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def succeeded(url: str) -> int:
    """Runs in state succeeded: what every durable side polls while its workers drain."""
    engine = create_engine(url, poolclass=NullPool)
    with engine.connect() as conn:
        count = int(conn.execute(text("SELECT count(*) FROM job_queue WHERE state = 'succeeded'")).scalar_one())
    engine.dispose()
    return count


def truncate(url: str) -> None:
    engine = create_engine(url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE job_run_dlq, job_step, job_run, job_queue, job_event CASCADE"))
    engine.dispose()


@contextmanager
def celery_workers(app: str, queue: str, workers: int, concurrency: int,
                   env: dict[str, str] | None = None, *, tag: str = "w") -> Iterator[list[subprocess.Popen[bytes]]]:
    """``workers`` prefork ``celery worker`` processes of ``concurrency`` each, on ``queue``.

    The same flags for every Celery side: prefetch 1 and early acks come from the
    apps' configuration; gossip and mingle off (single-host bench).
    """
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(workers):
            log = open(LOG_DIR / f"bench-{tag}-{i}.log", "wb")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", app, "worker", "-l", "WARNING", "-c", str(concurrency),
                 "-P", "prefork", "-Q", queue, "-n", f"{tag}{i}@%h", "--without-gossip", "--without-mingle"],
                stdout=log, stderr=subprocess.STDOUT, env=env or child_env(), cwd=child_cwd(),
            ))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def wait_for(done: Callable[[], bool], procs: list[subprocess.Popen[bytes]], *, timeout: float, tag: str,
             poll: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        for i, p in enumerate(procs):
            if p.poll() is not None:
                log = (LOG_DIR / f"bench-{tag}-{i}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"worker {tag}{i} exited ({p.returncode}):\n{log}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{tag}: not done after {timeout:.0f}s")
        time.sleep(poll)


def purge(app, queue: str) -> None:  # type: ignore[no-untyped-def]
    with app.connection_for_write() as conn:
        try:
            conn.default_channel.queue_purge(queue)
        except Exception:  # noqa: BLE001 — a queue that was never declared has nothing to purge
            pass


def rss_tree(pid: int) -> list[tuple[int, int, int]]:
    """(pid, VmRSS kB, VmHWM kB) for ``pid`` and its children."""
    import psutil

    out = []
    proc = psutil.Process(pid)
    for p in [proc, *proc.children(recursive=True)]:
        fields = {}
        try:
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    fields[key] = int(value.split()[0])
        except FileNotFoundError:
            continue
        out.append((p.pid, fields.get("VmRSS", 0), fields.get("VmHWM", 0)))
    return out


SCALING_DOC = ROOT / "docs" / "scaling.md"


def block_markers(module: str) -> tuple[str, str]:
    """The markers around the block ``python -m <module>`` regenerates in a doc."""
    return (f"<!-- {module}: begin (generated by python -m {module}; edits here are lost) -->",
            f"<!-- {module}: end -->")


def write_block(module: str, block: str, doc: Path = SCALING_DOC) -> None:
    """Replace the text between ``module``'s markers in ``doc`` with ``block`` (markers
    excluded); a doc without the markers gets them, with the block, at its end."""
    begin, end = block_markers(module)
    text_ = doc.read_text() if doc.exists() else ""
    if begin not in text_:
        text_ += f"\n{begin}\n{end}\n"
    head, rest = text_.split(begin, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{begin}\n\n{block.strip()}\n\n{end}{tail}")
