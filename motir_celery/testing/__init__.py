"""Testing durable jobs: the pytest plugin's ``motir`` fixture and the kit behind it (docs/testing.md).

Installing the package is enough: pytest finds the plugin through its ``pytest11``
entry point (``motir_celery.testing.plugin``). ``Motir`` runs jobs in the test's own
process against a real, migrated Postgres — the real claim, step, settle and sweeper
statements, no broker and no worker — and can kill an attempt after any step and skip
time.
"""

from motir_celery.testing.kit import DrainError, Handle, Held, Motir, WorkerCrash

__all__ = ["Motir", "Handle", "WorkerCrash", "DrainError", "Held"]
