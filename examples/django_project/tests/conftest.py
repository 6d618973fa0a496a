"""Django on the test kit's database: the project's settings, Django's tables and motir's in one database.

``motir_database_url`` (motir-celery's pytest plugin) made and migrated the database;
Django is pointed at the same one (``DATABASE_URL``, as settings.py reads it) and gets
its own tables with ``migrate``. Run from this folder or the repository root:
``python -m pytest examples/django_project/tests``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

PROJECT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def django_on_the_kits_database(motir_database_url: str) -> Iterator[None]:
    sys.path.insert(0, str(PROJECT))
    os.environ["DATABASE_URL"] = motir_database_url.replace("postgresql+psycopg://", "postgresql://", 1)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
    import django
    from django.core.management import call_command

    django.setup()
    import shop.celery  # noqa: F401  (the project's Celery app, which attach()es the engine)

    call_command("migrate", verbosity=0)
    yield
