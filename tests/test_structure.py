"""The package's shape, checked from its source (no database, no import of the code under test):

(a) SQL is written in ``motir_celery/store/`` only: no string literal outside it has the
    shape of a statement, and nothing outside it imports ``sqlalchemy.text`` or calls
    ``exec_driver_sql``;
(b) no private name (``_x``) of one module is imported by, or read as an attribute from,
    another;
(c) no import cycle between modules, counting module-level and function-local imports
    (a function-local import that hides a cycle is one); ``if TYPE_CHECKING:`` imports
    are not counted;
(d) imports point down the layers: settings/errors/forks → store → core → adapter →
    ops/contrib/dev; core and store never import celery, kombu or redis;
(e) the engine (``core/engine.py``) is the one composition root: no ``global`` statement, no
    module-global hook beyond the current-engine lookup (``core/current.py``), the settings read
    from the environment only where the engine is built, no private attribute of another
    module's object read (``step._memo``), and the core's rooms (worker, producer, operator)
    importing none of each other.

Each checker is a function over source text, and each is shown to fail on a small
synthetic snippet first (``test_checker_*``), so a check that silently passes everything
cannot hide here.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "motir_celery"

# --- reading the package ------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    module: str          # dotted name, e.g. motir_celery.store.db
    path: str            # for messages, relative to the repository
    text: str
    is_package: bool = False


def package_sources(root: Path = PACKAGE) -> list[Source]:
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found.append(Source(".".join(parts), str(path.relative_to(ROOT)), path.read_text(), is_package))
    return found


@functools.lru_cache(maxsize=None)
def parse(text: str) -> ast.Module:
    """One parse per source text (the checks below each walk every module)."""
    return ast.parse(text)


@dataclass(frozen=True)
class Import:
    """One import statement's target: ``module`` (resolved, absolute) and, for
    ``from m import n``, the name ``n``."""

    module: str
    name: str | None
    line: int
    type_checking: bool
    local: bool          # inside a function


def _resolve(source: Source, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = source.module.split(".")
    if not source.is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@functools.lru_cache(maxsize=None)
def imports_of(source: Source) -> list[Import]:
    """Every import in ``source``, each marked TYPE_CHECKING-only and/or function-local."""
    found: list[Import] = []

    def visit(node: ast.AST, type_checking: bool, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_one(stmt, True, local)
                for stmt in child.orelse:
                    visit_one(stmt, type_checking, local)
                continue
            visit_one(child, type_checking, local)

    def visit_one(node: ast.AST, type_checking: bool, local: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(alias.name, None, node.lineno, type_checking, local))
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(source, node.level, node.module)
            for alias in node.names:
                found.append(Import(module, alias.name, node.lineno, type_checking, local))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            visit(node, type_checking, True)
        else:
            visit(node, type_checking, local)

    visit(parse(source.text), False, False)
    return found


def target_modules(imp: Import, modules: set[str]) -> list[str]:
    """The package modules an import loads: ``from pkg import sub`` names the submodule
    when ``pkg.sub`` is one, else ``pkg`` itself (a name defined in it)."""
    if imp.name is not None and f"{imp.module}.{imp.name}" in modules:
        return [f"{imp.module}.{imp.name}"]
    return [imp.module] if imp.module in modules else []


# --- (a) SQL outside store/ -----------------------------------------------------------------

#: Shapes of SQL statements (upper-case keywords, as the package writes SQL). Prose and
#: help texts ("Select a run from…") are lower-case and do not match.
SQL_SHAPES = [
    re.compile(r"\bSELECT\b[\s\S]*?\bFROM\s+[\w(\"]"),
    re.compile(r"^\s*\(?\s*SELECT\s"),
    re.compile(r"\bINSERT\s+INTO\s+[\w\"]"),
    re.compile(r"\bUPDATE\s+[\w\".]+(\s+\w+)?\s+SET\b"),
    re.compile(r"\bDELETE\s+FROM\s+[\w\"]"),
    re.compile(r"\bWITH\s+(RECURSIVE\s+)?\w+\s+AS\s+(NOT\s+)?(MATERIALIZED\s+)?\("),
    re.compile(r"\bCREATE\s+(OR\s+REPLACE\s+|UNIQUE\s+|TEMP\s+|TEMPORARY\s+)*"
               r"(TABLE|INDEX|DATABASE|ROLE|USER|SCHEMA|FUNCTION|PROCEDURE|TRIGGER|POLICY|VIEW|EXTENSION|SEQUENCE|TYPE)\b"),
    re.compile(r"\bALTER\s+(TABLE|ROLE|USER|DATABASE|INDEX|FUNCTION|SCHEMA|POLICY|SEQUENCE|DEFAULT\s+PRIVILEGES|SYSTEM)\b"),
    re.compile(r"\bDROP\s+(TABLE|INDEX|ROLE|USER|DATABASE|SCHEMA|FUNCTION|PROCEDURE|TRIGGER|POLICY|VIEW|EXTENSION|"
               r"SEQUENCE|TYPE|OWNED)\b"),
    # privilege grants (GRANT SELECT ON …); "GRANT motir_admin TO alice" in a fix hint is for a human
    re.compile(r"\b(GRANT|REVOKE)\s+(ALL|SELECT|INSERT|UPDATE|DELETE|TRUNCATE|REFERENCES|TRIGGER|USAGE|EXECUTE|CREATE|"
               r"CONNECT|TEMPORARY)\b[\w\s,()]*?\bON\b"),
    re.compile(r"\bTRUNCATE\s+(TABLE\s+)?[a-z_\"]"),
    re.compile(r"^\s*SET\s+(LOCAL|SESSION)\s+\w"),
    re.compile(r"^\s*(SHOW|EXPLAIN|VACUUM|ANALYZE|LISTEN|NOTIFY|RESET|SET)\s+\w+(\s*(=|TO)\s*\S+)?\s*;?\s*$"),
]


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the Constant nodes that are docstrings (prose may quote SQL)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                found.add(id(body[0].value))
    return found


def _literal(node: ast.expr) -> str | None:
    """The text of a string literal, an f-string (``{…}`` for each hole) or a ``+`` of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else "{…}"
                       for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal(node.left), _literal(node.right)
        if left is not None or right is not None:
            return (left or "{…}") + (right or "{…}")
    return None


