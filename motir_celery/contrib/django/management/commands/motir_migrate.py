"""``manage.py motir_migrate [--check] [--set-role-passwords]``: motir's tables, as ``motir migrate``.

motir's schema is Alembic's (its RLS policies and grants included), not Django
migrations': run this beside ``manage.py migrate``, as the owner of the tables
(``MOTIR_MIGRATE_DATABASE_URL``, else ``MOTIR_DATABASE_URL``, else Django's database).
"""

from __future__ import annotations

from motir_celery.contrib.django.management.commands.motir import Command as _Cli


class Command(_Cli):
    help = "Migrate motir-celery's tables to head (motir migrate): --check reports drift only."
    cli_prefix = ("migrate",)
