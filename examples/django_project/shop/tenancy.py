"""The example's tenancy: which workspace a request belongs to."""

from typing import Any


def workspace_of(request: Any) -> str | None:
    # An example only: a real project takes it from the authenticated user, never
    # from a header a client can set.
    return request.headers.get("X-Shop-Tenant") or None
