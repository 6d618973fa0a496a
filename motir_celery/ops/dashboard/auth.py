"""Who is asking: the dashboard's identities, and CSRF tokens bound to them.

Two ways to say who the caller is (``MOTIR_DASHBOARD_AUTH``):

* ``header`` (default) — a reverse proxy that has authenticated the user (SSO,
  oauth2-proxy, your API gateway) sets ``X-Motir-User``, ``X-Motir-Workspace``
  and, for operators, ``X-Motir-Admin: true``. The header names are settings.
  The dashboard trusts these headers, which is only safe when nothing but the
  proxy can reach it — hence the 127.0.0.1 default bind; the proxy must also
  strip these headers from the client's request.
* ``basic`` — HTTP basic auth against a users file (``MOTIR_DASHBOARD_USERS_FILE``),
  one ``user:password:workspace`` per line; workspace ``*`` makes an admin. A
  password may be given as ``sha256:<hex digest>`` instead of in clear.

There is no anonymous access to any page that shows or changes a run: no
identity → 401. An identity must carry a workspace or be an admin (403
otherwise). What it then sees is decided by row-level security under the app
role; this module only says which workspace context to open.

CSRF: every form carries a token signed with the dashboard's secret and bound
to the user (``itsdangerous.TimestampSigner``); a POST whose token is missing,
expired, forged or minted for someone else is refused, and so is a POST whose
``Origin`` is another site. Browsers attach basic-auth credentials and proxy
cookies to cross-site requests, so the token is what stops another site from
pressing Replay on an operator's behalf.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from itsdangerous import BadSignature, SignatureExpired, TimestampSigner
from starlette.requests import Request

from motir_celery.store.db import validate_workspace_id
from motir_celery.errors import ConfigurationError, WorkspaceError

__all__ = ["Identity", "AuthConfig", "Authenticator", "AuthError", "CsrfTokens", "load_users"]

_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class Identity:
    user: str
    workspace: str | None
    admin: bool

    @property
    def label(self) -> str:
        if self.admin:
            return f"{self.user} · admin" + (f" · {self.workspace}" if self.workspace else " · all workspaces")
        return f"{self.user} · {self.workspace}"


class AuthError(Exception):
    def __init__(self, status: int, message: str, *, challenge: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.challenge = status, message, challenge


@dataclass(frozen=True)
class AuthConfig:
    mode: str = "header"
    user_header: str = "X-Motir-User"
    workspace_header: str = "X-Motir-Workspace"
    admin_header: str = "X-Motir-Admin"
    users_file: str | None = None
    realm: str = "motir"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "AuthConfig":
        env = os.environ if env is None else env
        mode = env.get("MOTIR_DASHBOARD_AUTH", "header").strip().lower() or "header"
        if mode not in ("header", "basic"):
            raise ConfigurationError(f"MOTIR_DASHBOARD_AUTH={mode!r}: use 'header' or 'basic'")
        users_file = env.get("MOTIR_DASHBOARD_USERS_FILE", "").strip() or None
        if mode == "basic" and not users_file:
            raise ConfigurationError("MOTIR_DASHBOARD_AUTH=basic needs MOTIR_DASHBOARD_USERS_FILE")
        return cls(
            mode=mode,
            user_header=env.get("MOTIR_DASHBOARD_USER_HEADER", "").strip() or cls.user_header,
            workspace_header=env.get("MOTIR_DASHBOARD_WORKSPACE_HEADER", "").strip() or cls.workspace_header,
            admin_header=env.get("MOTIR_DASHBOARD_ADMIN_HEADER", "").strip() or cls.admin_header,
            users_file=users_file,
        )


@dataclass(frozen=True)
class _User:
    password: str
    workspace: str | None
    admin: bool

    def check(self, given: str) -> bool:
        if self.password.startswith("sha256:"):
            digest = hashlib.sha256(given.encode()).hexdigest()
            return hmac.compare_digest(digest, self.password[len("sha256:"):].lower())
        return hmac.compare_digest(given.encode(), self.password.encode())


def load_users(path: str | Path) -> dict[str, _User]:
    """Parse a users file: ``user:password:workspace`` per line, ``*`` = admin, ``#`` comments."""
    users: dict[str, _User] = {}
    for number, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        user, sep1, rest = line.partition(":")
        password, sep2, workspace = rest.rpartition(":")
        if not (sep1 and sep2 and user and password and workspace):
            raise ConfigurationError(f"{path}:{number}: expected user:password:workspace (workspace * = admin)")
        admin = workspace == "*"
        users[user] = _User(password, None if admin else workspace, admin)
    return users


class Authenticator:
    def __init__(self, config: AuthConfig) -> None:
        self.config = config
        self._users = load_users(config.users_file) if config.mode == "basic" and config.users_file else {}

    def identify(self, request: Request) -> Identity:
        """The caller's identity, or ``AuthError`` (401 without one, 403 without a workspace)."""
        if self.config.mode == "basic":
            user, workspace, admin = self._basic(request)
        else:
            user, workspace, admin = self._header(request)
        try:
            workspace = validate_workspace_id(workspace)
        except WorkspaceError as exc:
            raise AuthError(400, str(exc)) from None
        if workspace is None and not admin:
            raise AuthError(403, f"user {user!r} has no workspace and is not an admin: nothing to show")
        return Identity(user, workspace, admin)

    def _header(self, request: Request) -> tuple[str, str | None, bool]:
        cfg = self.config
        user = request.headers.get(cfg.user_header, "").strip()
        if not user:
            raise AuthError(401, f"no identity: the {cfg.user_header} header is missing (set by your proxy)")
        if len(user) > 200 or not user.isprintable():
            raise AuthError(400, f"{cfg.user_header} is not a usable user name")
        workspace = request.headers.get(cfg.workspace_header, "").strip() or None
        admin = request.headers.get(cfg.admin_header, "").strip().lower() in _TRUE
        return user, workspace, admin

    def _basic(self, request: Request) -> tuple[str, str | None, bool]:
        header = request.headers.get("authorization", "")
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic" or not encoded:
            raise AuthError(401, "sign in required", challenge=True)
        try:
            user, _, password = base64.b64decode(encoded, validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            raise AuthError(401, "malformed basic credentials", challenge=True) from None
        record = self._users.get(user)
        # Same work whether or not the user exists, so timing does not reveal user names.
        ok = (record or _User("sha256:" + "0" * 64, None, False)).check(password)
        if record is None or not ok:
            raise AuthError(401, "wrong user name or password", challenge=True)
        return user, record.workspace, record.admin


class CsrfTokens:
    """Signed, user-bound, expiring form tokens; no server-side session needed."""

    MAX_AGE = 8 * 3600

    def __init__(self, secret: str | None) -> None:
        # Unset: a random secret per process. Tokens then die with a restart and are
        # not shared between replicas; set MOTIR_DASHBOARD_SECRET to run several.
        self._signer = TimestampSigner(secret or secrets.token_urlsafe(32), salt="motir-dashboard-csrf")

    def issue(self, identity: Identity) -> str:
        return self._signer.sign(identity.user.encode()).decode()

    def verify(self, token: str | None, identity: Identity) -> bool:
        if not token:
            return False
        try:
            user = self._signer.unsign(token, max_age=self.MAX_AGE).decode()
        except (BadSignature, SignatureExpired):
            return False
        return hmac.compare_digest(user, identity.user)
