"""``python -m tests.celery_suite``: Celery's integration suite, plain and durable (``make celery-suite``).

For each variant, one after the other: a fresh copy of the suite, its Redis databases emptied,
(durable: a new migrated Postgres database), a real ``celery worker -P prefork`` started and
pinged, pytest on ``t/integration/test_canvas.py`` and ``test_tasks.py`` within a time budget,
the worker stopped. Then the table of issue 43 and the list of tests whose outcome differs.
See README.md beside this file.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from importlib.metadata import version as installed_version
from pathlib import Path
from typing import IO, Any

from tests.celery_suite import VARIANT_VAR, report
from tests.celery_suite.services import (
    DATABASES,
    Redis,
    ServiceError,
    database_server_from_env,
    fresh_database,
    redis_from_env,
)
from tests.celery_suite.source import TEST_FILES, CelerySource, SourceError, Variant, build, from_checkout, from_pypi

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("plain", "durable")
#: Seconds a started worker has to answer a ping, and a stopped one to finish its warm shutdown.
WORKER_START, WORKER_STOP = 90.0, 30.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tests.celery_suite",
        description="Celery's own t/integration/test_canvas.py and test_tasks.py against a real prefork worker "
                    "and Redis: plain Celery, then its tasks.py with durable=True on each task decorator and "
                    "motir_celery.attach(app). Prints issue 43's table; writes the tests whose outcome differs "
                    "to --report. The suite comes from the installed Celery's sdist on PyPI (downloaded once "
                    "into --cache), or from --celery-src. Needs CELERY_BROKER_URL (Redis) and, for the durable "
                    "variant, MOTIR_DATABASE_URL (make celery-suite provides both).",
    )
    p.add_argument("--celery-src", type=Path, metavar="DIR",
                   help="a Celery source tree with t/integration (a celery/celery checkout at the installed "
                        "version) instead of the PyPI sdist")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of plain,durable (default both)")
    p.add_argument("-k", dest="keyword", metavar="EXPR", help="pytest -k: a subset, for a smoke run")
    p.add_argument("--concurrency", type=int, default=2, help="the worker's prefork processes (default 2)")
    p.add_argument("--test-timeout", type=float, default=90.0,
                   help="seconds one attempt of a test may take (default 90; a test's own smaller mark stays)")
    p.add_argument("--reruns", type=int, default=1,
                   help="reruns of a test Celery marks flaky, at most (default 1; Celery's marks say up to 5)")
    p.add_argument("--budget", type=float, default=25.0,
                   help="minutes each variant's pytest may run; then it is stopped and the rest is 'not run' "
                        "(default 25)")
    p.add_argument("--cache", type=Path, default=ROOT / ".motir" / "celery-suite",
                   help="the sdist, the variants' copies, logs and results.json (default .motir/celery-suite)")
    p.add_argument("--report", type=Path, default=None,
                   help="the Markdown report: the table and every test whose outcome differs "
                        "(default <cache>/report.md; make celery-suite writes docs/celery-suite.md)")
    p.add_argument("--rerender", action="store_true",
                   help="run nothing: the table and --report again from the last run's <cache>/results.json "
                        "(after a change to features.py, say)")
    p.add_argument("--fail-under", type=float, metavar="PCT",
                   help="exit 1 when durable passes fewer than PCT %% of the tests plain Celery passes")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants or set(args.variants) - set(VARIANTS):
        p.error(f"--variants takes plain, durable or both, not {args.variants}")
    return args


@dataclass
class VariantRun:
    name: str
    results_path: Path
    seconds: float = 0.0
    incomplete: str = ""  # why some tests were not run, when they were not


def say(message: str) -> None:
    print(f"celery-suite: {message}", flush=True)


def _stop(proc: subprocess.Popen[bytes], first: signal.Signals, grace: float) -> None:
    """Signal the process group ``proc`` leads (it was started in a session of its own), then kill it."""
    if proc.poll() is None:
        os.killpg(proc.pid, first)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    try:  # the prefork children of a worker that is gone
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def start_worker(variant: Variant, env: dict[str, str], concurrency: int, log: IO[bytes]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "celery", "-A", "tests.celery_suite.worker_app", "worker", "-P", "prefork",
           "-c", str(concurrency), "-n", f"celery-suite-{variant.name}@%h", "-l", "INFO",
           "--without-heartbeat", "--without-gossip", "--without-mingle"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    # `celery inspect ping` with the worker's own app and environment: the broker the tests will use.
    # (Not a ping from this process: Celery's settings prefer this process's CELERY_BROKER_URL to a URL
    # given to the app, and that is make's, not the variant's.)
    ping = [sys.executable, "-m", "celery", "-A", "tests.celery_suite.worker_app", "inspect", "ping", "-t", "2"]
    deadline = time.monotonic() + WORKER_START
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceError(f"the {variant.name} worker exited with {proc.returncode} at start; see {log.name}")
        if subprocess.run(ping, cwd=ROOT, env=env, capture_output=True).returncode == 0:
            return proc
    _stop(proc, signal.SIGTERM, WORKER_STOP)
    raise ServiceError(f"the {variant.name} worker did not answer a ping in {WORKER_START:.0f} s; see {log.name}")


def _progress(name: str, path: Path, started: float) -> str:
    raw = report.read(path) if path.is_file() else report.Raw([], {}, [])
    c = Counter(r.outcome for r in raw.found.values())
    done = ", ".join(f"{n} {o}" for o, n in c.most_common())
    return f"{name}: {len(raw.found)}/{len(raw.collected) or '?'} tests ({done or 'starting'}), " \
           f"{(time.monotonic() - started) / 60:.1f} min"


def run_pytest(variant: Variant, env: dict[str, str], args: argparse.Namespace, run: VariantRun, log: IO[bytes]) -> None:
    cmd = [sys.executable, "-m", "pytest", "-c", "pyproject.toml", "--rootdir", ".",
           # Celery's suite and this plugin only: not the package's own test kit, no cache folder.
           "-p", "no:motir", "-p", "no:cacheprovider", "-p", "celery.contrib.pytest", "-p", "tests.celery_suite.plugin",
           "--suite-variant", variant.name, "--suite-results", str(run.results_path),
           "--suite-test-timeout", str(args.test_timeout), "--suite-reruns", str(args.reruns),
           "-ra", "--tb=short", *(["-k", args.keyword] if args.keyword else []), *TEST_FILES]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=variant.root, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = started + args.budget * 60
    try:
        while proc.poll() is None:
            try:
                proc.wait(min(60.0, max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                pass
            say(_progress(variant.name, run.results_path, started))
            if proc.poll() is None and time.monotonic() >= deadline:
                run.incomplete = f"the variant's {args.budget:g}-minute budget ran out"
                say(f"{variant.name}: {run.incomplete}; stopping pytest (the tests left are 'not run')")
                proc.send_signal(signal.SIGINT)  # pytest still writes the results of the tests it ran
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    pass
                break
    finally:
        _stop(proc, signal.SIGKILL, 0)
        run.seconds = time.monotonic() - started
    if proc.returncode not in (0, 1, 2, -signal.SIGINT, -signal.SIGKILL) and not run.incomplete:
        # 0 all passed, 1 some failed, 2 interrupted; anything else: pytest itself broke
        run.incomplete = f"pytest exited with {proc.returncode}"
        say(f"{variant.name}: {run.incomplete}; see {log.name}")


def variant_env(variant: Variant, redis: Redis, database_url: str | None) -> dict[str, str]:
    broker_db, backend_db = DATABASES[variant.name]
    env = {k: v for k, v in os.environ.items() if k not in ("MOTIR_DATABASE_URL", "CELERY_RESULT_BACKEND")}
    env.update(
        TEST_BROKER=redis.url(broker_db),
        TEST_BACKEND=redis.url(backend_db),
        # Celery's Settings prefer CELERY_BROKER_URL to the app's broker_url: it must be the same.
        CELERY_BROKER_URL=redis.url(broker_db),
        REDIS_HOST=redis.host,
        REDIS_PORT=str(redis.port),
        PYTHONPATH=os.pathsep.join([str(variant.root), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        **{VARIANT_VAR: variant.name},
    )
    if database_url:
        env["MOTIR_DATABASE_URL"] = database_url
    return env


def run_variant(variant: Variant, redis: Redis, db_server: str | None, args: argparse.Namespace,
                logs: Path) -> VariantRun:
    run = VariantRun(variant.name, args.cache / f"results-{variant.name}.json")
    run.results_path.unlink(missing_ok=True)
    redis.flush(*DATABASES[variant.name])
    with ExitStack() as stack:
        database_url = stack.enter_context(fresh_database(db_server)) if variant.name == "durable" and db_server else None
        env = variant_env(variant, redis, database_url)
        worker_log = stack.enter_context(open(logs / f"worker-{variant.name}.log", "wb"))
        pytest_log = stack.enter_context(open(logs / f"pytest-{variant.name}.log", "wb"))
        say(f"{variant.name}: starting `celery worker -P prefork -c {args.concurrency}` ({worker_log.name})")
        worker = start_worker(variant, env, args.concurrency, worker_log)
        try:
            say(f"{variant.name}: running pytest ({pytest_log.name})")
            run_pytest(variant, env, args, run, pytest_log)
        finally:
            if worker.poll() is not None:
                say(f"{variant.name}: the worker had exited with {worker.returncode} before the end; see "
                    f"{worker_log.name}")
            _stop(worker, signal.SIGTERM, WORKER_STOP)
    return run


def _git_head() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return (done.stdout.strip() or "unknown") + (" (with uncommitted changes)" if dirty else "")


def collect(args: argparse.Namespace, source: CelerySource, runs: dict[str, VariantRun],
            variants: dict[str, Variant]) -> dict[str, Any]:
    """The run's outcomes and what the report says about how they were measured, saved as
    <cache>/results.json (``--rerender`` reads it back)."""
    raws = {name: report.read(run.results_path) for name, run in runs.items()}
    nodeids = list(dict.fromkeys(n for raw in raws.values() for n in raw.collected))
    results = {name: report.complete(raws[name], nodeids, runs[name].incomplete or "pytest stopped before it")
               for name in runs}
    minutes = ", ".join(f"{name} {run.seconds / 60:.1f} min" for name, run in runs.items())
    preamble = [
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC at commit {_git_head()}, Celery "
        f"{installed_version('celery')} installed, its suite from {source.origin} (version {source.version}); "
        f"`t/integration/test_canvas.py` and `test_tasks.py`, {len(nodeids)} tests"
        + (f" selected by `-k {args.keyword}`" if args.keyword else "") + f"; {minutes}.",
        "",
        f"One real `celery worker -P prefork -c {args.concurrency}` per variant, Redis as broker and result "
        f"backend; an attempt of a test stopped after {args.test_timeout:g} s, a flaky-marked test re-run at most "
        f"{args.reruns} time(s). The durable variant's `tasks.py`: "
        f"{variants['durable'].decorators_changed if 'durable' in variants else 0} task decorators given "
        "`durable=True`, and `motir_celery.attach(app)` on every app the suite makes.",
        *(f"\n**{name} incomplete**: {run.incomplete}." for name, run in runs.items() if run.incomplete),
    ]
    saved = {
        "preamble": preamble,
        "runs": {name: {"seconds": run.seconds, "incomplete": run.incomplete} for name, run in runs.items()},
        "results": {name: {n: asdict(r) for n, r in res.items()} for name, res in results.items()},
    }
    (args.cache / "results.json").write_text(json.dumps(saved, indent=1))
    return saved


def summarize(args: argparse.Namespace, saved: dict[str, Any]) -> int:
    """Print the table, write the report; the exit status."""
    results = {name: {n: report.Result(**r) for n, r in res.items()} for name, res in saved["results"].items()}
    nodeids = list(dict.fromkeys(n for res in results.values() for n in res))
    empty = {n: report.Result(report.NOT_RUN, "variant not selected (--variants)", 0, 0.0) for n in nodeids}
    plain, durable = results.get("plain", empty), results.get("durable", empty)
    rows = report.table(plain, durable)
    print()
    print(report.render_text(rows))
    for name, run in saved["runs"].items():
        print(f"{name}: {report.counts(results[name])} in {run['seconds'] / 60:.1f} min"
              + (f" -- INCOMPLETE: {run['incomplete']}" if run["incomplete"] else ""))
    report_path = args.report or args.cache / "report.md"
    compared = len(results) == 2
    report.write_markdown(report_path, preamble=saved["preamble"], rows=rows, plain=plain, durable=durable,
                          compared=compared)
    if compared:
        print(f"{len(report.differing(plain, durable))} tests differ between the variants: listed in {report_path}")
    else:
        print(f"one variant run, nothing compared; the report is {report_path}")
    if args.fail_under is not None:
        passed = [n for n in nodeids if plain[n].outcome == "passed"]
        both = [n for n in passed if durable[n].outcome == "passed"]
        ratio = 100 * len(both) / len(passed) if passed else 0.0
        if ratio < args.fail_under:
            print(f"durable passes {ratio:.1f} % of plain Celery's passes, under --fail-under {args.fail_under:g}")
            return 1
    return 3 if any(run["incomplete"] for run in saved["runs"].values()) else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.cache = args.cache.resolve()
    if args.rerender:
        saved = args.cache / "results.json"
        if not saved.is_file():
            print(f"celery-suite: --rerender: no {saved} (run the suite first)", file=sys.stderr)
            return 2
        return summarize(args, json.loads(saved.read_text()))
    logs = args.cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    celery_version = installed_version("celery")
    try:
        source = from_checkout(args.celery_src) if args.celery_src else from_pypi(celery_version, args.cache)
        redis = redis_from_env()
        db_server = database_server_from_env() if "durable" in args.variants else None
    except (SourceError, ServiceError) as exc:
        print(f"celery-suite: {exc}", file=sys.stderr)
        return 2
    if source.version != celery_version:
        say(f"WARNING: the suite is Celery {source.version}'s, the installed Celery is {celery_version}")
    say(f"Celery {celery_version}'s suite from {source.origin}; Redis {redis.host}:{redis.port}")
    variants = {name: build(source, args.cache / "run" / name, name) for name in args.variants}
    if "durable" in variants:
        say(f"durable: {variants['durable'].decorators_changed} task decorators given durable=True "
            f"({variants['durable'].root / 'tasks-durable.diff'})")
    runs: dict[str, VariantRun] = {}
    try:
        for name, variant in variants.items():
            runs[name] = run_variant(variant, redis, db_server, args, logs)
    except ServiceError as exc:
        print(f"celery-suite: {exc}", file=sys.stderr)
        return 2
    return summarize(args, collect(args, source, runs, variants))


if __name__ == "__main__":
    sys.exit(main())
