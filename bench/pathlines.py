"""How many lines the path from a message to the settle's commit takes to read: ``python -m bench.pathlines``.

The code lines (not blank, a comment, a module docstring or an import) of the definitions on that
path (``PATH``). Issue 16's budget: about 450 lines across at most 5 files.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "motir_celery"

#: file -> the top-level definitions on the path (None: the whole module).
PATH: dict[str, set[str] | None] = {
    "adapter/celery_app.py": {"run_job", "_register"},
    "core/worker/runner.py": None,
    "core/worker/steps.py": {"encode_json", "StepRun", "_SURROGATE", "SEPARATOR", "MAX_STEP_ID", "T"},
    "store/sql/worker.py": {"CLAIM", "claim", "STORE_STEP", "store_step", "SETTLE_SUCCEEDED", "settle_succeeded",
                            "SETTLE_RETRY", "settle_retry", "SETTLE_FAILED", "settle_failed", "RUN_STATE",
                            "why_fenced"},
    "store/records.py": {"Claim"},
    "store/driver.py": None,
}


def code_lines(path: Path, names: set[str] | None) -> int:
    source = path.read_text()
    tree, lines = ast.parse(source), source.splitlines()
    keep: set[int] = set()
    for i, node in enumerate(tree.body):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the module docstring
        name = getattr(node, "name", None)
        if name is None and isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        if names is None or name in names:
            keep.update(range(node.lineno - 1, node.end_lineno or node.lineno))
    return sum(1 for i in keep if lines[i].strip() and not lines[i].strip().startswith(("#", "--")))


def main() -> None:
    total = 0
    for rel, names in PATH.items():
        n = code_lines(ROOT / rel, names)
        total += n
        print(f"{n:5d}  motir_celery/{rel}")
    print(f"{total:5d}  in {len({rel.split('/')[-1] for rel in PATH})} files")


if __name__ == "__main__":
    main()
