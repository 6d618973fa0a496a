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
import re
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

#: Where the engine bugs the scenarios found are listed (kept from one report to the next).
FOUND = "## What the scenarios found"


def findings(doc: Path) -> list[str]:
    """The numbered findings of the last report: the history stays in the doc, not here."""
    text = doc.read_text() if doc.exists() else ""
    part = text.split(FOUND, 1)[1].split("\n## ", 1)[0] if FOUND in text else ""
    return [m.group(1) for m in re.finditer(r"^\d+\. (.+)$", part, re.M)]


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
                           total=total, machine=machine,
                           findings=findings(ROOT / "docs" / "reliability.md"))
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    Path(args.report).write_text(report)
    print(f"\nwrote {args.report} ({total / 60:.1f} min)")
    bad = [r for r in results if not r.ok]
    for r in bad:
        print(f"FAILED: {r.summary()}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
