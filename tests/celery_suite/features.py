"""Which row of issue 43's table a test of Celery's suite counts in.

The rules are data: a row and the words that put a test in it. A test's function name (its
parametrize suffix dropped) is split at ``_`` into words; the first rule, top to bottom, with a
word that *starts with* one of its stems wins. A name no rule matches is tried again with its
class name (``test_chord``, ``test_result_set``, ...), and only then falls to ``other``.

The order is the precedence, most specific first:

1. ``revoke`` -- a test revoking by stamped headers is about revoking.
2. ``retries`` -- ``retry``, ``retried``, ``retries``.
3. ``Task.replace`` -- a chain or group whose child is replaced is about replacing.
4. ``headers / stamping / priority`` -- ``stamp*``, ``priority``, ``headers``, ``properties``.
   Not the bare word ``header``: ``chord_header`` is a chord's header group.
5. ``link / link_error`` -- callbacks and errbacks, also where the canvas is a chord or a group.
6. ``chord``, 7. ``group``, 8. ``chain`` -- the canvas primitive the test is built on, the
   biggest first (a chord contains a group; chains are everywhere).
9. ``result get / propagate`` -- reading results and exceptions back.
10. ``other``.
"""

from __future__ import annotations

import re
from typing import Final

#: (row, stems), in precedence order. A stem matches a word of the name that starts with it.
RULES: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    ("revoke", ("revoke",)),
    ("retries", ("retry", "retri")),
    ("Task.replace", ("replace",)),
    ("headers / stamping / priority", ("stamp", "priority", "headers", "properties")),
    ("link / link_error", ("link", "errback", "callback")),
    ("chord", ("chord",)),
    ("group", ("group",)),
    ("chain", ("chain",)),
    ("result get / propagate", ("result", "propagat", "get", "join", "ready", "forget", "fail", "exception")),
)
OTHER: Final = "other"
#: The table's rows, in its order (issue 43's), ending with the total.
ROWS: Final[tuple[str, ...]] = (
    "chain", "group", "chord", "link / link_error", "retries", "revoke", "result get / propagate",
    "headers / stamping / priority", "Task.replace", OTHER,
)
ALL: Final = "all"


def _words(name: str) -> list[str]:
    return [w for w in re.sub(r"\[.*\]$", "", name).lower().split("_") if w and w != "test"]


def _match(name: str) -> str | None:
    words = _words(name)
    for row, stems in RULES:
        if any(word.startswith(stem) for word in words for stem in stems):
            return row
    return None


def feature_of(nodeid: str) -> str:
    """The row of ``t/integration/test_x.py::test_class::test_name[param]``."""
    parts = nodeid.split("::")
    function = parts[-1]
    klass = parts[-2] if len(parts) > 2 else ""
    return _match(function) or (klass and _match(klass)) or OTHER
