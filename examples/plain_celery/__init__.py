"""A plain Celery project (no Django) whose tasks became durable jobs: see README.md."""
