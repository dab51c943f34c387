"""Prefixed secrets (API keys, node secrets and join tokens) and the codes a person types (staff's enrolment and
recovery codes).

A token reads `<kind>_<lookup>_<secret>`. Only `lookup` (to find the row and to
show in lists) and a SHA-256 hash of the whole token are stored; the plain token
exists once, in the answer to whoever created it. The secret part carries 256
bits of entropy, so a fast hash is safe here (a password hash would only slow
every API call).

A typed code is 16 base32 characters (80 bits), shown in groups of four: short enough to copy from an email or
a sheet of paper, and still far past what an offline guess at its stored hash could search, so a fast hash is
safe for it too.
"""

from __future__ import annotations

import base64
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


TYPED_CODE_BYTES = 10  # 16 characters of base32
_TYPED_CODE_GROUP = 4


def issue_typed_code() -> str:
    """A new code as a person reads it: `abcd-efgh-ijkl-mnop` (RFC 4648 base32 in lower case)."""
    plain = base64.b32encode(secrets.token_bytes(TYPED_CODE_BYTES)).decode().lower()
    return "-".join(plain[i:i + _TYPED_CODE_GROUP] for i in range(0, len(plain), _TYPED_CODE_GROUP))


def normalise_typed_code(typed: str) -> str:
    """The code as `issue_typed_code` made it, without its dashes, whatever spaces, dashes or case were typed."""
    return "".join(typed.split()).replace("-", "").lower()


def typed_code_digest(typed: str) -> str:
    """What is stored of a typed code: 96 bits of its SHA-256 in URL-safe base64, 16 characters.

    NOTE: 16 characters, so that it fits django-otp's `StaticToken.token` (the recovery codes); 96 bits of
    digest for an 80-bit code leave no shortcut to a match.
    """
    digest = hashlib.sha256(normalise_typed_code(typed).encode()).digest()[:12]
    return base64.urlsafe_b64encode(digest).decode()
