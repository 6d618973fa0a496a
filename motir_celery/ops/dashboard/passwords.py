"""Password hashes for the dashboard's users file: argon2id, or scrypt from the standard library.

``motir dashboard hash-password`` writes one (argon2id when argon2-cffi is
installed — it is part of the ``dashboard`` extra — else scrypt); the users
file accepts both forms and nothing weaker:

* ``$argon2id$v=19$m=…,t=…,p=…$<salt>$<hash>`` (argon2-cffi's PHC string);
* ``$scrypt$ln=<log2 N>,r=<r>,p=<p>$<salt b64>$<hash b64>``.

An unsalted ``sha256:<hex>`` is refused (one GPU guesses billions a second),
and clear text only under an explicit development flag (``auth.py``).
Verification costs the same whether or not the user exists: ``dummy_hash``
is checked against for an unknown name.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from functools import lru_cache

__all__ = ["hash_password", "verify_password", "hash_kind", "dummy_hash", "HashKind"]

HashKind = str  # "argon2" | "scrypt" | "sha256" | "plain"

#: scrypt cost: N = 2**15, r = 8, p = 1 (OWASP's minimum is 2**17 at r=8 for logins
#: with 64 MiB to spare; 2**15 keeps a login at ~50 ms and 32 MiB on a small host).
SCRYPT_LN, SCRYPT_R, SCRYPT_P = 15, 8, 1


def _argon2() -> object | None:
    try:
        from argon2 import PasswordHasher
    except ImportError:
        return None
    return PasswordHasher()


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
        return str(hasher.hash(password))  # type: ignore[attr-defined]
    if scheme == "argon2":
        raise ValueError("argon2 needs argon2-cffi: pip install 'motir-celery[dashboard]'")
    salt = secrets.token_bytes(16)
    digest = _scrypt(password, salt, SCRYPT_LN, SCRYPT_R, SCRYPT_P)
    return f"$scrypt$ln={SCRYPT_LN},r={SCRYPT_R},p={SCRYPT_P}${_b64(salt)}${_b64(digest)}"


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
            return bool(hasher.verify(stored, given))  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 — argon2 raises VerifyMismatchError, InvalidHashError, …
            return False
    if kind == "scrypt":
        try:
            _, _, params, salt, digest = stored.split("$")
            fields = dict(item.split("=", 1) for item in params.split(","))
            ln, r, p = int(fields["ln"]), int(fields["r"]), int(fields["p"])
            if not (1 <= ln <= 20 and 1 <= r <= 32 and 1 <= p <= 16):
                return False
            expected = _unb64(digest)
            return hmac.compare_digest(_scrypt(given, _unb64(salt), ln, r, p), expected)
        except (ValueError, KeyError):
            return False
    if kind == "plain":  # only reaches here when the development flag allowed it
        return hmac.compare_digest(given.encode(), stored.encode())
    return False


@lru_cache(maxsize=4)
def dummy_hash(kind: HashKind) -> str:
    """A hash of the same kind as real ones, to verify against for an unknown user."""
    if kind == "plain":
        return secrets.token_urlsafe(16)
    return hash_password(secrets.token_urlsafe(16), scheme=kind if kind in ("argon2", "scrypt") else None)
