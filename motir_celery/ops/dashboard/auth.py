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
  ``motir dashboard --allow-plaintext-passwords`` (development only), unsalted
  ``sha256:`` always. A file others may write is refused; one they may read is
  loudly warned about.

  Sign-in under attack (docs/security.md): verification runs on a bounded pool
  of threads, never the event loop (a full pool answers 503 with
  ``Retry-After``); failures back off per client and per user name (429 with
  ``Retry-After``); an unknown name costs what a known one costs (a dummy hash of
  the users' own kind and parameters, and with mixed kinds every failure padded to
  the dearest). The client is the TCP peer, or — from a trusted proxy — the
  nearest ``X-Forwarded-For`` hop that is not one; IPv6 clients count per /64.

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

import asyncio
import base64
import binascii
import getpass
import hashlib
import hmac
import ipaddress
import logging
import math
import os
import secrets
import stat
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence, Union
from urllib.parse import urlsplit

from itsdangerous import BadSignature, SignatureExpired, TimestampSigner
from starlette.requests import Request

from motir_celery.errors import ConfigurationError, WorkspaceError
from motir_celery.ops.dashboard.passwords import cost_class, dummy_like, hash_kind, hash_password, verify_password
from motir_celery.ops.dashboard.signin import Backoff, Saturated, VerifierPool
from motir_celery.store.db import validate_workspace_id

__all__ = ["Identity", "AuthConfig", "Authenticator", "AuthError", "CsrfTokens", "load_users", "parse_networks",
           "is_loopback"]

log = logging.getLogger("motir_celery.ops.dashboard")

