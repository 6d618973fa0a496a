"""No Django models: motir's tables are Alembic's (``manage.py motir_migrate``).

The module exists so that Django sends this app ``post_migrate`` (it does so for apps with a
models module only): on a test database, motir's tables are migrated then (testdb.py)."""
