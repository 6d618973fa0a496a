"""A worker that stays up (issue 19): a malformed message, supervision, and a fleet with no live consumer.

Real ``celery worker`` processes on the real Redis broker, never eager tasks:

* an item on the queue's list that is not a message is moved aside and the
  worker goes on (``messages.GuardedRedisTransport``);
* the systemd units in docs/systemd pass ``systemd-analyze verify``, and the
  worker unit's own ``ExecStart`` command line, started again after its worker
  died, runs the run sent while nobody was consuming, once (what a supervisor
  does; compose's restart policy is checked in tests/ops/test_compose.py);
* ``motir doctor`` and ``/metrics`` say when a queue has runs and no live consumer.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text
from starlette.testclient import TestClient

import tests.fixtures.jobs  # noqa: F401  (registers the jobs in this process too, for send_event)
from motir_celery import send_event
from motir_celery.adapter.messages import MALFORMED_SUFFIX
from motir_celery.ops import doctor
from motir_celery.ops.dashboard import DashboardConfig
from motir_celery.ops.dashboard import create_app as create_dashboard
from motir_celery.ops.metrics import ConsumerProbe, MotirCollector
from motir_celery.settings import get_settings, reset_settings
from tests.conftest import ROOT, celery_worker, count_effects, run_state, wait_for

UNITS = ROOT / "docs" / "systemd"
CELERY = Path(sys.executable).with_name("celery")


def _succeeded(engine: Any, run_id: object, timeout: float = 30.0) -> bool:
    return bool(wait_for(lambda: run_state(engine, run_id) == "succeeded", timeout=timeout,
                         what=f"run {run_id} to succeed"))


# --- a malformed message ----------------------------------------------------------


def test_items_on_the_queue_that_are_not_messages_are_moved_aside_and_the_worker_runs_the_next_run(
        engine: Any, broker_url: str, queue: str, tmp_path: Path) -> None:
    client = redis.Redis.from_url(broker_url)
    garbage = [b"this is not json", b"[1, 2]", b'{"properties": {}}']
    with celery_worker(tmp_path, broker=broker_url, concurrency=1) as worker:
        for item in garbage:
            client.lpush(queue, item)  # what kombu alone would die of: Unrecoverable error, exit 1
        (run_id,) = send_event("test.three", {}).run_ids  # behind them on the same list
        assert _succeeded(engine, run_id)
        assert worker.proc.poll() is None, worker.output()[-3000:]
        log = worker.output()
    assert "Unrecoverable error" not in log
    assert log.count(f"a malformed message on queue {queue!r}") == len(garbage)
    assert log.count(f"moved to the Redis list '{queue}{MALFORMED_SUFFIX}'") == len(garbage)
    assert client.lrange(queue + MALFORMED_SUFFIX, 0, -1) == garbage[::-1]  # newest first, as LPUSH keeps them
    assert count_effects(engine, run_id) == 3


def _lease_left(engine: Any, run_id: object) -> float | None:
    with engine.connect() as conn:
        left = conn.execute(text("SELECT extract(epoch FROM lease_expires_at - now()) FROM job_queue "
                                 "WHERE id = :r AND state = 'running'"), {"r": run_id}).scalar()
    return None if left is None else float(left)


def test_a_warm_shutdown_keeps_renewing_the_leases_of_the_runs_in_hand_until_they_finish(
        engine: Any, broker_url: str, queue: str, tmp_path: Path) -> None:
    """SIGTERM, as a supervisor stops a worker: the threads pool's run keeps its 3 s lease for the 8 s it still takes."""
    with celery_worker(tmp_path, broker=broker_url, pool="threads", concurrency=1, lease=3.0) as worker:
        (run_id,) = send_event("test.slow", {"sleep": 8}).run_ids
        wait_for(lambda: count_effects(engine, run_id, "b") == 1, what="step b to start")
        time.sleep(2.0)  # past the first renewal
        worker.kill(signal.SIGTERM)
        lowest = float("inf")
        while (left := _lease_left(engine, run_id)) is not None:
            lowest = min(lowest, left)
            time.sleep(0.25)
        assert worker.proc.wait(timeout=15) == 0
    assert run_state(engine, run_id) == "succeeded"
    assert 0 < lowest < float("inf")  # never expired while it ran
    with engine.connect() as conn:
        outcomes = conn.execute(text("SELECT outcome FROM job_run WHERE run_id = :r"), {"r": run_id}).scalars().all()
    assert outcomes == ["succeeded"]


