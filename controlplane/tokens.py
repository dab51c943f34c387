"""Prefixed secrets: API keys, node secrets and join tokens.

A token reads `<kind>_<lookup>_<secret>`. Only `lookup` (to find the row and to
show in lists) and a SHA-256 hash of the whole token are stored; the plain token
exists once, in the answer to whoever created it. The secret part carries 256
bits of entropy, so a fast hash is safe here (a password hash would only slow
every API call).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

API_KEY_KIND = "ip"
LOOKUP_LENGTH = 12
SECRET_BYTES = 32
# `<kind>_<lookup: hex>_<secret: URL-safe base64 of SECRET_BYTES, unpadded>`
_SHAPE = re.compile(rf"^([a-z]+)_([0-9a-f]{{{LOOKUP_LENGTH}}})_([A-Za-z0-9_-]{{{(SECRET_BYTES * 4 + 2) // 3}}})$")


@dataclass(slots=True, frozen=True)
class IssuedToken:
    plain: str  # show once, store never
    lookup: str
    digest: str


def hash_token(plain: str) -> str:
    return hashlib.sha256(plain.encode()).hexdigest()


def issue_token(kind: str) -> IssuedToken:
    lookup = secrets.token_hex(LOOKUP_LENGTH // 2)
    plain = f"{kind}_{lookup}_{secrets.token_urlsafe(SECRET_BYTES)}"
    return IssuedToken(plain=plain, lookup=lookup, digest=hash_token(plain))


def split_token(plain: str, kind: str) -> str | None:
    """The lookup part of a well-formed token of this kind (prefix, length and characters as
    `issue_token` makes them), else None: a malformed token is refused without a query."""
    match = _SHAPE.match(plain)
    if match is None or match.group(1) != kind:
        return None
    return match.group(2)


def token_matches(plain: str, digest: str) -> bool:
    return hmac.compare_digest(hash_token(plain), digest)
