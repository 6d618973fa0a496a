"""Celery's integration suite on disk: found, copied twice, and made durable in one of the copies.

Where it comes from: the sdist of the installed Celery on PyPI carries ``t/`` (5.7.0's does), so
the runner downloads it once with pip (hashes checked against the index), unpacks it under the
cache folder and reuses it on the next run. ``--celery-src DIR`` takes another checkout instead
(a git clone of celery/celery, or an unpacked sdist): its ``t/integration`` is used as it is.

What is copied into each variant's folder: Celery's ``pyproject.toml`` (its pytest settings --
``python_classes = "test_*"``, ``xfail_strict``, the markers -- without which most of the suite
is not even collected), ``t/*.py`` (the helpers the tests import, e.g. ``t/canvas_helpers.py``)
and ``t/integration/``. The durable copy differs in one file: ``t/integration/tasks.py``, where
each task decorator gets ``durable=True`` (:func:`add_durable`). Nothing else is edited; the
``attach(app)`` half of the change lives where this suite makes its apps (plugin.py, worker_app.py).
"""

from __future__ import annotations

import ast
import difflib
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final

#: The files of ``t/integration`` the runner needs; a source without one of them is refused.
REQUIRED: Final = ("conftest.py", "tasks.py", "test_canvas.py", "test_tasks.py")
#: The tests run, relative to a variant's folder.
TEST_FILES: Final = ("t/integration/test_canvas.py", "t/integration/test_tasks.py")


class SourceError(Exception):
    """Celery's suite cannot be found, downloaded or rewritten; the message says what to do."""


@dataclass(frozen=True)
class CelerySource:
    root: Path  # the folder holding pyproject.toml and t/
    version: str  # Celery's version as the source says it
    origin: str  # where it came from, for the report


def _source_version(root: Path) -> str:
    init = root / "celery" / "__init__.py"
    if init.is_file():
        for line in init.read_text().splitlines():
            if line.startswith("__version__"):
                return line.split("=", 1)[1].strip().strip("'\"")
    return "unknown"


def check_source(root: Path) -> None:
    missing = [name for name in REQUIRED if not (root / "t" / "integration" / name).is_file()]
    if missing or not (root / "pyproject.toml").is_file():
        raise SourceError(
            f"{root} is not a Celery source tree with t/integration: missing "
            f"{', '.join(['t/integration/' + m for m in missing] or ['pyproject.toml'])}"
        )


def from_checkout(root: Path) -> CelerySource:
    root = root.resolve()
    check_source(root)
    return CelerySource(root, _source_version(root), f"--celery-src {root}")


def _pip() -> list[str]:
    """pip to download with: the one beside the pinned uv (make setup's .tools), else the machine's."""
    here = Path(__file__).resolve().parents[2] / ".tools" / "bin" / "python"
    for python in (str(here), shutil.which("python3") or "", sys.executable):
        if python and subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode == 0:
            return [python, "-m", "pip"]
    raise SourceError("no pip to download Celery's sdist with (make setup provides .tools/bin/python -m pip); "
                      "or pass --celery-src DIR, a checkout of celery/celery at the installed version")


def from_pypi(version: str, cache: Path) -> CelerySource:
    """Celery ``version``'s sdist from PyPI, unpacked once under ``cache``."""
    root = cache / f"celery-{version}"
    if not (root / "t" / "integration" / "test_canvas.py").is_file():
        downloads = cache / "downloads"
        downloads.mkdir(parents=True, exist_ok=True)
        archive = downloads / f"celery-{version}.tar.gz"
        if not archive.is_file():
            print(f"celery-suite: downloading Celery {version}'s sdist from PyPI (pip download) ...", flush=True)
            done = subprocess.run(
                [*_pip(), "download", f"celery=={version}", "--no-binary", ":all:", "--no-deps",
                 "--disable-pip-version-check", "-d", str(downloads)],
                capture_output=True, text=True,
            )
            if done.returncode != 0 or not archive.is_file():
                raise SourceError(f"pip download celery=={version} --no-binary :all: failed:\n"
                                  f"{done.stdout[-2000:]}{done.stderr[-2000:]}\n"
                                  "Pass --celery-src DIR (a checkout of celery/celery at v{version}) instead.")
        unpacked = cache / f".unpack-{version}"
        shutil.rmtree(unpacked, ignore_errors=True)
        with tarfile.open(archive) as tar:
            tar.extractall(unpacked, filter="data")
        shutil.rmtree(root, ignore_errors=True)
        (unpacked / f"celery-{version}").rename(root)
        shutil.rmtree(unpacked)
        if not (root / "t" / "integration").is_dir():
            raise SourceError(f"Celery {version}'s sdist has no t/integration; pass --celery-src DIR "
                              f"(a checkout of celery/celery at v{version})")
    check_source(root)
    return CelerySource(root, version, f"PyPI sdist celery-{version}.tar.gz")


