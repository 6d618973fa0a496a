"""``make run``: migrate, start a real Celery worker, run the example jobs, print what happened.

Against ``MOTIR_DATABASE_URL`` and ``CELERY_BROKER_URL`` (``make run`` starts
embedded Postgres and Redis when they are unset). The worker is a real
``celery -A motir_celery worker`` subprocess importing ``motir_celery.dev.examples``,
on a queue of the demo's own so it never takes another process's messages.
Exits 0 when every run ended as the example intends (see ``examples.py``).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DEADLINE = 30.0  # seconds for the three runs to finish
EXPECTED = {1001: "succeeded", 1002: "succeeded", 1003: "failed"}


def main() -> int:
    os.environ.setdefault("MOTIR_QUEUE", "motir-demo")
    os.environ["MOTIR_IMPORTS"] = "motir_celery.dev.examples"
    from motir_celery.settings import Settings

    settings = Settings.from_env()
    settings.require_database_url()
    if not settings.broker_url:
        print("CELERY_BROKER_URL is not set (run through `make run`, which starts an embedded Redis)", file=sys.stderr)
        return 2

    from motir_celery.store.migrate import upgrade

    print("1. migrating the database to head…")
    upgrade(settings.migrate_database_url or settings.require_database_url())

    log = Path(tempfile.gettempdir()) / f"motir-demo-worker-{uuid.uuid4().hex[:6]}.log"
    print(f"2. starting a celery worker (queue {settings.queue!r}, log {log})…")
    worker = _start_worker(settings.queue, log)
    try:
        _wait_ready(worker, log)
        return _run(settings)
    finally:
        _stop(worker)


def _start_worker(queue: str, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "celery", "-A", "motir_celery", "worker", "-l", "INFO", "-c", "2",
           "-Q", queue, "-n", f"demo-{uuid.uuid4().hex[:6]}@%h", "--without-gossip", "--without-mingle"]
    with open(log, "wb") as fh:
        # A session of its own: stopping it signals the pool children too.
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ),
                                start_new_session=True)


def _wait_ready(worker: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while "ready." not in log.read_text(errors="replace"):
        if worker.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the worker did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)


def _stop(worker: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=15)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=5)


def _script(name: str) -> str:
    """A console script of this environment, as a path that runs from here (no PATH needed)."""
    path = Path(sys.executable).with_name(name)
    here = os.path.relpath(path)
    return shlex.quote(here if not here.startswith("..") else str(path))


def hints(settings: Any, run_id: uuid.UUID, dlq_ids: list[Any]) -> str:
    """What to try next, as commands that run as printed in this shell and folder: the
    CLI by its path in this environment, with the settings the demo used."""
    shown = _script("motir")
    env = {"MOTIR_DATABASE_URL": settings.database_url, "CELERY_BROKER_URL": settings.broker_url,
           "MOTIR_IMPORTS": "motir_celery.dev.examples", "MOTIR_QUEUE": settings.queue}
    secret = [k for k, v in env.items() if "://" in v and urlsplit(v).password]
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items() if k not in secret)
    lines = ["next — these lines run as printed, in this folder:", f"  export {exports}"]
    if secret:
        lines.append(f"  # {', '.join(secret)}: as in your environment (it holds a password, not printed here)")
    lines.append(f"  {shown} runs show {run_id}")
    for dlq_id in dlq_ids:
        lines.append(f"  {shown} dlq replay {dlq_id} --actor you")
    if dlq_ids:
        celery = _script("celery")
        lines += [
            f"the demo's worker has stopped: a replayed run stays queued (on queue {settings.queue!r}) until a",
            f"worker takes it — start one in another shell (same export line): {celery} -A motir_celery worker "
            f"-Q {shlex.quote(settings.queue)}",
            "(or press Replay in `motir dashboard`, as X-Motir-User: you, X-Motir-Workspace: demo-shop)",
        ]
    return "\n".join(lines)


def _run(settings: Any) -> int:
    from motir_celery import send_event
    from motir_celery.dev import examples  # noqa: F401  (the jobs, registered in this process too)
    from motir_celery.ops import reads
    from motir_celery.ops.cli import text_table
    from motir_celery.ops.timefmt import format_duration
    from motir_celery.store.db import workspace_session

    orders: list[dict[str, Any]] = [
        {"order_id": 1001, "items": ["tea", "mug"], "amount": 24.0, "behaviour": "ok"},
        {"order_id": 1002, "items": ["kettle"], "amount": 59.0, "behaviour": "flaky"},
        {"order_id": 1003, "items": ["teapot"], "amount": 35.0, "behaviour": "declined"},
    ]
    print("3. sending three order.paid events (workspace demo-shop)…")
    runs: dict[int, uuid.UUID] = {}
    for order in orders:
        (run_id,) = send_event("order.paid", order, workspace_id="demo-shop").run_ids
        runs[order["order_id"]] = run_id

    print("4. waiting for the worker to run them…")
    deadline = time.monotonic() + DEADLINE
    while True:
        with workspace_session("demo-shop", settings=settings) as s:
            details = {oid: reads.get_run(s, rid) for oid, rid in runs.items()}
        if all(d is not None and d.run.state in ("succeeded", "failed", "cancelled") for d in details.values()):
            break
        if time.monotonic() > deadline:
            print(f"timed out after {DEADLINE:.0f}s; states: "
                  f"{ {o: d.run.state if d else None for o, d in details.items()} }", file=sys.stderr)
            return 1
        time.sleep(0.2)

    print()
    print(text_table(
        ["order", "run", "state", "attempts", "steps (attempt that stored it)", "took"],
        [(oid, d.run.id, d.run.state, f"{d.run.attempts}/{d.run.max_attempts}",
          " → ".join(f"{s.step_id} ({s.attempt})" for s in d.steps) or "-", format_duration(d.run.duration))
         for oid, d in details.items() if d is not None],
        max_width=70,
    ))
    print()
    print(text_table(
        ["order", "attempt", "worker", "outcome", "error"],
        [(oid, a.attempt, a.worker, a.outcome,
          (a.error or {}).get("message", "") if isinstance(a.error, dict) else "")
         for oid, d in details.items() if d is not None for a in d.attempts],
        max_width=70,
    ))
    print()
    print(hints(settings, runs[1002], [d.dlq.id for d in details.values() if d is not None and d.dlq is not None]))
    outcome = {oid: d.run.state for oid, d in details.items() if d is not None}
    if outcome != EXPECTED:
        print(f"unexpected outcome {outcome}, expected {EXPECTED}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
