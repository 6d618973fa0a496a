"""The frictions a newcomer hit (issue 18), each against the real services and worker.

* job modules importable from the current folder, as ``celery -A proj`` is;
* ``attach(app)`` in a module that defines tasks after it: no circular import;
* a retrying attempt shows as RETRY, as Flower sees it (Celery events);
* ``make run``'s closing hints run as printed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from sqlalchemy import text

from tests.conftest import ROOT, celery_worker, run_state, stop_group, wait_for

BIN = Path(sys.executable).parent


def _write(folder: Path, files: dict[str, str]) -> None:
    for name, body in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body))


def _newcomer_env(**extra: str) -> dict[str, str]:
    """The shell of someone who followed the README: no PYTHONPATH, the services' URLs."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env


@contextmanager
def console_worker(folder: Path, app: str, env: dict[str, str]) -> Iterator[Path]:
    """``celery -A <app> worker`` by its console script, started in ``folder``."""
    log = folder / f"worker-{uuid.uuid4().hex[:6]}.log"
    cmd = [str(BIN / "celery"), "-A", app, "worker", "-l", "INFO", "-c", "1", "-Q", env["MOTIR_QUEUE"],
           "-n", f"newcomer-{uuid.uuid4().hex[:6]}@%h", "--without-gossip", "--without-mingle"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "ready." not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the worker did not start (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield log
    finally:
        stop_group(proc)


@contextmanager
def on_path(folder: Path) -> Iterator[None]:
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))


def test_job_modules_import_from_the_current_folder_without_pythonpath(engine, broker_url, tmp_path):  # type: ignore[no-untyped-def]
    _write(tmp_path, {
        "cwdapp/__init__.py": "",
        "cwdapp/jobs.py": """
            from motir_celery import define_job

            @define_job("friction.from-cwd", event="friction.cwd")
            def from_cwd(event, step):
                return step.run("hello", lambda: "hello from " + __name__)
        """,
    })
    env = _newcomer_env(MOTIR_IMPORTS="cwdapp.jobs")
    with console_worker(tmp_path, "motir_celery", env) as log:
        assert "motir.friction.from-cwd" in log.read_text()  # imported from the folder, no PYTHONPATH=.
        with on_path(tmp_path):
            import cwdapp.jobs  # noqa: F401  (this process sends the event: it knows the job too)
        from motir_celery import send_event

        (run_id,) = send_event("friction.cwd", {}).run_ids
        wait_for(lambda: run_state(engine, run_id) == "succeeded", what="the job from the current folder")


def test_attach_in_a_module_whose_tasks_the_jobs_import_is_not_circular(engine, broker_url, tmp_path):  # type: ignore[no-untyped-def]
    _write(tmp_path, {
        "circproj/__init__.py": "",
        "circproj/celery.py": """
            import os

            from celery import Celery

            import motir_celery

            app = Celery("circproj", broker=os.environ["CELERY_BROKER_URL"])
            app.conf.task_default_queue = os.environ["MOTIR_QUEUE"]
            motir_celery.attach(app)


            @app.task(name="circproj.notify")   # defined after attach(); the job module imports it
            def notify(n):
                return n * 2
        """,
        "circproj/jobs.py": """
            from circproj.celery import notify
            from motir_celery import define_job

            @define_job("friction.circular", event="friction.circular")
            def circular(event, step):
                return step.run("notify", notify, event.data["n"])
        """,
    })
    env = _newcomer_env(MOTIR_IMPORTS="circproj.jobs")
    # The app module alone imports cleanly (attach() no longer imports the job modules at once).
    subprocess.run([sys.executable, "-c", "import circproj.celery"], cwd=tmp_path, env=env, check=True, timeout=60)
    from motir_celery import send_event
    from motir_celery.core.current import make_current, peek

    publishing_through = peek()
    os.environ["MOTIR_IMPORTS"] = "circproj.jobs"
    from motir_celery.settings import reset_settings

    reset_settings()
    try:
        with console_worker(tmp_path, "circproj", env) as log, on_path(tmp_path):
            assert "motir.friction.circular" in log.read_text() and "circproj.notify" in log.read_text()
            import circproj.celery  # noqa: F401  (attach: the current engine now; jobs on first send)

            (run_id,) = send_event("friction.circular", {"n": 21}).run_ids  # the producer imported the jobs
            wait_for(lambda: run_state(engine, run_id) == "succeeded", what="the job that imports a task")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT result FROM job_queue WHERE id = :r"), {"r": run_id}).scalar() == 42
    finally:
        os.environ.pop("MOTIR_IMPORTS", None)
        reset_settings()
        make_current(publishing_through)