def _is_task_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return (isinstance(target, ast.Name) and target.id == "shared_task") or (
        isinstance(target, ast.Attribute) and target.attr == "task"
    )


def add_durable(source: str) -> tuple[str, int]:
    """``source`` with ``durable=True`` added to every ``@shared_task`` / ``@<app>.task`` decorator,
    and how many were changed. The edit is textual (positions from the parse), so the rest of the
    file, comments and layout included, stays byte for byte."""
    lines = source.encode().splitlines(keepends=True)
    edits: list[tuple[int, int, bytes]] = []  # (line index, byte column, text to insert)
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for deco in node.decorator_list:
            if not _is_task_decorator(deco):
                continue
            assert deco.end_lineno is not None and deco.end_col_offset is not None
            if not isinstance(deco, ast.Call):
                edits.append((deco.end_lineno - 1, deco.end_col_offset, b"(durable=True)"))
                continue
            if any(k.arg == "durable" for k in deco.keywords):
                continue
            arguments: list[ast.expr | ast.keyword] = [*deco.args, *deco.keywords]
            last = max(arguments, key=lambda n: (n.end_lineno or 0, n.end_col_offset or 0), default=None)
            if last is None:  # @shared_task(): before the closing parenthesis
                edits.append((deco.end_lineno - 1, deco.end_col_offset - 1, b"durable=True"))
            else:
                assert last.end_lineno is not None and last.end_col_offset is not None
                edits.append((last.end_lineno - 1, last.end_col_offset, b", durable=True"))
    for line, col, text in sorted(edits, reverse=True):
        lines[line] = lines[line][:col] + text + lines[line][col:]
    return b"".join(lines).decode(), len(edits)


@dataclass(frozen=True)
class Variant:
    name: str  # "plain" or "durable"
    root: Path  # pytest's rootdir and the worker's import root
    decorators_changed: int  # tasks.py decorators given durable=True (0 for plain)


def build(source: CelerySource, dest: Path, name: str) -> Variant:
    """A fresh copy of the suite at ``dest`` for variant ``name``."""
    shutil.rmtree(dest, ignore_errors=True)
    (dest / "t").mkdir(parents=True)
    shutil.copy2(source.root / "pyproject.toml", dest / "pyproject.toml")
    for helper in (source.root / "t").glob("*.py"):
        shutil.copy2(helper, dest / "t" / helper.name)
    shutil.copytree(source.root / "t" / "integration", dest / "t" / "integration",
                    ignore=shutil.ignore_patterns("__pycache__"))
    changed = 0
    if name == "durable":
        tasks = dest / "t" / "integration" / "tasks.py"
        original = tasks.read_text()
        rewritten, changed = add_durable(original)
        if changed == 0:
            raise SourceError(f"no @shared_task / @app.task decorator found in {tasks}: Celery's layout changed")
        tasks.write_text(rewritten)
        diff = difflib.unified_diff(original.splitlines(keepends=True), rewritten.splitlines(keepends=True),
                                    "a/t/integration/tasks.py", "b/t/integration/tasks.py")
        (dest / "tasks-durable.diff").write_text("".join(diff))
    return Variant(name, dest, changed)
