"""Regenerate every table of docs/scaling.md (issue 19): one command, one after another.

    python -m bench.scaling                     # fleet, sweepers, pgcost, retention (~1 h)
    python -m bench.scaling --only fleet,sweepers

Each section is its own module, run here as ``python -m bench.<name>`` in a child
process, and rewrites only its block of docs/scaling.md (``harness.write_block``),
so one section can be re-run alone; arguments after ``--`` go to every section
(``-- --no-write``). They run in sequence, never together: each
measures the machine, and two at once would measure each other. Needs
``MOTIR_DATABASE_URL`` (the server the fleet and sweepers benches create their database
on), ``CELERY_BROKER_URL`` and Debian's ``pgbouncer`` and Postgres 15 server binaries
(pgcost and retention start private servers). Not part of pass/fail.
"""

from __future__ import annotations

import subprocess
import sys
import time

from bench import harness as h

SECTIONS = ("fleet", "sweepers", "pgcost", "retention")


def main(argv: list[str] | None = None) -> int:
    parser = h.parser("bench.scaling", __doc__, write=None)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("rest", nargs="*", help="arguments for every section, after --")
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"--only: unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    failed = []
    for name in chosen:
        started = time.monotonic()
        print(f"scaling: python -m bench.{name}", file=sys.stderr, flush=True)
        rc = subprocess.run([sys.executable, "-m", f"bench.{name}", *args.rest], cwd=h.ROOT, env=h.child_env()).returncode
        print(f"scaling: bench.{name} exited {rc} after {time.monotonic() - started:.0f} s", file=sys.stderr)
        if rc != 0:
            failed.append(name)
    if failed:
        print(f"scaling: FAILED: {', '.join(failed)} (their blocks in docs/scaling.md were left as they were)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
