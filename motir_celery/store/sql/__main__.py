"""``python -m motir_celery.store.sql > docs/statements.md``: print the catalogue as docs/statements.md."""

from motir_celery.store.sql import render_markdown

print(render_markdown(), end="")
