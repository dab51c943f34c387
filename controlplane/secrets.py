"""Secrets at rest: customers' source credentials and engines' API keys, encrypted with Fernet.

Keys come from `INFERPLANE_ENCRYPTION_KEYS` (comma-separated Fernet keys, newest first). The first
encrypts; every key decrypts, so a key is rotated by putting a new one in front, running
`manage.py rotate_encryption_keys` (re-encrypts every stored secret with the new key), then
dropping the old one. In development (DJANGO_DEBUG with no keys set) a key is generated once in the
data folder, like the development `SECRET_KEY`.

NOTE: a decrypted value lives only in the process that needs it (the gateway for engine keys, the
heartbeat answer for a replica's credentials) and never goes to logs, the API or the audit log.
"""

from __future__ import annotations

import functools

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings

# Every encrypted column, as ("app_label.Model", "field"): `manage.py rotate_encryption_keys`
# re-encrypts exactly these. NOTE: a new encrypted column is declared here, or rotation misses it.
ENCRYPTED_FIELDS: tuple[tuple[str, str], ...] = (
    ("endpoints.ModelCredential", "encrypted_secrets"),
    ("endpoints.Replica", "encrypted_engine_key"),
)


class SecretUnreadable(Exception):
    """A stored secret cannot be decrypted with any configured key (a key was dropped too early)."""


@functools.cache
def _fernet() -> MultiFernet:
    keys = list(settings.ENCRYPTION_KEYS)
    if not keys:
        raise RuntimeError("INFERPLANE_ENCRYPTION_KEYS is empty")
    return MultiFernet([Fernet(key) for key in keys])


def reset_keys() -> None:
    """Forget the cached keys (tests that change `settings.ENCRYPTION_KEYS`)."""
    _fernet.cache_clear()


def encrypt(plain: str) -> str:
    return _fernet().encrypt(plain.encode()).decode()


def decrypt(token: str) -> str:
    try:
        return _fernet().decrypt(token.encode()).decode()
    except InvalidToken:
        raise SecretUnreadable("a stored secret cannot be decrypted with the configured keys") from None


def rotate(token: str) -> str:
    """The same secret encrypted with the newest key."""
    try:
        return _fernet().rotate(token.encode()).decode()
    except InvalidToken:
        raise SecretUnreadable("a stored secret cannot be decrypted with the configured keys") from None
