"""Alembic environment: target metadata is motir_celery.store.models, URL from motir settings."""

from alembic import context
from sqlalchemy import create_engine, pool

import motir_celery.store.migrate  # noqa: F401  (registers the RLS comparator)
from motir_celery.store.models import Base

config = context.config


def include_name(name: str | None, type_: str, parent_names: object) -> bool:
    """Compare motir's tables only: a database shared with an application (a Django
    project's tables, its django_migrations) is not drift. A reflected table that is not
    in the models counts only under motir's prefix (a stray ``job_*`` still shows)."""
    if type_ == "table" and name is not None:
        return name in Base.metadata.tables or name.startswith("job_")
    return True


def run_migrations_online() -> None:
    # Nothing prepared (prepare_threshold None): psycopg would prepare a query run five times, as
    # autogenerate's reflection runs them, under names a transaction pooler (PgBouncer) shares
    # among its clients' server sessions. A migration or a check is rare: preparing buys nothing.
    engine = create_engine(config.get_main_option("sqlalchemy.url"), poolclass=pool.NullPool,
                           connect_args={"prepare_threshold": None})
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=Base.metadata, compare_type=True,
                          include_name=include_name)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=Base.metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
