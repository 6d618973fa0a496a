"""Integrations with the frameworks a Celery team already runs (``contrib.django``).

The top layer beside ``ops/``: it may import everything below, nothing imports it.
"""
