"""Every SQL statement of the package, one module per audience (the catalogue: ``catalogue()``).

Each module here is an audience: it says who sends its statements (``AUDIENCE``, and
``ROLES``: the database roles that run them) and holds them as module-level
``Statement`` constants, each with the function that sends it. ``catalogue()`` finds
them by walking the modules, so there is no registry to forget: a statement added to
an audience module is listed (``motir doctor --statements``, docs/statements.md), and
one defined anywhere else in the package fails tests/test_structure.py.

A statement lives in one module: another audience that sends it imports the module
(``from motir_celery.store.sql import producer``; ``producer.db_now(...)``), never the
constant itself, so it is listed once, under its home.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections import Counter
from dataclasses import dataclass
from types import ModuleType

from motir_celery.store.driver import Statement

__all__ = ["Entry", "audiences", "catalogue", "render_markdown", "REGENERATE"]

#: The command that rewrites docs/statements.md from the catalogue.
REGENERATE = "python -m motir_celery.store.sql > docs/statements.md"


@dataclass(frozen=True)
class Entry:
    """One catalogued statement, with who sends it."""

    statement: Statement
    audience: str
    roles: tuple[str, ...]
    module: str

    @property
    def name(self) -> str:
        return self.statement.name

    @property
    def doc(self) -> str:
        return self.statement.doc


def audiences() -> list[ModuleType]:
    """The audience modules of this package, by name (each must say AUDIENCE and ROLES)."""
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue  # __main__: the doc's generator, not an audience
        module = importlib.import_module(f"{__name__}.{info.name}")
        if not isinstance(getattr(module, "AUDIENCE", None), str) or not isinstance(getattr(module, "ROLES", None),
                                                                                      tuple):
            raise TypeError(f"{module.__name__} holds statements of no audience: it needs AUDIENCE and ROLES")
        found.append(module)
    return found


def catalogue() -> list[Entry]:
    """Every statement of every audience module, in module order, then in the order written.

    Raises ``ValueError`` when one statement is reachable from two modules, or two share a
    name: the catalogue lists each statement once, by a name unique in the package."""
    entries: list[Entry] = []
    home: dict[int, str] = {}
    for module in audiences():
        for attr, value in vars(module).items():
            if not isinstance(value, Statement):
                continue
            if id(value) in home:
                raise ValueError(f"{module.__name__}.{attr} is {home[id(value)]}'s statement: import the module, "
                                 "not the constant, so it is listed once")
            home[id(value)] = f"{module.__name__}.{attr}"
            entries.append(Entry(value, module.AUDIENCE, module.ROLES, module.__name__))
    twice = [name for name, n in Counter(e.name for e in entries).items() if n > 1]
    if twice:
        raise ValueError(f"statement names used twice: {', '.join(sorted(twice))}")
    return entries


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_markdown(entries: list[Entry] | None = None) -> str:
    """docs/statements.md: the catalogue as a table, with the count per audience in its header."""
    entries = catalogue() if entries is None else entries
    counts = Counter(e.audience for e in entries)
    order = list(dict.fromkeys(e.audience for e in entries))
    lines = [
        "# Statements",
        "",
        "<!-- Generated from the catalogue (motir_celery/store/sql/, `catalogue()`); do not edit by hand.",
        f"     Regenerate: {REGENERATE}",
        "     tests/test_structure.py fails when this file is stale. -->",
        "",
        f"Every SQL statement the package sends: **{len(entries)}**, in {len(order)} audiences — "
        + ", ".join(f"{a} {counts[a]}" for a in order) + ".",
        "",
        "Each is a named `Statement` in `motir_celery/store/sql/<audience>.py`, written once, with a reason per",
        "predicate in its SQL and the function that sends it right after it; `motir doctor --statements` prints",
        "the same list (`--json` too). *Roles* are the database roles that send an audience's statements.",
        "",
        "| statement | audience | roles | what it does |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{e.name}` | {e.audience} | {', '.join(e.roles)} | {_cell(e.doc)} |" for e in entries]
    return "\n".join(lines) + "\n"
