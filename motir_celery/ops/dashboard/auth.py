"""Who is asking: the dashboard's identities, and CSRF tokens bound to them.

Two ways to say who the caller is (``MOTIR_DASHBOARD_AUTH``; docs/security.md):

* ``header`` (default) — a reverse proxy that has authenticated the user (SSO,
  oauth2-proxy, your API gateway) sets ``X-Motir-User``, ``X-Motir-Workspace``
  and, for operators, ``X-Motir-Admin: true`` (exactly ``true``; ``false`` or
  absent is not admin; any other value is a 400). The header names are settings.
  Identity headers are believed only from the proxy's own address:
  ``MOTIR_DASHBOARD_TRUSTED_PROXIES`` (IPs or CIDRs, comma-separated; unset:
  loopback only). From any other peer they are refused (403), so a client that
  reaches the port directly cannot claim to be anyone. A request carrying an
  identity header twice, or a value with a comma (two values merged), is
  refused (400): a proxy that appends instead of replacing would otherwise let
  the client's own value through.
* ``basic`` — HTTP basic auth against a users file (``MOTIR_DASHBOARD_USERS_FILE``),
  one ``user:hash:workspace`` per line; workspace ``*`` makes an admin. The hash
  comes from ``motir dashboard hash-password`` (argon2id or scrypt,
  ``passwords.py``). Clear text is refused unless
  ``MOTIR_DASHBOARD_ALLOW_PLAINTEXT_PASSWORDS=1`` (development only), unsalted
  ``sha256:`` always. A file others may write is refused; one they may read is
  loudly warned about.

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
import getpass
import hmac
import ipaddress
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence, Union
from urllib.parse import urlsplit

from itsdangerous import BadSignature, SignatureExpired, TimestampSigner
from starlette.requests import Request

from motir_celery.errors import ConfigurationError, WorkspaceError
from motir_celery.ops.dashboard.passwords import dummy_hash, hash_kind, verify_password
from motir_celery.store.db import validate_workspace_id

__all__ = ["Identity", "AuthConfig", "Authenticator", "AuthError", "CsrfTokens", "load_users", "parse_networks",
           "is_loopback"]

log = logging.getLogger("motir_celery.ops.dashboard")

Network = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]
LOOPBACK: tuple[Network, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
#: The only spellings of the admin header: "true" is admin, "false" is not; anything else is a 400.
ADMIN_TRUE, ADMIN_FALSE = "true", "false"


@dataclass(frozen=True)
class Identity:
    user: str
    workspace: str | None
    admin: bool
    #: Local mode's fixed identity (no sign-in): the page says so.
    local: bool = False

    @property
    def label(self) -> str:
        if self.local:
            return f"{self.user} · local mode · admin · all workspaces"
        if self.admin:
            return f"{self.user} · admin" + (f" · {self.workspace}" if self.workspace else " · all workspaces")
        return f"{self.user} · {self.workspace}"


class AuthError(Exception):
    def __init__(self, status: int, message: str, *, challenge: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.challenge = status, message, challenge


def parse_networks(raw: str, *, name: str = "MOTIR_DASHBOARD_TRUSTED_PROXIES") -> tuple[Network, ...]:
    """``"10.0.0.5, 192.168.0.0/16, ::1"`` → networks; a malformed entry names the variable."""
    out: list[Network] = []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        try:
            out.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ConfigurationError(f"{name}: {item!r} is not an IP address or CIDR") from None
    return tuple(out)


def _loopback_peer(host: str) -> bool:
    try:
        peer = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(peer, ipaddress.IPv6Address) and peer.ipv4_mapped is not None:
        peer = peer.ipv4_mapped
    return peer.is_loopback


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class AuthConfig:
    mode: str = "header"
    user_header: str = "X-Motir-User"
    workspace_header: str = "X-Motir-Workspace"
    admin_header: str = "X-Motir-Admin"
    users_file: str | None = None
    realm: str = "motir"
    #: Peers whose identity headers are believed (header mode). Empty: loopback only.
    trusted_proxies: tuple[Network, ...] = ()
    #: Development only: accept clear-text passwords in the users file (warned at start).
    allow_plaintext: bool = False
    #: Local mode's identity: ``local:<OS user>``, admin of every workspace.
    local_user: str = "local"

    @property
    def trusted_peers(self) -> tuple[Network, ...]:
        return self.trusted_proxies or LOOPBACK

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "AuthConfig":
        env = os.environ if env is None else env
        mode = env.get("MOTIR_DASHBOARD_AUTH", "header").strip().lower() or "header"
        if mode not in ("header", "basic", "local"):
            raise ConfigurationError(f"MOTIR_DASHBOARD_AUTH={mode!r}: use 'header', 'basic' or 'local'")
        users_file = env.get("MOTIR_DASHBOARD_USERS_FILE", "").strip() or None
        if mode == "basic" and not users_file:
            raise ConfigurationError("MOTIR_DASHBOARD_AUTH=basic needs MOTIR_DASHBOARD_USERS_FILE")
        plaintext = env.get("MOTIR_DASHBOARD_ALLOW_PLAINTEXT_PASSWORDS", "").strip().lower()
        if plaintext not in ("", "0", "1", "false", "true"):
            raise ConfigurationError(f"MOTIR_DASHBOARD_ALLOW_PLAINTEXT_PASSWORDS={plaintext!r}: use 1 or 0")
        return cls(
            mode=mode,
            user_header=env.get("MOTIR_DASHBOARD_USER_HEADER", "").strip() or cls.user_header,
            workspace_header=env.get("MOTIR_DASHBOARD_WORKSPACE_HEADER", "").strip() or cls.workspace_header,
            admin_header=env.get("MOTIR_DASHBOARD_ADMIN_HEADER", "").strip() or cls.admin_header,
            users_file=users_file,
            trusted_proxies=parse_networks(env.get("MOTIR_DASHBOARD_TRUSTED_PROXIES", "")),
            allow_plaintext=plaintext in ("1", "true"),
            local_user=f"local:{_os_user()}",
        )


def _os_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 — no name for this uid (a container): still a local user
        return "developer"


@dataclass(frozen=True)
class _User:
    password: str
    workspace: str | None
    admin: bool

    def check(self, given: str) -> bool:
        return verify_password(self.password, given)


def _check_file_mode(path: Path, *, plaintext: bool) -> None:
    mode = path.stat().st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigurationError(f"{path} is writable by group or others (mode {stat.filemode(mode)}): anyone who "
                                 "can write it can make themselves admin; chmod go-w it")
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        if plaintext:
            raise ConfigurationError(f"{path} holds clear-text passwords and is readable by group or others "
                                     f"(mode {stat.filemode(mode)}); chmod 600 it")
        log.warning("WARNING: %s is readable by group or others (mode %s): its password hashes can be guessed "
                    "offline by whoever reads it; chmod 600 it unless a container user needs the read",
                    path, stat.filemode(mode))


def load_users(path: str | Path, *, allow_plaintext: bool = False) -> dict[str, _User]:
    """Parse a users file: ``user:hash:workspace`` per line, ``*`` = admin, ``#`` comments."""
    path = Path(path)
    users: dict[str, _User] = {}
    plaintext: list[str] = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        user, sep1, rest = line.partition(":")
        password, sep2, workspace = rest.rpartition(":")
        if not (sep1 and sep2 and user and password and workspace):
            raise ConfigurationError(f"{path}:{number}: expected user:hash:workspace (workspace * = admin)")
        kind = hash_kind(password)
        if kind == "sha256":
            raise ConfigurationError(f"{path}:{number}: user {user!r} has an unsalted sha256: password, which is "
                                     "not a password hash; make one with `motir dashboard hash-password`")
        if kind == "plain":
            if not allow_plaintext:
                raise ConfigurationError(
                    f"{path}:{number}: user {user!r} has a clear-text password; store a hash from "
                    "`motir dashboard hash-password` (MOTIR_DASHBOARD_ALLOW_PLAINTEXT_PASSWORDS=1 accepts clear "
                    "text, for development only)")
            plaintext.append(user)
        admin = workspace == "*"
        users[user] = _User(password, None if admin else workspace, admin)
    _check_file_mode(path, plaintext=bool(plaintext))
    if plaintext:
        log.warning("WARNING: %s holds clear-text passwords (users %s), accepted because "
                    "MOTIR_DASHBOARD_ALLOW_PLAINTEXT_PASSWORDS=1: development only", path, ", ".join(plaintext))
    return users