def sql_findings(source: Source) -> list[str]:
    """SQL text, ``sqlalchemy.text`` and ``exec_driver_sql`` in ``source``, one line each."""
    tree = parse(source.text)
    docstrings = _docstrings(tree)
    found: list[str] = []
    inner: set[int] = set()  # parts of a larger literal already looked at
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "exec_driver_sql":
            found.append(f"{source.path}:{node.lineno}: exec_driver_sql")
        if isinstance(node, ast.Attribute) and node.attr == "text" and isinstance(node.value, ast.Name) \
                and node.value.id in ("sqlalchemy", "sa"):
            found.append(f"{source.path}:{node.lineno}: {node.value.id}.text()")
        if id(node) in inner or id(node) in docstrings or not isinstance(node, ast.expr):
            continue
        text = _literal(node)
        if text is None:
            continue
        inner.update(id(n) for n in ast.walk(node) if n is not node)
        for shape in SQL_SHAPES:
            if shape.search(text):
                found.append(f"{source.path}:{node.lineno}: SQL text {' '.join(text.split())[:70]!r}")
                break
    for imp in imports_of(source):
        if imp.module == "sqlalchemy" and imp.name == "text" or imp.module in ("sqlalchemy.sql.expression",
                                                                              "sqlalchemy.sql") and imp.name == "text":
            found.append(f"{source.path}:{imp.line}: imports sqlalchemy's text()")
    return found


def outside_store(sources: Iterable[Source]) -> Iterator[Source]:
    return (s for s in sources if not (s.module + ".").startswith("motir_celery.store."))


# --- (b) private names across modules ---------------------------------------------------------


#: A named tuple's own API, public despite its underscore (Statement._replace, Claim._asdict).
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def _private(name: str) -> bool:
    """``_x``, not a dunder (``__name__``), a sunder (enum's ``_value_``) or a named tuple's API."""
    return name.startswith("_") and not name.endswith("_") and name not in NAMEDTUPLE_API


