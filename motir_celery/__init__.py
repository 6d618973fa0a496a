"""motir-celery."""
