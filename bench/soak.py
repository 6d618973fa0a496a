"""The chaos soak: every scenario of issue 6 at full size; regenerates docs/reliability.md.

    python -m bench.soak                      # all scenarios, ~15 min on 2 cores; writes docs/reliability.md
    python -m bench.soak --only sigkill,redis  # a subset (the report then lists only those)
    python -m bench.soak --scale 0.2 --report /tmp/r.md   # a quick, smaller pass

Needs ``MOTIR_DATABASE_URL`` (a Postgres server: the soak creates and drops a
database of its own there) and the binaries the scenarios start privately:
``redis-server``, PostgreSQL's ``initdb``/``pg_ctl`` and ``rabbitmq-server``. The
machine's Redis, RabbitMQ and Postgres server are never restarted. The scenarios
live in ``tests/chaos/scenarios.py`` (the test suite runs shortened versions);
exit status 1 when any scenario broke an invariant.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.chaos import scenarios  # noqa: E402
from tests.chaos.harness import Result, create_database, drop_database, render_report  # noqa: E402

#: Full size of each scenario: (name in ALL, keyword arguments). ``--scale`` shrinks
#: the counts and durations (never below what makes the scenario meaningful).
FULL: list[tuple[str, dict[str, Any]]] = [
    ("sigkill", {"runs": 1000, "workers": 3, "rate": 20.0, "kill_every": (2.0, 4.0), "fault_window": 90.0,
                 "freeze_every": (6.0, 10.0)}),
    ("sigterm", {"runs": 400, "slow": 40, "workers": 3, "rate": 10.0, "term_every": (4.0, 7.0), "fault_window": 60.0}),
    ("redis", {"runs": 600, "workers": 3, "rate": 15.0, "restarts": 2, "down_for": 3.0}),
    ("rabbitmq", {"runs": 600, "workers": 3, "rate": 15.0, "restarts": 2, "down_for": 3.0}),
    ("postgres", {"runs": 600, "workers": 3, "rate": 15.0, "down_for": 3.0}),
    ("duplicates", {"runs": 400, "long_every": 10, "workers": 3, "rate": 15.0}),
    ("beats", {"seconds": 120.0, "beats": 3, "workers": 2}),
    ("poison", {"poisons": 5, "runs": 300, "workers": 2, "rate": 15.0}),
    ("clock", {"runs": 200, "workers": 3, "rate": 10.0, "kill_every": (3.0, 5.0), "fault_window": 40.0}),
    ("bad_input", {"runs": 200, "workers": 2, "rate": 20.0}),
    ("tenancy", {"runs": 600, "readers": 3, "workers": 3, "rate": 20.0}),
]

#: Engine bugs the scenarios found, and where they are fixed (docs/reliability.md lists them).
FINDINGS = [
    "**A worker frozen between two steps re-ran a stored step** (scenario 1 with frozen workers: a body "
    "started 0.4 s after another worker had stored it). The store after a body is fenced, the body was not: a "
    "worker SIGSTOPped past its lease was reclaimed, the run finished elsewhere, and the thawed worker started "
    "the next body before its store was refused. Fix: `Step._still_held` (steps.py) renews the lease, fenced, "
    "before a body whenever more than a heartbeat period (lease/3) passed since the attempt last heard from the "
    "database; refused means lost and the body does not start. Regression: tests/chaos/test_chaos_zombie.py "
    "and scenario 1.",
    "**`send_event` raised after committing when the broker was down** (scenario 3, Redis down 3 s): the "
    "caller was told the event failed although it and its runs were recorded; a retry without an idempotency "
    "key would have created them twice. Fix: publishing after a commit is best effort everywhere "
    "(`publish.publish_or_log`: send_event, dispatch, DLQ replay, retry re-publish, sweeper); a refused "
    "publish is logged and the sweeper publishes the run after `MOTIR_REPUBLISH_AFTER`. The sweeper and "
    "send_event stop at the first refused publish instead of waiting out the broker retries once per run.",
    "**`create_app(settings)` published to `$CELERY_BROKER_URL`, not to `settings.broker_url`** (scenario 3: "
    "every message of the workload went to the machine's Redis, and only the sweeper's re-publishes reached "
    "the scenario's broker). Celery reads the variable before its `broker_url` setting; `create_app` now sets "
    "`broker_read_url`/`broker_write_url`, which Celery consults first. Regression: "
    "tests/chaos/test_chaos_broker.py.",
    "**A malformed run id was echoed whole into the worker log and task result** (scenario 9: a 2 MB argument "
    "became a 2 MB log line). Now at most 100 characters (runner.py). Regression: scenario 9 in the suite.",
]

_SCALED = {"runs": 20, "slow": 4, "poisons": 2, "seconds": 12.0, "fault_window": 10.0}


def _scaled(kwargs: dict[str, Any], scale: float) -> dict[str, Any]:
    if scale >= 1:
        return kwargs
    out = dict(kwargs)
    for key, floor in _SCALED.items():
        if key in out:
            value = max(out[key] * scale, floor)
            out[key] = type(kwargs[key])(value) if not isinstance(kwargs[key], int) else int(value) // 2 * 2
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated scenario names: " + ", ".join(n for n, _ in FULL))
    parser.add_argument("--scale", type=float, default=1.0, help="shrink runs and durations (default 1 = full)")
    parser.add_argument("--report", default=str(ROOT / "docs" / "reliability.md"), help="where to write the report")
    parser.add_argument("--keep-logs", action="store_true", help="keep every process log (printed folder)")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("sqlalchemy", "celery", "kombu", "amqp", "alembic", "motir_celery"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    server = os.environ.get("MOTIR_DATABASE_URL")
    if not server:
        print("MOTIR_DATABASE_URL is not set: the soak needs a Postgres server to create its database on",
              file=sys.stderr)
        return 3
    wanted = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = set(wanted) - {n for n, _ in FULL}
    if unknown:
        parser.error(f"unknown scenarios: {sorted(unknown)}")
    plan = [(n, kw) for n, kw in FULL if not wanted or n in wanted]

    from motir_celery.settings import reset_settings

    name = f"motir_soak_{uuid.uuid4().hex[:6]}"
    url = create_database(server, name)
    os.environ["MOTIR_DATABASE_URL"] = url
    reset_settings()
    workdir = Path(tempfile.mkdtemp(prefix="motir-soak-"))
    started = datetime.now(timezone.utc)
    t0 = time.monotonic()
    results: list[Result] = []
    try:
        base = scenarios.Base(url, workdir)
        for scenario, kwargs in plan:
            fn: Callable[..., Result] = scenarios.ALL[scenario]
            kw = _scaled(kwargs, args.scale)
            print(f"\n=== {scenario} {kw}", flush=True)
            try:
                result = fn(base, **kw)
            except Exception as exc:  # noqa: BLE001 — one broken scenario must not hide the others
                logging.exception("scenario %s crashed", scenario)
                result = Result("?", f"{scenario} (crashed)", 0, 0, 0, "-", 0, 0, 0, 0, 0, 0, 0.0,
                                problems=[f"{type(exc).__name__}: {exc}"])
            print(result.summary(), flush=True)
            results.append(result)
    finally:
        os.environ["MOTIR_DATABASE_URL"] = server
        drop_database(server, name)
        if args.keep_logs:
            print(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    total = time.monotonic() - t0
    command = "python -m bench.soak" + (f" --only {args.only}" if args.only else "") + (
        f" --scale {args.scale}" if args.scale != 1 else "")
    machine = f"{os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.system()}"
    report = render_report(results, command=command, started=started.strftime("%Y-%m-%d %H:%M UTC"),
                           total=total, machine=machine, findings=FINDINGS)
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    Path(args.report).write_text(report)
    print(f"\nwrote {args.report} ({total / 60:.1f} min)")
    bad = [r for r in results if not r.ok]
    for r in bad:
        print(f"FAILED: {r.summary()}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
