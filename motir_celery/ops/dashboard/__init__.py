"""The operator dashboard (``motir dashboard``): see ``app.py``; identities in ``auth.py``."""

from motir_celery.ops.dashboard.app import DashboardConfig, create_app
from motir_celery.ops.dashboard.auth import AuthConfig, Identity

__all__ = ["create_app", "DashboardConfig", "AuthConfig", "Identity"]
