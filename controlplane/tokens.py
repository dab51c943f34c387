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
import secrets
from dataclasses import dataclass

LOOKUP_LENGTH = 12


@dataclass(slots=True, frozen=True)
class IssuedToken:
    plain: str  # show once, store never
    lookup: str
    digest: str


def hash_token(plain: str) -> str:
    return hashlib.sha256(plain.encode()).hexdigest()


def issue_token(kind: str) -> IssuedToken:
    lookup = secrets.token_hex(LOOKUP_LENGTH // 2)
    plain = f"{kind}_{lookup}_{secrets.token_urlsafe(32)}"
    return IssuedToken(plain=plain, lookup=lookup, digest=hash_token(plain))


def split_token(plain: str, kind: str) -> str | None:
    """The lookup part of a well-formed token of this kind, else None."""
    parts = plain.split("_", 2)
    if len(parts) != 3 or parts[0] != kind or len(parts[1]) != LOOKUP_LENGTH or not parts[2]:
        return None
    return parts[1]


def token_matches(plain: str, digest: str) -> bool:
    return hmac.compare_digest(hash_token(plain), digest)