def _module_part(dotted: str, modules: set[str]) -> str:
    """The longest prefix of ``dotted`` that is a module of the package."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return dotted


def private_findings(source: Source, modules: set[str]) -> list[str]:
    """``from m import _x``, ``m._x`` (m a package module) and ``Name._x`` (Name imported from one)."""
    tree = parse(source.text)
    found: list[str] = []
    bound: dict[str, str] = {}  # local name -> what it is, in another module of the package
    for imp in imports_of(source):
        if not (imp.module == "motir_celery" or imp.module.startswith("motir_celery.")):
            continue
        if imp.name is None:
            continue  # import motir_celery.x.y: attribute chains are checked below
        if _private(imp.name):
            found.append(f"{source.path}:{imp.line}: imports {imp.name} from {imp.module}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _resolve(source, node.level, node.module)
            if module == "motir_celery" or module.startswith("motir_celery."):
                for alias in node.names:
                    bound[alias.asname or alias.name] = f"{module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("motir_celery"):
                    bound[alias.asname or alias.name.split(".")[0]] = alias.asname and alias.name or "motir_celery"
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        chain: list[str] = []
        base: ast.expr = node.value
        while isinstance(base, ast.Attribute):
            chain.insert(0, base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in bound:
            owner = ".".join([bound[base.id], *chain])
            if _module_part(owner, modules) != source.module:
                found.append(f"{source.path}:{node.lineno}: reads {node.attr} of {owner}")
    return found


# --- (c) import cycles -------------------------------------------------------------------------


def import_graph(sources: Iterable[Source]) -> dict[str, dict[str, int]]:
    """module -> {imported package module: line}, TYPE_CHECKING-only imports left out."""
    sources = list(sources)
    modules = {s.module for s in sources}
    graph: dict[str, dict[str, int]] = {s.module: {} for s in sources}
    for source in sources:
        for imp in imports_of(source):
            if imp.type_checking:
                continue
            for target in target_modules(imp, modules):
                if target != source.module:
                    graph[source.module].setdefault(target, imp.line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def describe_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    members = set(component)
    edges = [f"{a} -> {b} (line {line})" for a in component for b, line in sorted(graph[a].items()) if b in members]
    return "import cycle: " + "; ".join(edges)


# --- (d) layers --------------------------------------------------------------------------------

#: Lower layers first; a module may import its own layer and those below it.
LAYERS: list[tuple[str, ...]] = [
    ("motir_celery.settings", "motir_celery.errors", "motir_celery.forks"),
    ("motir_celery.store",),
    ("motir_celery.core",),
    ("motir_celery.adapter",),
    # the public facade (motir_celery, motir_celery.beat) and the tools on top
    ("motir_celery.ops", "motir_celery.contrib", "motir_celery.dev", "motir_celery.beat", "motir_celery"),
]
#: Third-party packages a layer must never import (the engine's core knows no broker).
FORBIDDEN = {"motir_celery.store": ("celery", "kombu", "redis"), "motir_celery.core": ("celery", "kombu", "redis")}


def layer_of(module: str) -> int:
    best, depth = -1, -1
    for n, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = n, prefix.count(".")
    assert best >= 0, module
    return best


def layer_findings(source: Source, modules: set[str]) -> list[str]:
    found: list[str] = []
    mine = layer_of(source.module)
    for imp in imports_of(source):
        for target in target_modules(imp, modules):
            if layer_of(target) > mine:
                found.append(f"{source.path}:{imp.line}: {source.module} (layer {mine}) imports {target} "
                             f"(layer {layer_of(target)}){' under TYPE_CHECKING' if imp.type_checking else ''}")
        top = imp.module.split(".")[0]
        for prefix, banned in FORBIDDEN.items():
            if (source.module + ".").startswith(prefix + ".") and top in banned:
                found.append(f"{source.path}:{imp.line}: {source.module} imports {imp.module}")
    return found


# --- (e) the engine, the one composition root ---------------------------------------------------

#: Where the settings are read from the environment: where the engine is built (an engine built
#: without settings follows the process's environment).
SETTINGS_READERS = {"motir_celery.core.engine"}
#: Module-level state a function may set from its arguments: the current-engine lookup, the job
#: registry itself (``_add``: a job, defined at import time as Celery's ``shared_task`` is) and its
#: listeners (``on_job_defined``: how an attached app learns of jobs defined later, as Celery's own
#: apps learn of ``shared_task``s).
HOOK_OWNERS = {"motir_celery.core.current": {"make_current", "use_default"},
               "motir_celery.core.jobs": {"_add", "on_job_defined"}}
#: The core's rooms, by audience: none imports another (what they share lives below them).
ROOMS = ("motir_celery.core.worker", "motir_celery.core.producer", "motir_celery.core.operator")


def global_findings(source: Source) -> list[str]:
    """Every ``global`` statement."""
    return [f"{source.path}:{node.lineno}: global {', '.join(node.names)}"
            for node in ast.walk(parse(source.text)) if isinstance(node, ast.Global)]


def settings_findings(source: Source) -> list[str]:
    """Every call of ``get_settings()`` (a name or an attribute of that name)."""
    found = []
    for node in ast.walk(parse(source.text)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name == "get_settings":
                found.append(f"{source.path}:{node.lineno}: get_settings()")
    return found


#: Annotations of data, not behaviour: an argument of one of these kept in module state is a
#: registry's key or value (a job's id), not a hook.
DATA = {"str", "int", "float", "bool", "bytes"}


def hook_findings(source: Source) -> list[str]:
    """Module-level functions that keep one of their arguments, as it was given, in module-level
    state: assigned (``global``, an attribute or item of a module-level object) or appended to a
    module-level collection. That is a hook: behaviour wired in from elsewhere, at import or at
    run time. A value computed from an argument (a cache's entry) or an argument annotated as
    data (``str``, ``int``...) is not one."""
    tree = parse(source.text)
    state = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    found = []
    for fn in tree.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
                  if a.annotation is None or ast.unparse(a.annotation) not in DATA}
        declared = {n for node in ast.walk(fn) if isinstance(node, ast.Global) for n in node.names}

        def rooted(target: ast.expr) -> str | None:
            while isinstance(target, (ast.Attribute, ast.Subscript)):
                target = target.value
            return target.id if isinstance(target, ast.Name) else None

        def kept(value: ast.expr | None) -> bool:
            return isinstance(value, ast.Name) and value.id in params

        for node in ast.walk(fn):
            targets: list[ast.expr] = []
            mutated = False  # a module-level collection's method called with the argument
            if isinstance(node, ast.Assign) and kept(node.value):
                targets = node.targets
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple) \
                    and isinstance(node.targets[0], ast.Tuple):  # a, b = x, y
                targets = [t for t, v in zip(node.targets[0].elts, node.value.elts) if kept(v)]
            elif isinstance(node, ast.AnnAssign) and kept(node.value):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("append", "add", "extend", "setdefault") \
                    and any(kept(a) for a in node.args):
                targets, mutated = [node.func.value], True
            for target in targets:
                root = rooted(target)
                if root in declared or (root in state and (mutated or not isinstance(target, ast.Name))):
                    found.append(f"{source.path}:{node.lineno}: {fn.name}() keeps an argument in module state {root}")
    return found


def attribute_findings(source: Source) -> list[str]:
    """``x._name`` read from an object whose class this module does not define: ``x`` neither
    ``self``, ``cls`` nor ``super()``, and ``_name`` not an attribute this module defines
    (``self._name = …``, a class attribute, a method). Module attributes are (b)'s."""
    tree = parse(source.text)
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    own.add(t.id)
    modules = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
               if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)) or node.attr in own:
            continue
        base = node.value
        if isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in modules):
            continue
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
            continue
        found.append(f"{source.path}:{node.lineno}: reads {node.attr} of {ast.unparse(base)}")
    return found