# --- supervision ----------------------------------------------------------------------


def _unit(name: str) -> dict[str, str]:
    """The [Service] and [Unit] keys of a unit file (the last value of a key wins, as in systemd)."""
    keys: dict[str, str] = {}
    for line in (UNITS / name).read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            keys[key.strip()] = value.strip()
    return keys


def _seconds(value: str) -> float:
    units = {"min": 60.0, "s": 1.0, "h": 3600.0}
    for suffix, factor in units.items():
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * factor
    return float(value)


def test_the_worker_and_beat_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    assert shutil.which("systemd-analyze"), "systemd-analyze is part of systemd (Debian: the systemd package)"
    for name in ("motir-worker@.service", "motir-beat.service"):
        # verify checks that ExecStart's program exists: point it at this venv's celery.
        text = (UNITS / name).read_text().replace("/opt/motir/venv/bin/celery", str(CELERY))
        (tmp_path / name).write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", "./motir-worker@motir.service", "./motir-beat.service"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    # verify exits 0 on an unknown key or a bad value too, and only says so: nothing said is the pass.
    assert result.returncode == 0 and not result.stderr.strip() and not result.stdout.strip(), result


def test_the_units_restart_on_failure_and_stop_with_a_warm_shutdown_longer_than_a_lease() -> None:
    lease = get_settings().lease_seconds
    for name in ("motir-worker@.service", "motir-beat.service"):
        unit = _unit(name)
        assert unit["Restart"] == "on-failure" and _seconds(unit["RestartSec"]) <= 5, name
        assert unit["KillSignal"] == "SIGTERM" and unit["EnvironmentFile"].startswith("/etc/"), name
        assert unit["User"] not in ("root", "0"), name
    worker = _unit("motir-worker@.service")
    assert _seconds(worker["TimeoutStopSec"]) > lease  # Celery's warm shutdown finishes the runs in hand
    assert worker["KillMode"] == "mixed"  # SIGTERM to the main process; pool children are its to stop


def _exec_start(queue: str) -> list[str]:
    """The worker unit's ExecStart for instance ``queue``, as systemd would expand it here."""
    line = _unit("motir-worker@.service")["ExecStart"]
    line = line.replace("%i", queue).replace("%H", socket.gethostname()).replace("%%", "%")
    argv = shlex.split(line)
    assert argv[0] == "/opt/motir/venv/bin/celery", argv
    return [str(CELERY), *argv[1:]]


