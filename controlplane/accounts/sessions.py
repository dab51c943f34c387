"""The console's session store (`SESSION_ENGINE`): Django's database store, taking only ids it could have made.

A session id comes from a cookie anyone may write, and `http.cookies` unquotes octal escapes in a quoted value
(`"\\000…"` is a NUL): Django's own check (any 8 characters or more) let such an id reach PostgreSQL, which refuses a
NUL with a `DataError`, a 500 on every console page and on the gateway's session calls. An id Django never issues
(32 of `VALID_KEY_CHARS`) names no session, so it is refused before any query, as an unknown one is after it.
"""

from __future__ import annotations

from django.contrib.sessions.backends import db
from django.contrib.sessions.backends.base import VALID_KEY_CHARS

SESSION_KEY_LENGTH = 32  # as `SessionBase._get_new_session_key` makes them


class SessionStore(db.SessionStore):
    def _validate_session_key(self, key) -> bool:
        return (isinstance(key, str) and len(key) == SESSION_KEY_LENGTH
                and all(character in VALID_KEY_CHARS for character in key))
