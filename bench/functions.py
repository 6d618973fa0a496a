"""The three trivial step bodies every side of the benchmark runs.

No motir import here: the peers (Procrastinate, DBOS) run these same
functions from their own virtualenv, where motir-celery is not installed.
"""

from __future__ import annotations


def reserve(n: int) -> dict[str, int]:
    return {"reserved": n}


def charge(n: int) -> dict[str, int]:
    return {"charged": n * 2}


def notify(n: int) -> dict[str, int]:
    return {"notified": n + 1}
