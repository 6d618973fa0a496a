"""Celery's own integration suite as motir-celery's yardstick (issue 43): ``make celery-suite``.

Not part of ``make test`` (tests/conftest.py ignores this folder; the runner takes 20-40
minutes). README.md beside this file says how to run it and what it measures.

Modules: ``__main__`` (the runner), ``source`` (Celery's ``t/`` from its sdist, copied, made
durable), ``services`` (Redis, Postgres), ``worker_app`` (the real worker's app), ``plugin``
(loaded into Celery's pytest run), ``features`` (test -> table row), ``report``.
"""

#: Which variant a process belongs to: read by worker_app (the runner sets it for the worker).
VARIANT_VAR = "CELERY_SUITE_VARIANT"