def room_of(module: str) -> str | None:
    return next((r for r in ROOMS if module == r or module.startswith(r + ".")), None)


def room_findings(source: Source, modules: set[str]) -> list[str]:
    """Imports (TYPE_CHECKING ones too) from one of the core's rooms into another."""
    mine = room_of(source.module)
    if mine is None:
        return []
    return [f"{source.path}:{imp.line}: {source.module} imports {target}"
            for imp in imports_of(source) for target in target_modules(imp, modules)
            if room_of(target) not in (None, mine)]


# --- the checkers, shown to fail -----------------------------------------------------------------


def _src(module: str, text: str, *, is_package: bool = False) -> Source:
    return Source(module, module.replace(".", "/") + ".py", text, is_package)


@pytest.mark.parametrize("snippet", [
    'Q = "SELECT id FROM job_queue WHERE id = %(id)s"',
    'Q = "SELECT now()"',
    'Q = ("SELECT a, b "\n     "FROM t")',
    'Q = "SELECT a " + "FROM t"',
    'q = f"SELECT {cols} FROM job_queue q"',
    'conn.execute("INSERT INTO job_event (name) VALUES (%s)", (n,))',
    'Q = "UPDATE job_queue SET state = \'queued\'"',
    'Q = "UPDATE job_queue q SET state = \'queued\'"',
    'Q = "DELETE FROM job_event WHERE id = %s"',
    'Q = """\n    WITH doomed AS (\n      SELECT 1\n    )\n    SELECT * FROM doomed"""',
    'Q = "CREATE DATABASE {}"',
    'Q = "CREATE UNIQUE INDEX ix ON t (a)"',
    'Q = "ALTER ROLE {} LOGIN PASSWORD {}"',
    'Q = "DROP TABLE job_queue"',
    'Q = "GRANT SELECT, INSERT ON job_queue TO motir_app"',
    'Q = \'SET LOCAL ROLE "motir_app"\'',
    'Q = "SHOW server_version"',
    'from sqlalchemy import text',
    'import sqlalchemy\nq = sqlalchemy.text("x")',
    'conn.exec_driver_sql(stmt)',
    'def f():\n    from sqlalchemy import Connection, text\n    return text',
])
def test_checker_finds_sql(snippet: str) -> None:
    assert sql_findings(_src("motir_celery.ops.x", snippet)), snippet