def test_a_retrying_attempt_is_retry_in_flower_and_sends_no_extra_message(engine, broker_url, tmp_path):  # type: ignore[no-untyped-def]
    """What Flower shows, from the events Flower reads (a celery.events.State, as Flower keeps)."""
    from celery.events.state import State

    import tests.fixtures.jobs  # noqa: F401
    from motir_celery import send_event
    from motir_celery.adapter.celery_app import default_app

    app = default_app()
    state = State()
    seen: list[tuple[str, str]] = []  # (task id, event type), in order

    def record(event: dict) -> None:  # type: ignore[type-arg]
        if event.get("uuid"):
            seen.append((event["uuid"], event["type"]))
        state.event(event)

    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(conn, handlers={"*": record})
        listening = threading.Thread(target=receiver.capture, kwargs={"limit": None, "timeout": None}, daemon=True)
        listening.start()
        try:
            with celery_worker(tmp_path, broker=broker_url) as worker:
                app.control.enable_events(destination=[worker.nodename])  # what Flower does at start
                wait_for(lambda: worker.nodename in state.workers, what="the worker's events")
                (flaky,) = send_event("test.flaky", {}).run_ids      # attempt 1 fails, attempt 2 succeeds
                (doomed,) = send_event("test.doomed", {}).run_ids    # 2 attempts, both fail: DLQ
                wait_for(lambda: run_state(engine, flaky) == "succeeded" and run_state(engine, doomed) == "failed",
                         what="both runs to end")

                def endings(run_id: object) -> list[str]:
                    # Every message of a run has the run's id as its task id: one task in Flower,
                    # whose events say each attempt's ending.
                    return [t for i, t in list(seen) if i == str(run_id) and t in ("task-retried", "task-succeeded",
                                                                                   "task-failed")]

                wait_for(lambda: endings(flaky) == ["task-retried", "task-succeeded"]
                         and endings(doomed) == ["task-retried", "task-failed"], timeout=10,
                         what=f"RETRY then the end in the events (have {endings(flaky)}, {endings(doomed)})")
                assert state.tasks[str(flaky)].state == "SUCCESS" and state.tasks[str(doomed)].state == "FAILURE"
        finally:
            receiver.should_stop = True
            listening.join(timeout=5)
    # One message per attempt: raising Retry made Celery send nothing of its own.
    with engine.connect() as conn:
        assert conn.execute(text("SELECT attempts FROM job_queue WHERE id = :r"), {"r": flaky}).scalar() == 2
    assert len([t for t in state.tasks.values() if t.name == "motir.test.fail-after-two"]) == 1  # one per run
    assert len([i for i, t in seen if i == str(flaky) and t == "task-received"]) == 2     # a message per attempt


