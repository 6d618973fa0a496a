"""Small statistics shared by every section (and by the peers' drivers: stdlib only)."""

from __future__ import annotations

import math
import statistics
from typing import Sequence


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in [0, 100]."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def drain_rate(done_at: Sequence[float], lo: float = 0.05, hi: float = 0.95) -> float:
    """Completions per second between the ``lo`` and ``hi`` fractions of the drain.

    Every side's backlog is queued before its workers start, so this is the
    steady rate at which the workers empty it. Trimming 5% at each end keeps
    worker start-up (two workers never become ready at the same instant) and
    the last straggler out of the figure, identically for every side.
    """
    s = sorted(done_at)
    n = len(s)
    if n < 20:
        return (n - 1) / (s[-1] - s[0]) if n > 1 and s[-1] > s[0] else float("nan")
    i, j = int(n * lo), int(n * hi) - 1
    return (j - i) / (s[j] - s[i]) if s[j] > s[i] else float("nan")