def _start(argv: list[str], log: Path, broker_url: str) -> tuple[subprocess.Popen[bytes], float]:
    """Start the unit's command line as systemd would (its environment file's variables) and time it to ready."""
    env = {**os.environ, "CELERY_BROKER_URL": broker_url, "MOTIR_IMPORTS": "tests.fixtures.jobs", "PYTHONPATH": str(ROOT),
           "MOTIR_SWEEP_INTERVAL": "1", "MOTIR_REPUBLISH_AFTER": "5"}
    mark = log.stat().st_size if log.exists() else 0
    started = time.monotonic()
    with open(log, "ab") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    while "ready." not in log.read_bytes()[mark:].decode(errors="replace"):
        if proc.poll() is not None or time.monotonic() - started > 60:
            _stop(proc)
            raise AssertionError(f"the unit's command line did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return proc, time.monotonic() - started


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_the_units_command_line_started_again_after_its_worker_died_runs_the_run_sent_meanwhile_once(
        engine: Any, broker_url: str, queue: str, tmp_path: Path) -> None:
    argv = _exec_start(queue)
    assert argv[1:4] == ["-A", "motir_celery", "worker"] and argv[argv.index("-Q") + 1] == queue
    log = tmp_path / "unit-worker.log"
    first, _ = _start(argv, log, broker_url)
    try:
        (before,) = send_event("test.three", {"n": 1}).run_ids
        assert _succeeded(engine, before)
        os.killpg(first.pid, signal.SIGKILL)  # an OOM kill: no warm shutdown, nothing said
        assert first.wait(timeout=10) != 0  # what makes Restart=on-failure start it again
    finally:
        _stop(first)
    (meanwhile,) = send_event("test.three", {"n": 2}).run_ids
    time.sleep(1.0)
    assert run_state(engine, meanwhile) == "queued"  # nobody consumes: it waits, in Redis and in Postgres
    second, ready_after = _start(argv, log, broker_url)  # what the supervisor does after RestartSec
    try:
        assert _succeeded(engine, meanwhile)
        print(f"restarted worker ready after {ready_after:.1f}s")
    finally:
        _stop(second)
    assert second.returncode == 0  # a warm shutdown on SIGTERM ends cleanly: no restart after a stop
    assert count_effects(engine, meanwhile) == 3  # each of its three steps once


# --- doctor and /metrics with no live consumer ----------------------------------------


def _samples(body: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def _workers_check() -> doctor.Check:
    (check,) = [c for c in doctor.run_checks(get_settings(), timeout=1.0) if c.name == "workers"]
    return check


def test_with_runs_queued_and_no_live_consumer_doctor_fails_naming_the_queue_and_metrics_count_zero_consumers(
        engine: Any, broker_url: str, queue: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = [j for j in doctor.all_jobs() if j.handler.__module__ in ("tests.fixtures.jobs", "motir_celery.core.system_jobs")]
    monkeypatch.setattr(doctor, "all_jobs", lambda: mine)  # other modules' jobs: not this worker's business
    reset_settings()
    dashboard = TestClient(create_dashboard(DashboardConfig(secret="test-secret")))
    for i in range(3):
        send_event("test.three", {"i": i})  # a fleet whose workers all died: the runs wait

    check = _workers_check()
    assert check.failed and f"no live consumer on queue(s) {queue!r} (3 run(s) queued)" in check.detail, check
    assert f"-Q {queue}" in check.fix
    # The broker answered: a scrape waits 1.5 s at most for the broadcast, which a loaded machine
    # can miss (the scrape then says 0, "not known"); the answer is in the next one.
    samples = wait_for(lambda: (found := _samples(dashboard.get("/metrics").text))
                       .get(("motir_consumers_known", ())) == 1 and found, timeout=20, interval=0.5,
                       what="a scrape with the broker's answer")
    assert samples[("motir_workers_live", ())] == 0
    assert samples[("motir_queue_consumers", (("queue", queue),))] == 0

    with celery_worker(tmp_path, broker=broker_url, concurrency=1):
        check = _workers_check()
        assert not check.failed and "no live consumer" not in check.detail, check
        # The dashboard asks again once its last answer is 5 s old.
        wait_for(lambda: _samples(dashboard.get("/metrics").text)[("motir_queue_consumers", (("queue", queue),))] >= 1,
                 timeout=15, interval=0.5, what="/metrics to count the worker")
        assert _samples(dashboard.get("/metrics").text)[("motir_workers_live", ())] >= 1


def test_a_broker_that_does_not_answer_costs_a_scrape_at_most_the_probes_wait(database_url: str) -> None:
    def hangs() -> dict[str, set[str]]:
        time.sleep(10)
        return {}

    settings = get_settings()
    collector = MotirCollector(settings=settings, probe=ConsumerProbe(settings, ask=hangs, wait=0.5))
    started = time.monotonic()
    names = {m.name: m for m in collector.collect()}
    assert time.monotonic() - started < 3
    assert names["motir_consumers_known"].samples[0].value == 0  # unknown, not zero workers
    assert "motir_workers_live" not in names and "motir_up" in names
