"""``WorkspaceMiddleware``: the request's workspace on the transactions motir writes in.

Row-level security (docs/security.md) compares each row's ``workspace_id`` with the
transaction's ``motir.workspace_id``. With this middleware, a ``send_event`` inside
``transaction.atomic()`` during a request sets ``motir.workspace_id`` to **the
request's** workspace in Django's transaction (``set_config(…, true)``: it ends
with the transaction, never leaks to the next user of the connection). When Django
logs in as a member of ``motir_app``, Postgres then refuses an event of another
workspace written during that request — the database, not the view, keeps tenants
apart. (A Django login that owns the tables is not filtered by RLS: development.)
The request's workspace is also where ``AsyncResult(id)`` reads (``in_workspace``).

The workspace of a request comes from ``MOTIR_WORKSPACE_FROM_REQUEST``, the dotted
path of a function ``request -> str | None`` (your tenancy: the user's organisation,
a subdomain…). Unset, the middleware reads ``request.workspace_id`` (set by an
earlier middleware of yours), else nothing. An event still names its own workspace
(``workspace_id=`` or its data's ``workspace_id``): the middleware scopes, it does
not fill in.

``MIDDLEWARE = [..., "motir_celery.contrib.django.middleware.WorkspaceMiddleware"]``
— after the middleware that identifies the user/tenant.
"""

from __future__ import annotations

from typing import Any, Callable

from motir_celery.store.db import caller_workspace, in_workspace

__all__ = ["WorkspaceMiddleware", "request_workspace"]


def request_workspace() -> str | None:
    """The workspace of the request being served (None outside one, or without the middleware):
    ``motir_celery.in_workspace``'s, which the middleware sets for the request."""
    return caller_workspace()


def _default_resolver(request: Any) -> str | None:
    value = getattr(request, "workspace_id", None)
    return None if value is None else str(value)


class WorkspaceMiddleware:
    """Sync and async: Django adapts it (a contextvar follows the request either way)."""

    sync_capable = True
    async_capable = False

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        from django.conf import settings
        from django.utils.module_loading import import_string

        self.get_response = get_response
        path = getattr(settings, "MOTIR_WORKSPACE_FROM_REQUEST", None)
        self.resolve: Callable[[Any], str | None] = import_string(path) if path else _default_resolver

    def __call__(self, request: Any) -> Any:
        with in_workspace(self.resolve(request)):
            return self.get_response(request)