@pytest.mark.parametrize("snippet", [
    '"""Reads: everything here is a plain SELECT ... FROM job_queue (a docstring)."""',
    'def f():\n    """Runs DELETE FROM job_event, in prose."""',
    'HELP = "Select a run from the list and delete from the queue."',
    'FIX = f"GRANT {role} TO {login}"',
    'HOW = f"SET ROLE {role}"',
    'MSG = "development mode: reads drop to motir_app (SET LOCAL ROLE); set MOTIR_APP_DATABASE_URL"',
    'HINT = "motir migrate --check shows the drift; SELECT is granted"',
    'MSG = "the worker did not start: ready. not in the log"',
    'from sqlalchemy import Connection, make_url',
])
def test_checker_leaves_prose_alone(snippet: str) -> None:
    assert sql_findings(_src("motir_celery.ops.x", snippet)) == []


MODULES = {"motir_celery", "motir_celery.core", "motir_celery.core.a", "motir_celery.core.b",
           "motir_celery.core.pkg", "motir_celery.core.pkg.c", "motir_celery.store", "motir_celery.store.s",
           "motir_celery.adapter", "motir_celery.adapter.d", "motir_celery.ops", "motir_celery.ops.e",
           "motir_celery.settings"}


@pytest.mark.parametrize("snippet", [
    "from motir_celery.core.b import _helper",
    "from motir_celery.core import b\nb._helper()",
    "import motir_celery.core.b\nmotir_celery.core.b._helper()",
    "import motir_celery.core.b as bee\nbee._helper()",
    "from . import b\nb._helper()",
    "from .b import _helper",
    "from motir_celery.core.b import Thing\nThing._store",
    "def f():\n    from motir_celery.core.b import _helper",
])
def test_checker_finds_private_names(snippet: str) -> None:
    assert private_findings(_src("motir_celery.core.a", snippet), MODULES), snippet


@pytest.mark.parametrize("snippet", [
    "from motir_celery.core.b import helper\nhelper()",
    "from motir_celery.core import b\nb.__name__",
    "import json\njson._default_encoder",  # not ours
    "class A:\n    def f(self):\n        return self._x",
    "from motir_celery.core.a import Thing\nThing._own",  # its own module's
])
def test_checker_allows_public_and_own_names(snippet: str) -> None:
    assert private_findings(_src("motir_celery.core.a", snippet), MODULES) == []


def _graph(files: dict[str, str]) -> dict[str, dict[str, int]]:
    return import_graph(_src(m, t, is_package=m in {"motir_celery.core.pkg"}) for m, t in files.items())


def test_checker_finds_a_cycle_of_module_level_imports() -> None:
    graph = _graph({"motir_celery.core.a": "from motir_celery.core import b",
                    "motir_celery.core.b": "from motir_celery.core.a import thing"})
    assert cycles(graph) == [["motir_celery.core.a", "motir_celery.core.b"]]


def test_checker_finds_a_cycle_hidden_in_a_function() -> None:
    graph = _graph({"motir_celery.core.a": "from motir_celery.core import b",
                    "motir_celery.core.b": "def later():\n    from motir_celery.core.a import thing\n"})
    assert cycles(graph) == [["motir_celery.core.a", "motir_celery.core.b"]]


