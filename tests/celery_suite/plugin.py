"""The pytest plugin the runner loads into Celery's suite (``-p tests.celery_suite.plugin``).

It changes how the suite is *run*, never what it tests:

* **The worker is a real process.** Celery's ``t/integration/conftest.py`` imports
  ``celery_session_worker`` from ``celery.contrib.pytest`` (a worker in a thread of the test
  process). A conftest above Celery's cannot override it: pytest prefers the fixture defined
  closest to the test, and the imported name *is* defined in Celery's conftest. So this plugin,
  loaded before any conftest, replaces the attribute that import reads: the fixture Celery's
  conftest gets does what Celery's did for the app (import ``celery_includes``, register
  ``celery_class_tasks``) and then pings the runner's ``celery worker -P prefork`` instead of
  starting one. No worker answering fails the test, with the worker's name.
* **durable variant**: ``motir_celery.attach(app)`` on each app the suite makes (the session
  app and each test's ``celery_app``), right where ``celery.contrib.pytest`` has made it.
* **Bounds**: no attempt of a test runs longer than ``--suite-test-timeout`` seconds (a tighter
  ``@pytest.mark.timeout`` of the test's own stays), and a ``flaky`` test is re-run at most
  ``--suite-reruns`` times (Celery marks many with ``reruns=5`` and 300 s: unbounded, one
  hanging test would cost half an hour). Both markers are added in front of the test's own.
* **Outcomes**: one line per test in a JSON file (``--suite-results``): its final outcome,
  the first line of its failure, how many attempts it took.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Generator, Iterator

import celery.contrib.pytest as celery_pytest
import pytest
from celery import Celery


def _first_line(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr: Any = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
        text = str(longrepr[2])
    elif getattr(longrepr, "reprcrash", None) is not None:
        text = str(longrepr.reprcrash.message)
    else:
        text = str(longrepr)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    # A crash message is the exception's first line; a bare traceback text ends with it.
    return (lines[0] if getattr(longrepr, "reprcrash", None) is not None else lines[-1]) if lines else ""


@dataclass
class Outcome:
    nodeid: str
    outcome: str = "passed"  # passed failed error skipped xfailed xpassed
    message: str = ""  # the first line of the failure (or of the skip's reason)
    attempts: int = 1
    seconds: float = 0.0  # wall time of all its attempts


class Recorder:
    """Folds pytest's reports (setup/call/teardown, subtests, reruns) into one outcome per test."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.collected: list[str] = []
        self.tests: dict[str, Outcome] = {}
        self.collect_errors: list[dict[str, str]] = []

    def _set(self, test: Outcome, outcome: str, report: pytest.TestReport) -> None:
        rank = ["passed", "xpassed", "skipped", "xfailed", "error", "failed"]
        if rank.index(outcome) > rank.index(test.outcome):
            test.outcome, test.message = outcome, _first_line(report)

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        test = self.tests.setdefault(report.nodeid, Outcome(report.nodeid))
        outcome: str = report.outcome  # pytest-rerunfailures adds "rerun" to pytest's three
        if outcome == "rerun":  # this attempt failed, another starts
            test.outcome, test.message, test.attempts = "passed", "", test.attempts + 1
            return
        xfail = hasattr(report, "wasxfail")
        if report.failed:
            self._set(test, "failed" if report.when == "call" else "error", report)
        elif report.skipped:
            self._set(test, "xfailed" if xfail else "skipped", report)
        elif report.passed and xfail and report.when == "call":
            self._set(test, "xpassed", report)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, object, object]:
        started = time.monotonic()
        try:
            return (yield)
        finally:
            if item.nodeid in self.tests:
                self.tests[item.nodeid].seconds = round(time.monotonic() - started, 1)
            self.write()  # the runner reads it for its progress line

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collect_errors.append({"nodeid": report.nodeid, "message": _first_line(report)})

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.collected = [item.nodeid for item in session.items]
        self.write()  # the list survives a pytest that is killed later

    def write(self) -> None:
        data = {"collected": self.collected, "tests": [asdict(t) for t in self.tests.values()],
                "collect_errors": self.collect_errors}
        # Whole or not at all: the runner reads the file while this process rewrites it.
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(data, indent=1))
        os.replace(partial, self.path)

    def pytest_sessionfinish(self) -> None:  # also after a KeyboardInterrupt (the runner's budget)
        self.write()


class DurableApps:
    """The durable variant's ``attach(app)``, on every app the suite makes."""

    @pytest.fixture(scope="session", autouse=True)
    def _attach_session_app(self, celery_session_app: Celery) -> None:
        import motir_celery

        motir_celery.attach(celery_session_app)

    @pytest.fixture(autouse=True)
    def _attach_test_app(self, celery_app: Celery) -> None:
        import motir_celery

        motir_celery.attach(celery_app)


@pytest.fixture(scope="session", name="celery_session_worker")
def external_worker(
    celery_session_app: Celery, celery_includes: Any, celery_class_tasks: Any
) -> Iterator[list[dict[str, Any]]]:
    """Stands in for ``celery.contrib.pytest.celery_session_worker``: the app as Celery's fixture
    leaves it, and the runner's worker (``celery -A tests.celery_suite.worker_app worker``) alive."""
    for module in celery_includes:
        celery_session_app.loader.import_task_module(module)
    for task in celery_class_tasks:
        celery_session_app.register_task(task)
    replies: list[dict[str, Any]] = celery_session_app.control.ping(timeout=5.0) or []
    if not replies:
        pytest.fail(f"no Celery worker answers a ping on {celery_session_app.conf.broker_url}: the runner's "
                    "`celery worker -P prefork` died (see its log under .motir/celery-suite/logs)")
    yield replies


# Read by Celery's conftest at its import (`from celery.contrib.pytest import celery_session_worker`),
# which comes after this plugin's. See the module docstring.
celery_pytest.celery_session_worker = external_worker


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("celery-suite", "tests/celery_suite (make celery-suite)")
    group.addoption("--suite-variant", choices=("plain", "durable"), required=True)
    group.addoption("--suite-results", type=Path, required=True, help="the JSON file of outcomes written")
    group.addoption("--suite-test-timeout", type=float, default=90.0, help="seconds an attempt may take")
    group.addoption("--suite-reruns", type=int, default=1, help="reruns a flaky-marked test gets at most")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(Recorder(config.getoption("--suite-results")), "celery-suite-recorder")
    if config.getoption("--suite-variant") == "durable":
        config.pluginmanager.register(DurableApps(), "celery-suite-durable")


def _marker_value(marker: pytest.Mark | None, key: str, default: float) -> float:
    if marker is None:
        return default
    value = marker.kwargs.get(key, marker.args[0] if marker.args else default)
    return float(value if value is not None else default)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    timeout = config.getoption("--suite-test-timeout")
    reruns = config.getoption("--suite-reruns")
    for item in items:
        own = _marker_value(item.get_closest_marker("timeout"), "timeout", 0.0)
        if own <= 0 or own > timeout:  # 0: pytest-timeout's "no timeout"
            item.add_marker(pytest.mark.timeout(timeout), append=False)
        flaky = item.get_closest_marker("flaky")
        if flaky is not None and _marker_value(flaky, "reruns", 1) > reruns:
            delay = flaky.kwargs.get("reruns_delay", flaky.args[1] if len(flaky.args) > 1 else 0)
            item.add_marker(pytest.mark.flaky(reruns=reruns, reruns_delay=delay), append=False)
