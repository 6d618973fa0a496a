"""The peers' virtualenv, ``bench/.peers-venv``: Procrastinate and DBOS, never in the project's dependencies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import harness as h

ROOT = h.ROOT
VENV = ROOT / "bench" / ".peers-venv"
REQUIREMENTS = ["procrastinate==3.10.0", "dbos==3.4.0", "psycopg[binary]==3.3.9"]
PYTHON = VENV / "bin" / "python"


def ensure(*, quiet: bool = False) -> Path:
    """The venv's python; made with ``python -m venv`` and the pinned peers pip-installed, once (a
    marker file records what was installed)."""
    marker = VENV / "bench-requirements.txt"
    wanted = "\n".join(REQUIREMENTS) + "\n"
    if PYTHON.exists() and marker.exists() and marker.read_text() == wanted:
        return PYTHON
    if not quiet:
        print(f"creating {VENV.relative_to(ROOT)} with {', '.join(REQUIREMENTS)} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    subprocess.run([str(PYTHON), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *REQUIREMENTS],
                   check=True)
    marker.write_text(wanted)
    return PYTHON


def versions() -> dict[str, str]:
    out = subprocess.run(
        [str(PYTHON), "-c", "import importlib.metadata as m, json; "
         "print(json.dumps({p: m.version(p) for p in ('procrastinate', 'dbos', 'psycopg')}))"],
        capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout)


def run(module: str, *args: str, timeout: float = 1800) -> dict[str, Any]:
    """One of ``bench.peers.*`` run with the venv's python: the JSON object it prints last."""
    proc = subprocess.run([str(PYTHON), "-m", module, *map(str, args)], capture_output=True, text=True,
                          env=h.child_env(), cwd=ROOT, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(map(str, args))} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
