"""The operator dashboard (``motir dashboard``): see ``app.py``; identities in ``auth.py``."""

from .app import DashboardConfig, create_app
from .auth import AuthConfig, Identity

__all__ = ["create_app", "DashboardConfig", "AuthConfig", "Identity"]
