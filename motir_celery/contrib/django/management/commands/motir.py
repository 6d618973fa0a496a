"""``manage.py motir <arguments>``: the ``motir`` operator CLI, with Django's settings.

Everything after ``motir`` goes to the CLI unchanged (``manage.py motir runs list``,
``manage.py motir doctor``, ``manage.py motir --help``).
"""

from __future__ import annotations

from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "The motir operator CLI (runs, dlq, jobs, doctor, purge, …) with this project's settings."

    #: The CLI's own arguments, untouched by Django's parser.
    cli_prefix: tuple[str, ...] = ()

    def run_from_argv(self, argv: list[str]) -> None:
        from motir_celery.ops.cli import main

        # standalone_mode: click prints errors and exits with the CLI's own status.
        main.main(args=[*self.cli_prefix, *argv[2:]], prog_name=f"{argv[0]} {argv[1]}", standalone_mode=True)

    def handle(self, *args: str, **options: object) -> None:  # call_command('motir'): the CLI's help
        from motir_celery.ops.cli import main

        main.main(args=[*self.cli_prefix, *args] or ["--help"], prog_name="motir", standalone_mode=False)
