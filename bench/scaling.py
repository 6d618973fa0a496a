"""Regenerate every table of docs/scaling.md (issue 19): one command, the sections one after another.

    python -m bench.scaling [--only fleet,sweepers] [-- --no-write]

Each section is ``python -m bench.<name>`` in a child process (arguments after ``--`` go to every
one) and rewrites only its own block; never two at once: each measures the machine.
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
    if unknown := sorted(set(chosen) - set(SECTIONS)):
        parser.error(f"--only: unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    log, failed = h.logger("scaling"), []
    for name in chosen:
        started = time.monotonic()
        log(f"python -m bench.{name}")
        rc = subprocess.run([sys.executable, "-m", f"bench.{name}", *args.rest], cwd=h.ROOT, env=h.child_env()).returncode
        log(f"bench.{name} exited {rc} after {time.monotonic() - started:.0f} s")
        failed += [name] * bool(rc)
    if failed:
        log(f"FAILED: {', '.join(failed)} (their blocks in docs/scaling.md were left as they were)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