class Authenticator:
    def __init__(self, config: AuthConfig) -> None:
        self.config = config
        self._users = (load_users(config.users_file, allow_plaintext=config.allow_plaintext)
                       if config.mode == "basic" and config.users_file else {})
        kinds = {hash_kind(u.password) for u in self._users.values()}
        # An unknown user is checked against a hash as costly as the real ones (no timing oracle).
        costliest = next((k for k in ("argon2", "scrypt") if k in kinds), "plain" if kinds else "scrypt")
        self._dummy = _User(dummy_hash(costliest), None, False)

    def identify(self, request: Request) -> Identity:
        """The caller's identity, or ``AuthError`` (401 without one, 403 without a workspace)."""
        if self.config.mode == "local":
            return self._local(request)
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

    def _local(self, request: Request) -> Identity:
        """Local mode: no sign-in, for a developer on this machine — a loopback peer, and a
        loopback name in ``Host`` (a page of another site that rebinds its name to 127.0.0.1
        sends its own name there). Identity headers are ignored."""
        peer = request.client.host if request.client else ""
        if not _loopback_peer(peer):
            raise AuthError(403, "local mode serves this machine only (a loopback peer)")
        host = urlsplit("//" + (request.headers.get("host") or "")).hostname or ""
        if not is_loopback(host):
            raise AuthError(403, "local mode answers only under a loopback address or localhost "
                                 "(the Host header names another site)")
        return Identity(self.config.local_user, None, True, local=True)

    def _peer_trusted(self, request: Request) -> bool:
        host = request.client.host if request.client else ""
        try:
            peer = ipaddress.ip_address(host)
        except ValueError:
            return False
        if isinstance(peer, ipaddress.IPv6Address) and peer.ipv4_mapped is not None:
            peer = peer.ipv4_mapped  # a dual-stack socket reports IPv4 peers as ::ffff:a.b.c.d
        return any(peer in net for net in self.config.trusted_peers)

    @staticmethod
    def _single(request: Request, name: str) -> str | None:
        values: Sequence[str] = request.headers.getlist(name)
        if len(values) > 1:
            raise AuthError(400, f"the {name} header was sent {len(values)} times: refused (does your proxy "
                                 "append to it instead of replacing it?)")
        if not values:
            return None
        value = values[0].strip()
        if "," in value:
            raise AuthError(400, f"the {name} header holds several values: refused")
        return value

    def _header(self, request: Request) -> tuple[str, str | None, bool]:
        cfg = self.config
        names = (cfg.user_header, cfg.workspace_header, cfg.admin_header)
        present = [n for n in names if n.lower() in request.headers]
        if present and not self._peer_trusted(request):
            peer = request.client.host if request.client else "unknown"
            raise AuthError(403, f"identity headers from {peer}, which is not a trusted proxy "
                                 "(MOTIR_DASHBOARD_TRUSTED_PROXIES): refused")
        user = self._single(request, cfg.user_header) or ""
        workspace = self._single(request, cfg.workspace_header) or None
        admin_value = self._single(request, cfg.admin_header)
        if not user:
            raise AuthError(401, f"no identity: the {cfg.user_header} header is missing (set by your proxy)")
        if len(user) > 200 or not user.isprintable():
            raise AuthError(400, f"{cfg.user_header} is not a usable user name")
        if admin_value not in (None, "", ADMIN_TRUE, ADMIN_FALSE):
            raise AuthError(400, f"{cfg.admin_header} must be exactly {ADMIN_TRUE!r} or {ADMIN_FALSE!r}")
        return user, workspace, admin_value == ADMIN_TRUE

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
        ok = (record or self._dummy).check(password)
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