def test_make_runs_closing_hints_run_as_printed(engine, broker_url, tmp_path):  # type: ignore[no-untyped-def]
    queue = f"{os.environ['MOTIR_QUEUE']}-demo"
    demo = subprocess.run([sys.executable, "-m", "motir_celery.dev.demo"], cwd=ROOT, capture_output=True, text=True,
                          env=_newcomer_env(MOTIR_QUEUE=queue), timeout=120)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    hints = demo.stdout.split("these lines run as printed, in this folder:", 1)[1]
    export, show, replay = (line.strip() for line in hints.strip().splitlines()[:3])
    assert show.startswith(".venv/bin/motir runs show ") and " dlq replay " in replay
    assert "stays queued" in hints and f"-Q {queue}" in hints  # nothing runs a replay without a worker: said so
    shell: dict[str, Any] = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}  # no motir on PATH
    shown = subprocess.run(["bash", "-c", f"{export}\n{show}"], cwd=ROOT, env=shell, capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert show.rsplit(" ", 1)[1] in shown.stdout and "succeeded" in shown.stdout
    replayed = subprocess.run(["bash", "-c", f"{export}\n{replay}"], cwd=ROOT, env=shell, capture_output=True,
                              text=True, timeout=60)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    (new_run,) = re.findall(r"new run ([0-9a-f-]{36})", replayed.stdout)
    assert run_state(engine, new_run) == "queued" and "runs when a worker" in replayed.stderr  # and says so


# --- the operator surfaces (after issue 17's edits to ops/) ---------------------------


def _motir(args: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "motir"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=90)


def test_the_cli_and_doctor_take_the_attached_app_with_dash_a(engine, broker_url, tmp_path):  # type: ignore[no-untyped-def]
    import redis

    queue = f"{os.environ['MOTIR_QUEUE']}-proj"
    _write(tmp_path, {
        "opsproj/__init__.py": "",
        "opsproj/celery.py": f"""
            from celery import Celery

            import motir_celery

            app = Celery("opsproj", broker={broker_url!r})   # the broker is the app's, not the environment's
            app.conf.task_default_queue = {queue!r}
            motir_celery.attach(app)
        """,
        "opsproj/jobs.py": """
            from motir_celery import define_job

            @define_job("friction.ops", event="friction.ops")
            def ops(event, step):
                return "ok"
        """,
    })
    env = _newcomer_env(MOTIR_IMPORTS="opsproj.jobs")
    env.pop("CELERY_BROKER_URL", None)
    env.pop("MOTIR_QUEUE", None)
    bare = _motir(["doctor", "--timeout", "2"], cwd=tmp_path, env=env)
    assert re.search(r"FAIL\s+broker\s+CELERY_BROKER_URL is not set", bare.stdout), bare.stdout
    doctor = _motir(["-A", "opsproj", "doctor", "--timeout", "2"], cwd=tmp_path, env=env)
    assert re.search(r"OK\s+broker\s+reachable", doctor.stdout), doctor.stdout + doctor.stderr
    assert f"celery -A opsproj worker -Q {queue}" in doctor.stdout  # the workers check: the app's queue
    jobs = _motir(["-A", "opsproj", "jobs"], cwd=tmp_path, env=env)  # from the folder, no PYTHONPATH
    assert jobs.returncode == 0 and "friction.ops" in jobs.stdout, jobs.stdout + jobs.stderr
    redis.Redis.from_url(broker_url).delete(queue)
    sent = _motir(["-A", "opsproj", "send", "friction.ops"], cwd=tmp_path, env=env)
    assert sent.returncode == 0 and "1 run(s) queued" in sent.stdout, sent.stdout + sent.stderr
    assert redis.Redis.from_url(broker_url).llen(queue) == 1  # published through the app's broker and queue
    redis.Redis.from_url(broker_url).delete(queue)
    missing = _motir(["-A", "nosuchproj", "jobs"], cwd=tmp_path, env=env)
    assert missing.returncode != 0 and "nosuchproj" in missing.stderr and "Traceback" not in missing.stderr


def test_purge_older_than_0d_counts_in_a_dry_run_and_refuses_a_real_purge(engine, tmp_path):  # type: ignore[no-untyped-def]
    env = _newcomer_env()
    dry = _motir(["purge", "--older-than", "0d", "--dry-run", "--json"], cwd=ROOT, env=env)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    real = _motir(["purge", "--older-than", "0d"], cwd=ROOT, env=env)
    assert real.returncode != 0 and "--dry-run" in real.stderr and "Traceback" not in real.stderr


def test_the_dashboards_local_mode_lets_a_developer_in_on_loopback_only(database_url):  # type: ignore[no-untyped-def]
    import pytest
    from starlette.testclient import TestClient

    from motir_celery.errors import ConfigurationError
    from motir_celery.ops.dashboard import DashboardConfig, create_app
    from motir_celery.ops.dashboard.app import check_bind
    from motir_celery.ops.dashboard.auth import AuthConfig
    from motir_celery.settings import get_settings
    from tests.fixtures.engines import holding

    config = DashboardConfig(auth=AuthConfig.from_env({"MOTIR_DASHBOARD_AUTH": "local"}), secret="s")
    app = create_app(config, engine=holding())
    page = TestClient(app, client=("127.0.0.1", 50000), base_url="http://127.0.0.1:8089").get("/runs")
    assert page.status_code == 200 and "local mode" in page.text.lower()  # labelled on the page
    assert "all workspaces" in page.text
    # Not from another host, nor through a name that is not loopback (DNS rebinding).
    assert TestClient(app, client=("10.1.2.3", 50000), base_url="http://127.0.0.1:8089").get("/runs").status_code == 403
    assert TestClient(app, client=("127.0.0.1", 50000), base_url="http://evil.example").get("/runs").status_code == 403
    # Never bound anywhere but loopback, whatever else is configured.
    for host in ("0.0.0.0", "192.168.1.10", "::"):
        with pytest.raises(ConfigurationError, match="local"):
            check_bind(host, config, get_settings())
    check_bind("127.0.0.1", config, get_settings())
    refused = _motir(["dashboard", "--local", "--host", "0.0.0.0"], cwd=ROOT, env=_newcomer_env())
    assert refused.returncode != 0 and "local" in refused.stderr and "Traceback" not in refused.stderr
