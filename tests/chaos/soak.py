"""The chaos soak: every scenario of ``tests/chaos/scenarios.py`` at full size; regenerates docs/reliability.md.

    python -m tests.chaos.soak [--only sigkill,redis] [--scale 0.2 --report /tmp/r.md]

Needs MOTIR_DATABASE_URL (the soak's database is made and dropped there) and the binaries
the scenarios start privately: ``redis-server``, Postgres's ``initdb``/``pg_ctl``,
``rabbitmq-server``. Exit status 1 when a scenario broke an invariant.
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
from typing import Any

from tests.chaos import scenarios
from tests.chaos.harness import ROOT, Result, create_database, drop_database, render_report

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
DOC = ROOT / "docs" / "reliability.md"
FOUND = "## What the scenarios found"  # its numbered list is kept from one report to the next
_FLOORS = {"runs": 20, "slow": 4, "poisons": 2, "seconds": 12.0, "fault_window": 10.0}


def findings(doc: Path) -> list[str]:
    text = doc.read_text() if doc.exists() else ""
    part = text.split(FOUND, 1)[1].split("\n## ", 1)[0] if FOUND in text else ""
    return [m.group(1) for m in re.finditer(r"^\d+\. (.+)$", part, re.M)]


def scaled(kwargs: dict[str, Any], scale: float) -> dict[str, Any]:
    out = dict(kwargs)
    for key, floor in _FLOORS.items():
        if key in out and scale < 1:
            value = max(out[key] * scale, floor)
            out[key] = int(value) // 2 * 2 if isinstance(kwargs[key], int) else type(kwargs[key])(value)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.soak", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated scenario names: " + ", ".join(n for n, _ in FULL))
    parser.add_argument("--scale", type=float, default=1.0, help="shrink runs and durations (default 1 = full)")
    parser.add_argument("--report", default=str(DOC), help="where to write the report")
    parser.add_argument("--keep-logs", action="store_true", help="keep every process log (printed folder)")
    args = parser.parse_args(argv)
    if not os.environ.get("MOTIR_DATABASE_URL"):
        parser.error("set MOTIR_DATABASE_URL (a Postgres server; the soak makes and drops its database there)")
    wanted = {n.strip() for n in args.only.split(",") if n.strip()}
    if unknown := wanted - {n for n, _ in FULL}:
        parser.error(f"unknown scenarios: {sorted(unknown)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("sqlalchemy", "celery", "kombu", "amqp", "alembic", "motir_celery"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    from motir_celery.settings import reset_settings

    server, name = os.environ["MOTIR_DATABASE_URL"], f"motir_soak_{uuid.uuid4().hex[:6]}"
    os.environ["MOTIR_DATABASE_URL"] = url = create_database(server, name)
    reset_settings()
    workdir = Path(tempfile.mkdtemp(prefix="motir-soak-"))
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t0, results = time.monotonic(), []
    try:
        base = scenarios.Base(url, workdir)
        for scenario, kwargs in FULL:
            if wanted and scenario not in wanted:
                continue
            kw = scaled(kwargs, args.scale)
            print(f"\n=== {scenario} {kw}", flush=True)
            try:
                result = scenarios.ALL[scenario](base, **kw)
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
    command = "python -m tests.chaos.soak" + (f" --only {args.only}" if args.only else "") + (
        f" --scale {args.scale}" if args.scale != 1 else "")
    machine = f"{os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.system()}"
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    Path(args.report).write_text(render_report(results, command=command, started=started, total=total,
                                               machine=machine, findings=findings(DOC)))
    print(f"\nwrote {args.report} ({total / 60:.1f} min)")
    for r in results:
        if not r.ok:
            print(f"FAILED: {r.summary()}", file=sys.stderr)
    return 1 if any(not r.ok for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