Network = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]
LOOPBACK: tuple[Network, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
#: The only spellings of the admin header: "true" is admin, "false" is not; anything else is a 400.
ADMIN_TRUE, ADMIN_FALSE = "true", "false"

# Sign-in under attack (basic mode; docs/security.md). A client's first CLIENT_FREE failures
# answer at once, then it waits BACKOFF_BASE s after its last failure, doubling to BACKOFF_CAP;
# a user name (known or not, so the back-off says nothing about which exist) the same after
# USER_FREE failures from clients that never signed in as it. One failure is forgotten per
# full FORGET_EVERY s without one.
CLIENT_FREE, USER_FREE = 5, 10
BACKOFF_BASE, BACKOFF_CAP, FORGET_EVERY = 1.0, 60.0, 60.0
#: Keys each back-off remembers (clients, user names), and (client, user) pairs that signed in.
MAX_TRACKED, MAX_KNOWN_PAIRS = 10_000, 4096
#: A verified credential is answered from memory (an HMAC of it under a per-process key) for this long.
VERIFIED_TTL, MAX_VERIFIED = 300.0, 1024


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
    def __init__(self, status: int, message: str, *, challenge: bool = False, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.challenge = status, message, challenge
        #: Seconds before a retry can succeed (429, 503, a 401 that started a back-off): ``Retry-After``.
        self.retry_after = retry_after


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
    #: Basic mode: threads verifying passwords, and sign-ins that may wait for one (more: 503).
    verify_threads: int = 2
    verify_queue: int = 4

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
        return cls(
            mode=mode,
            users_file=users_file,
            trusted_proxies=parse_networks(env.get("MOTIR_DASHBOARD_TRUSTED_PROXIES", "")),
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
        if kind in ("argon2", "scrypt"):
            try:
                cost_class(password)
            except ValueError as exc:
                raise ConfigurationError(f"{path}:{number}: user {user!r} has a malformed {kind} hash ({exc}); "
                                         "make one with `motir dashboard hash-password`") from None
        if kind == "plain":
            if not allow_plaintext:
                raise ConfigurationError(
                    f"{path}:{number}: user {user!r} has a clear-text password; store a hash from "
                    "`motir dashboard hash-password` (motir dashboard --allow-plaintext-passwords accepts clear "
                    "text, for development only)")
            plaintext.append(user)
        admin = workspace == "*"
        users[user] = _User(password, None if admin else workspace, admin)
    _check_file_mode(path, plaintext=bool(plaintext))
    if plaintext:
        log.warning("WARNING: %s holds clear-text passwords (users %s), accepted because "
                    "--allow-plaintext-passwords: development only", path, ", ".join(plaintext))
    return users


class Authenticator:
    """Says who a request is (``identify``); in basic mode it also keeps the sign-in's memory: the
    back-offs, the clients that signed in as each user, recently verified credentials, the pool."""

    def __init__(self, config: AuthConfig) -> None:
        self.config = config
        self._users = (load_users(config.users_file, allow_plaintext=config.allow_plaintext)
                       if config.mode == "basic" and config.users_file else {})
        self._clients: Backoff[str] = Backoff(free=CLIENT_FREE, base=BACKOFF_BASE, cap=BACKOFF_CAP,
                                              forget_every=FORGET_EVERY, max_keys=MAX_TRACKED)
        self._names: Backoff[bytes] = Backoff(free=USER_FREE, base=BACKOFF_BASE, cap=BACKOFF_CAP,
                                              forget_every=FORGET_EVERY, max_keys=MAX_TRACKED)
        self._known_pairs: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._verified: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._cache_key = secrets.token_bytes(32)
        self._in_flight: dict[str, int] = {}
        self._lock = threading.Lock()
        self._pool = VerifierPool(config.verify_threads, config.verify_queue)
        # An unknown name is checked against a dummy of the users' most common cost class (kind and
        # parameters): it costs what the typical known user costs.
        self._class_of = {name: cost_class(u.password) for name, u in self._users.items()}
        classes = Counter(self._class_of.values())
        samples = {self._class_of[name]: u.password for name, u in self._users.items()}
        #: Seconds one failed verification costs, per class (kept current by every verification).
        self._cost: dict[str, float] = {}
        self._mixed = len(classes) > 1
        if self._mixed:
            # Mixed classes: the minority's cost would tell its names from unknown ones, so every failed
            # verification is padded to what the dearest class costs (measured now, then kept current).
            self._cost = _calibrate([samples[c] for c in classes])
            log.info("users file %s mixes password hash classes (%s): failed sign-ins are padded to the dearest, "
                     "%.0f ms; rehash with one kind to drop the padding", config.users_file,
                     ", ".join(f"{n}× {c}" for c, n in classes.most_common()), 1000 * max(self._cost.values()))
        typical = max(classes, key=lambda c: (classes[c], self._cost.get(c, 0.0)), default=None)
        if typical is not None:
            dummy = dummy_like(samples[typical])
        elif config.mode == "basic":  # an empty users file: nobody signs in, at the cost of a real hash
            dummy = hash_password(secrets.token_urlsafe(16))
        else:  # no passwords in this mode: never verified against
            dummy = secrets.token_urlsafe(16)
        self._dummy = _User(dummy, None, False)
        self._dummy_class = typical or cost_class(dummy)

    @property
    def unknown_user_cost(self) -> str:
        """The cost class an unknown name is verified at (the users' most common one)."""
        return self._dummy_class

    async def identify(self, request: Request) -> Identity:
        """The caller's identity, or ``AuthError`` (401 without one, 403 without a workspace,
        429/503 with ``retry_after`` when a sign-in must wait)."""
        if self.config.mode == "local":
            return self._local(request)
        if self.config.mode == "basic":
            user, workspace, admin = await self._basic(request)
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

    def _trusted(self, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        return any(address in net for net in self.config.trusted_peers)

    def _peer_trusted(self, request: Request) -> bool:
        peer = _address(request.client.host if request.client else "")
        return peer is not None and self._trusted(peer)

    def client_of(self, request: Request) -> str:
        """Who the back-off counts a sign-in against: the TCP peer, or — when the peer is a trusted
        proxy — the nearest ``X-Forwarded-For`` hop that is not one (walking from the right, where
        each proxy appended the address it saw; a malformed hop stops the walk at the proxy that
        passed it). IPv6 counts per /64: one host owns a whole /64."""
        host = request.client.host if request.client else ""
        address = _address(host)
        if address is None:
            return host or "unknown"
        if self._trusted(address):
            hops = [h.strip() for h in ",".join(request.headers.getlist("x-forwarded-for")).split(",") if h.strip()]
            for hop in reversed(hops):
                forwarded = _address(hop)
                if forwarded is None:
                    break
                address = forwarded
                if not self._trusted(address):
                    break
        if isinstance(address, ipaddress.IPv6Address):
            return str(ipaddress.IPv6Network((address, 64), strict=False))
        return str(address)

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

    async def _basic(self, request: Request) -> tuple[str, str | None, bool]:
        header = request.headers.get("authorization", "")
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic" or not encoded:
            raise AuthError(401, "sign in required", challenge=True)
        try:
            user, _, password = base64.b64decode(encoded, validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            raise AuthError(401, "malformed basic credentials", challenge=True) from None
        client = self.client_of(request)
        name = hashlib.blake2b(user.encode(), digest_size=16).digest()  # fixed size, whatever was sent
        # 1. The back-off, before anything is verified — the memory of verified credentials included,
        #    or a blocked client could guess against it at full speed.
        exempt = self._known_pair(client, user)
        wait = max(self._clients.wait(client), 0.0 if exempt else self._names.wait(name))
        if wait > 0:
            raise AuthError(429, f"too many failed sign-ins from your address or for this user name: "
                                 f"try again in {math.ceil(wait)} s", retry_after=math.ceil(wait))
        record = self._users.get(user)
        digest = hmac.new(self._cache_key, user.encode() + b"\0" + password.encode(), hashlib.sha256).digest()
        if record is not None and self._recently_verified(digest, user):
            return user, record.workspace, record.admin
        # 2. One verification at a time per client, on the pool; its failure is counted before it
        #    runs (so concurrent guesses cannot outrun the count) and taken back if it succeeds.
        with self._lock:
            if self._in_flight.get(client):
                raise AuthError(429, "a sign-in from your address is being checked: try again in 1 s",
                                retry_after=1)
            self._in_flight[client] = 1
        target = record or self._dummy
        klass = self._class_of[user] if record is not None else self._dummy_class
        try:
            future = self._pool.submit(lambda: _timed(target.check, password), priority=self._clients.failures(client))
        except Saturated:
            self._release(client)
            raise self._busy() from None
        future.add_done_callback(lambda _: self._release(client))
        _, client_started = self._clients.fail(client)
        user_started = False if exempt else self._names.fail(name)[1]
        try:
            ok, took = await asyncio.wrap_future(future)
        except Saturated:  # pushed out of the wait list by a cleaner client: not a guess
            self._clients.refund(client)
            if not exempt:
                self._names.refund(name)
            raise self._busy() from None
        self._observe(klass, took)
        if record is not None and ok:
            self._clients.refund(client)
            if not exempt:
                self._names.refund(name)
            self._remember(client, user, digest)
            return user, record.workspace, record.admin
        self._log_backoff(request, client, user if record is not None else None, client_started, user_started)
        padded = self._padded(klass, took)
        if padded > took:
            await asyncio.sleep(padded - took)
        wait = max(self._clients.settle(client), 0.0 if exempt else self._names.settle(name))
        raise AuthError(401, "wrong user name or password", challenge=True,
                        retry_after=math.ceil(wait) if wait > 0 else None)

    # --- the sign-in's memory ---------------------------------------------------

    def _busy(self) -> AuthError:
        """The answer when the pool is full: 503 (the server is over capacity, not this client), no
        challenge (the browser keeps its password), and not a failure (nothing was verified).
        Retry-After: the time the pool needs to drain what it holds."""
        with self._lock:
            per_job = max(self._cost.values(), default=0.2)
        drain = self._pool.capacity * per_job / self._pool.threads
        return AuthError(503, "the dashboard is busy checking other sign-ins: try again shortly",
                         retry_after=max(1, math.ceil(drain)))

    def _release(self, client: str) -> None:
        with self._lock:
            self._in_flight.pop(client, None)

    def _observe(self, klass: str, took: float) -> None:
        """Keep the cost of each class current (the padding floor, the 503's Retry-After)."""
        with self._lock:
            before = self._cost.get(klass)
            self._cost[klass] = took if before is None else 0.8 * before + 0.2 * took

    def _padded(self, klass: str, took: float) -> float:
        """With mixed classes, how long this failed verification should seem to take: what the dearest
        class would have taken now — ``took`` scaled by the classes' cost ratio, so the padding follows
        the machine's load at once (a padding to the dearest's running average lags a rising load)."""
        with self._lock:
            if not self._mixed or not self._cost.get(klass):
                return took
            return took * max(self._cost.values()) / self._cost[klass]

    def _known_pair(self, client: str, user: str) -> bool:
        with self._lock:
            return (client, user) in self._known_pairs

    def _recently_verified(self, digest: bytes, user: str) -> bool:
        with self._lock:
            entry = self._verified.get(digest)
            if entry is None:
                return False
            if entry[1] < time.monotonic() or entry[0] != user:  # (the digest already binds the user)
                del self._verified[digest]
                return False
            return True

    def _remember(self, client: str, user: str, digest: bytes) -> None:
        with self._lock:
            self._known_pairs[(client, user)] = None
            self._known_pairs.move_to_end((client, user))
            while len(self._known_pairs) > MAX_KNOWN_PAIRS:
                self._known_pairs.popitem(last=False)
            self._verified[digest] = (user, time.monotonic() + VERIFIED_TTL)
            self._verified.move_to_end(digest)
            while len(self._verified) > MAX_VERIFIED:
                self._verified.popitem(last=False)

    def _log_backoff(self, request: Request, client: str, user: str | None, client_started: bool,
                     user_started: bool) -> None:
        if client_started:
            peer = request.client.host if request.client else ""
            shared = ""
            if client == peer and self._peer_trusted(request) and "x-forwarded-for" not in request.headers:
                shared = (f"; {peer} is a trusted proxy that sent no X-Forwarded-For, so every client behind it "
                          "shares this back-off (set X-Forwarded-For in the proxy)")
            log.warning("sign-in back-off: %d failed sign-ins from %s; it now waits %.0f s after each failure, "
                        "doubling to %.0f s%s", CLIENT_FREE, client, BACKOFF_BASE, BACKOFF_CAP, shared)
        if user_started:
            who = f"user {user[:64]!r}" if user is not None else "an unknown user name"
            log.warning("sign-in back-off: %d failed sign-ins for %s from clients that never signed in as it; "
                        "they now wait %.0f s after each failure, doubling to %.0f s (its own clients do not)",
                        USER_FREE, who, BACKOFF_BASE, BACKOFF_CAP)


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(host.strip().strip("[]"))
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # a dual-stack socket reports IPv4 peers as ::ffff:a.b.c.d
    return address


def _timed(check: Callable[[str], bool], password: str) -> tuple[bool, float]:
    started = time.perf_counter()
    ok = check(password)
    return ok, time.perf_counter() - started


def _calibrate(hashes: list[str]) -> dict[str, float]:
    """What one failed verification of each hash's class costs here: the median of three, the classes
    taken in turn (so a change of load meets them all alike)."""
    dummies = {cost_class(h): dummy_like(h) for h in hashes}
    took: dict[str, list[float]] = {c: [] for c in dummies}
    for _ in range(3):
        for c, dummy in dummies.items():
            took[c].append(_timed(lambda given: verify_password(dummy, given), "x")[1])
    return {c: sorted(t)[1] for c, t in took.items()}


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
        return hmac.compare_digest(user.encode(), identity.user.encode())  # str: ASCII only