def test_checker_finds_a_cycle_through_a_package_and_a_relative_import() -> None:
    graph = _graph({"motir_celery.core.a": "from motir_celery.core.pkg import c",
                    "motir_celery.core.pkg": "from . import c",
                    "motir_celery.core.pkg.c": "from ...core.a import x"})
    assert cycles(graph) == [["motir_celery.core.a", "motir_celery.core.pkg.c"]]


def test_checker_allows_type_checking_imports_and_chains() -> None:
    graph = _graph({"motir_celery.core.a": "from motir_celery.core import b",
                    "motir_celery.core.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                           "    from motir_celery.core.a import Thing\n",
                    "motir_celery.core.pkg.c": "from motir_celery.core import a, b"})
    assert cycles(graph) == []


@pytest.mark.parametrize(("module", "snippet"), [
    ("motir_celery.core.a", "from motir_celery.adapter import d"),
    ("motir_celery.core.a", "def f():\n    from motir_celery.ops.e import x"),
    ("motir_celery.core.a", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from motir_celery.ops import e"),
    ("motir_celery.core.a", "from motir_celery import define_job"),
    ("motir_celery.core.a", "import celery"),
    ("motir_celery.core.a", "def f():\n    from kombu import Connection"),
    ("motir_celery.store.s", "from motir_celery.core.a import x"),
    ("motir_celery.store.s", "import redis"),
    ("motir_celery.settings", "from motir_celery.store import s"),
    ("motir_celery.adapter.d", "from motir_celery.ops import e"),
])
def test_checker_finds_imports_up_the_layers(module: str, snippet: str) -> None:
    assert layer_findings(_src(module, snippet), MODULES), (module, snippet)


@pytest.mark.parametrize(("module", "snippet"), [
    ("motir_celery.core.a", "from motir_celery.store import s\nfrom motir_celery.settings import x"),
    ("motir_celery.adapter.d", "import celery\nfrom motir_celery.core import a"),
    ("motir_celery.ops.e", "from motir_celery.adapter import d\nimport kombu"),
    ("motir_celery", "from motir_celery.ops import e"),
])
def test_checker_allows_imports_down_the_layers(module: str, snippet: str) -> None:
    assert layer_findings(_src(module, snippet), MODULES) == []


@pytest.mark.parametrize("snippet", [
    "def use(hook):\n    global _hook\n    _hook = hook",
    "class H:\n    hook = None\n\n_h = H()\n\ndef use(hook):\n    _h.hook = hook",
    "_hooks = []\n\ndef use(hook):\n    _hooks.append(hook)",
    "_by = {}\n\ndef use(name, hook):\n    _by[name] = hook",
    "class H:\n    hook = None\n\n_h = H()\n\ndef use(hook):\n    old, _h.hook = _h.hook, hook",
])
def test_checker_finds_hooks(snippet: str) -> None:
    assert hook_findings(_src("motir_celery.core.a", snippet)), snippet


@pytest.mark.parametrize("snippet", [
    "_cache = {}\n\ndef get(key):\n    _cache[key] = len(key)\n    return _cache[key]",  # computed: a cache
    "def f(x):\n    y = x\n    return y",
    "class A:\n    def use(self, hook):\n        self.hook = hook",
])
def test_checker_allows_caches_and_objects(snippet: str) -> None:
    assert hook_findings(_src("motir_celery.core.a", snippet)) == []


@pytest.mark.parametrize(("snippet", "finds"), [
    ("def f(step):\n    return step._memo", True),
    ("def f(step):\n    step._refused('k', '')", True),
    ("class A:\n    def __init__(self):\n        self._x = 1\n\ndef f(a):\n    return a._x", False),
    ("class A:\n    def f(self):\n        return super()._g()", False),
    ("class A:\n    def f(self):\n        return self._g", False),
    ("import os\nos._exit", False),  # a module's: (b) decides
])
def test_checker_finds_private_attributes_of_other_modules_objects(snippet: str, finds: bool) -> None:
    assert bool(attribute_findings(_src("motir_celery.core.a", snippet))) is finds, snippet


def test_checkers_find_global_statements_settings_reads_and_rooms() -> None:
    assert global_findings(_src("motir_celery.core.a", "def f():\n    global x\n    x = 1"))
    assert settings_findings(_src("motir_celery.store.s", "from motir_celery.settings import get_settings\n"
                                                          "def f():\n    return get_settings().queue"))
    modules = {"motir_celery.core.worker.a", "motir_celery.core.producer.b", "motir_celery.core.shapes"}
    assert room_findings(_src("motir_celery.core.worker.a", "from motir_celery.core.producer.b import x"), modules)
    assert room_findings(_src("motir_celery.core.worker.a", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                            "    from motir_celery.core.producer import b"), modules)
    assert room_findings(_src("motir_celery.core.worker.a", "from motir_celery.core.shapes import x"), modules) == []


# --- the package ------------------------------------------------------------------------------------

SOURCES = package_sources()
ALL_MODULES = {s.module for s in SOURCES}


def test_the_package_is_read() -> None:
    # A glob that found nothing would make every check below pass.
    assert {"motir_celery.store.driver", "motir_celery.core.jobs", "motir_celery.ops.cli"} <= ALL_MODULES
    assert len(SOURCES) > 50


def test_no_sql_outside_store() -> None:
    found = [f for s in outside_store(SOURCES) for f in sql_findings(s)]
    assert found == [], "SQL belongs in motir_celery/store/ as a named Statement:\n" + "\n".join(found)


def test_store_is_where_the_sql_is() -> None:
    # The scan recognises the store's own statements: it would see them anywhere else.
    store = [s for s in SOURCES if s.module.startswith("motir_celery.store.sql.")]
    assert sum(len(sql_findings(s)) for s in store) > 50


def test_no_private_name_crosses_a_module() -> None:
    found = [f for s in SOURCES for f in private_findings(s, ALL_MODULES)]
    assert found == [], "a private name used from another module:\n" + "\n".join(found)


def test_tests_benches_and_examples_import_no_private_name_of_the_package() -> None:
    # ``from motir_celery.m import _x`` elsewhere in the repository: make the name public. (A test
    # that saves and restores a module's private state reads it as ``m._x``: not an import.)
    outside = [s for folder in ("tests", "bench", "examples") for s in package_sources(ROOT / folder)
               if ".peers-venv" not in s.path]
    assert len(outside) > 100
    found = [f for s in outside for f in private_findings(s, ALL_MODULES) if ": imports " in f]
    assert found == [], "a private name of the package imported:\n" + "\n".join(found)


def test_no_import_cycle() -> None:
    graph = import_graph(SOURCES)
    found = cycles(graph)
    assert found == [], "\n".join(describe_cycle(graph, c) for c in found)


def test_imports_point_down_the_layers() -> None:
    found = [f for s in SOURCES for f in layer_findings(s, ALL_MODULES)]
    assert found == [], "an import up the layers:\n" + "\n".join(found)


def test_statements_are_written_in_the_audience_modules_only() -> None:
    # A Statement(...) anywhere else would be missing from the catalogue.
    found = [f"{s.path}:{node.lineno}" for s in SOURCES
             if not s.module.startswith("motir_celery.store.sql.") and s.module != "motir_celery.store.driver"
             for node in ast.walk(parse(s.text))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Statement"]
    assert found == [], "a Statement outside motir_celery/store/sql/:\n" + "\n".join(found)


# --- the catalogue -----------------------------------------------------------------------------------


def test_the_catalogue_lists_every_statement_of_every_audience_once() -> None:
    from motir_celery.store.driver import Statement
    from motir_celery.store.sql import audiences, catalogue

    entries = catalogue()
    modules = audiences()
    assert {m.__name__.rsplit(".", 1)[1] for m in modules} >= {
        "worker", "producer", "operator", "reads", "maintenance", "catalog", "session", "setup"}
    defined = {id(v) for m in modules for v in vars(m).values() if isinstance(v, Statement)}
    assert {id(e.statement) for e in entries} == defined
    assert len({e.name for e in entries}) == len(entries)
    for e in entries:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", e.name), e.name
        assert e.doc.strip() and "\n" not in e.doc and len(e.doc) <= 140, e.name   # one line
        assert e.statement.sql.strip(), e.name
        assert e.roles and all(isinstance(r, str) for r in e.roles), e.name


def test_the_catalogue_refuses_a_statement_listed_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    from motir_celery.store import sql
    from motir_celery.store.sql import producer, reads

    monkeypatch.setattr(reads, "DB_NOW_AGAIN", producer.DB_NOW, raising=False)
    with pytest.raises(ValueError, match="import the module"):
        sql.catalogue()


def test_reads_run_through_the_catalogue() -> None:
    # What the CLI, dashboard, /metrics and doctor read is catalogued under its audience.
    from motir_celery.store.sql import catalogue

    by_name = {e.name: e for e in catalogue()}
    for name in ("list_runs", "run", "list_events", "list_dlq", "queue_depth", "runs_recent", "sweeper_overdue"):
        assert by_name[name].audience == "reads"
    for name in ("purge_runs", "purge_dlq", "purge_events", "purge_counts", "purge_kept"):
        assert by_name[name].audience == "maintenance"
    assert by_name["server_version"].audience == "catalog"
    assert by_name["login_password"].audience == "setup"


def test_docs_statements_md_is_the_catalogue() -> None:
    from motir_celery.store.sql import REGENERATE, render_markdown

    committed = (ROOT / "docs" / "statements.md").read_text()
    assert committed == render_markdown(), f"docs/statements.md is stale; regenerate it: {REGENERATE}"


def test_docs_statements_md_says_the_count_per_audience() -> None:
    from collections import Counter

    from motir_celery.store.sql import catalogue, render_markdown

    counts = Counter(e.audience for e in catalogue())
    head = render_markdown().split("| statement |")[0]
    assert f"**{sum(counts.values())}**" in head
    for audience, n in counts.items():
        assert f"{audience} {n}" in head


def test_doctor_statements_prints_the_catalogue() -> None:
    import json

    from click.testing import CliRunner

    from motir_celery.ops.cli import main
    from motir_celery.store.sql import catalogue

    entries = catalogue()
    run = CliRunner().invoke(main, ["doctor", "--statements", "--json"], catch_exceptions=False)
    assert run.exit_code == 0, run.output
    listed = json.loads(run.stdout)
    assert [(r["name"], r["audience"], tuple(r["roles"]), r["doc"]) for r in listed] == [
        (e.name, e.audience, e.roles, e.doc) for e in entries]
    table = CliRunner().invoke(main, ["doctor", "--statements"], catch_exceptions=False)
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["STATEMENT", "AUDIENCE", "ROLES", "WHAT", "IT", "DOES"]
    assert any(line.startswith("claim ") and "worker" in line and "motir_engine" in line for line in lines)
    assert lines[-1].startswith(f"{len(entries)} statements: ")


# --- (e) the engine ------------------------------------------------------------------------------


def test_no_global_statement_in_the_package() -> None:
    found = [f for s in SOURCES for f in global_findings(s)]
    assert found == [], "a global statement (state belongs to the engine, or to the current-engine lookup):\n" + \
        "\n".join(found)


def test_no_module_global_hook_beyond_the_current_engine_lookup() -> None:
    found = [f for s in SOURCES for f in hook_findings(s)
             if not any(f"{fn}()" in f for fn in HOOK_OWNERS.get(s.module, ()))]
    assert found == [], "a module-global hook (hand the engine down instead):\n" + "\n".join(found)
    owned = {s.module: {f.split(": ", 1)[1].split("()")[0] for f in hook_findings(s)}
             for s in SOURCES if s.module in HOOK_OWNERS}
    assert owned == HOOK_OWNERS  # the allowed ones are still where this test says they are


def test_settings_are_read_from_the_environment_where_the_engine_is_built_only() -> None:
    found = {s.module: settings_findings(s) for s in SOURCES if settings_findings(s)}
    assert set(found) == SETTINGS_READERS, "get_settings() outside the engine:\n" + "\n".join(
        f for m, fs in found.items() if m not in SETTINGS_READERS for f in fs)


def test_no_private_attribute_of_another_modules_object_is_read() -> None:
    found = [f for s in SOURCES for f in attribute_findings(s)]
    assert found == [], "a private attribute read from outside its module (give it a public name):\n" + \
        "\n".join(found)


def test_the_cores_rooms_import_none_of_each_other() -> None:
    found = [f for s in SOURCES for f in room_findings(s, ALL_MODULES)]
    assert found == [], "a room of the core imports another (what they share lives below them):\n" + \
        "\n".join(found)
    assert all(any(s.module.startswith(room + ".") for s in SOURCES) for room in ROOMS)
