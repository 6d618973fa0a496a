"""Password hashes for the dashboard's users file: argon2id, or scrypt from the standard library.

``motir dashboard hash-password`` writes one (argon2id when argon2-cffi is
installed — it is part of the ``dashboard`` extra — else scrypt); the users
file accepts both forms and nothing weaker:

* ``$argon2id$v=19$m=…,t=…,p=…$<salt>$<hash>`` (argon2-cffi's PHC string);
* ``$scrypt$ln=<log2 N>,r=<r>,p=<p>$<salt b64>$<hash b64>``.

An unsalted ``sha256:<hex>`` is refused (one GPU guesses billions a second),
and clear text only under an explicit development flag (``auth.py``).
A sign-in for an unknown name is verified against ``dummy_like(<a user's
hash>)``: the same kind and parameters, so the same cost (``cost_class`` names
what a verification costs; docs/security.md, *Sign-in under attack*).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from types import ModuleType
from typing import Any

argon2: ModuleType | None
try:  # the dashboard extra; without it, scrypt only
    import argon2
    import argon2.exceptions
except ImportError:  # pragma: no cover — the dev environment has it
    argon2 = None

__all__ = ["hash_password", "verify_password", "hash_kind", "cost_class", "dummy_like", "HashKind"]

HashKind = str  # "argon2" | "scrypt" | "sha256" | "plain"

#: scrypt cost: N = 2**15, r = 8, p = 1 (OWASP's minimum is 2**17 at r=8 for logins
#: with 64 MiB to spare; 2**15 keeps a login at ~50 ms and 32 MiB on a small host).
SCRYPT_LN, SCRYPT_R, SCRYPT_P = 15, 8, 1


def _argon2(stored: str | None = None) -> Any:
    """argon2-cffi's hasher (default parameters, or ``stored``'s); None without argon2-cffi (an optional extra)."""
    if argon2 is None:
        return None
    if stored is None:
        return argon2.PasswordHasher()
    return argon2.PasswordHasher.from_parameters(argon2.extract_parameters(stored))


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)


def _scrypt(password: str, salt: bytes, ln: int, r: int, p: int) -> bytes:
    n = 1 << ln
    return hashlib.scrypt(password.encode(), salt=salt, n=n, r=r, p=p, maxmem=128 * n * r * p + 1024 * 1024,
                          dklen=32)


def hash_password(password: str, *, scheme: str | None = None) -> str:
    """A salted hash of ``password`` for the users file (argon2id, else scrypt)."""
    if not password:
        raise ValueError("an empty password cannot be hashed")
    hasher = _argon2() if scheme in (None, "argon2") else None
    if hasher is not None:
        return str(hasher.hash(password))
    if scheme == "argon2":
        raise ValueError("argon2 needs argon2-cffi: pip install 'motir-celery[dashboard]'")
    return _scrypt_hash(password, SCRYPT_LN, SCRYPT_R, SCRYPT_P)


def _scrypt_hash(password: str, ln: int, r: int, p: int, salt_len: int = 16) -> str:
    salt = secrets.token_bytes(salt_len)
    return f"$scrypt$ln={ln},r={r},p={p}${_b64(salt)}${_b64(_scrypt(password, salt, ln, r, p))}"


def _scrypt_fields(stored: str) -> tuple[int, int, int, bytes, bytes]:
    """``$scrypt$ln=…,r=…,p=…$salt$digest`` → (ln, r, p, salt, digest); ValueError if malformed or out of bounds."""
    try:
        _, _, params, salt, digest = stored.split("$")
        fields = dict(item.split("=", 1) for item in params.split(","))
        ln, r, p = int(fields["ln"]), int(fields["r"]), int(fields["p"])
        raw_salt, raw_digest = _unb64(salt), _unb64(digest)
    except (ValueError, KeyError):
        raise ValueError("not a $scrypt$ln=…,r=…,p=…$salt$digest hash") from None
    if not (1 <= ln <= 20 and 1 <= r <= 32 and 1 <= p <= 16) or not raw_salt or len(raw_digest) != 32:
        raise ValueError(f"scrypt parameters ln={ln}, r={r}, p={p} (or its salt or digest) out of bounds")
    return ln, r, p, raw_salt, raw_digest


def hash_kind(stored: str) -> HashKind:
    if stored.startswith("$argon2"):
        return "argon2"
    if stored.startswith("$scrypt$"):
        return "scrypt"
    if stored.startswith("sha256:"):
        return "sha256"
    return "plain"


def verify_password(stored: str, given: str) -> bool:
    """Does ``given`` match ``stored``? A malformed hash matches nothing."""
    kind = hash_kind(stored)
    if kind == "argon2":
        hasher = _argon2()
        if hasher is None:
            raise RuntimeError("an argon2 hash needs argon2-cffi: pip install 'motir-celery[dashboard]'")
        try:
            return bool(hasher.verify(stored, given))
        except Exception:  # noqa: BLE001 — argon2 raises VerifyMismatchError, InvalidHashError, …
            return False
    if kind == "scrypt":
        try:
            ln, r, p, salt, expected = _scrypt_fields(stored)
        except ValueError:
            return False
        return hmac.compare_digest(_scrypt(given, salt, ln, r, p), expected)
    if kind == "plain":  # only reaches here when the development flag allowed it
        return hmac.compare_digest(given.encode(), stored.encode())
    return False


def cost_class(stored: str) -> str:
    """What verifying against ``stored`` costs, as a name: its kind and every parameter that sets the cost.

    Two hashes of one class cost the same to verify (the salt and digest differ, the work does not).
    ValueError for a malformed argon2 or scrypt hash (the users file refuses it: it would match
    nothing, at no cost, which tells a timing observer that the name exists).
    """
    kind = hash_kind(stored)
    if kind == "argon2":
        if argon2 is None:
            raise ValueError("an argon2 hash needs argon2-cffi: pip install 'motir-celery[dashboard]'")
        try:
            q = argon2.extract_parameters(stored)
        except (argon2.exceptions.InvalidHashError, ValueError):
            raise ValueError("not an argon2 PHC string ($argon2id$v=19$m=…,t=…,p=…$salt$hash)") from None
        return (f"argon2{q.type.name.lower()} v={q.version} m={q.memory_cost} t={q.time_cost} "
                f"p={q.parallelism} hash_len={q.hash_len}")
    if kind == "scrypt":
        ln, r, p, _, _ = _scrypt_fields(stored)
        return f"scrypt ln={ln} r={r} p={p}"
    return kind


def dummy_like(stored: str) -> str:
    """A hash of a random password with ``stored``'s kind and parameters: what an unknown name is checked against."""
    secret = secrets.token_urlsafe(16)
    kind = hash_kind(stored)
    if kind == "argon2":
        hasher = _argon2(stored)
        if hasher is None:
            raise RuntimeError("an argon2 hash needs argon2-cffi: pip install 'motir-celery[dashboard]'")
        return str(hasher.hash(secret))
    if kind == "scrypt":
        ln, r, p, salt, _ = _scrypt_fields(stored)
        return _scrypt_hash(secret, ln, r, p, salt_len=len(salt))
    if kind == "plain":
        return secrets.token_urlsafe(max(len(stored), 16))[:max(len(stored), 16)]
    raise ValueError(f"no dummy for a {kind} hash (refused in the users file)")
