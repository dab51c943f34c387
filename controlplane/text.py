"""Text a caller sends that PostgreSQL may be asked to keep or to compare: ids, query parameters,
metadata, and the error messages that quote a batch line.

PostgreSQL refuses NUL in `text` and `\\u0000` in `jsonb`, and a lone surrogate (JSON may carry
`"\\ud800"`) is not UTF-8: either is a `DataError` (or an encoding error) when written or compared, a
500 on an API call and, in a worker, a batch retried for ever. Such text is refused where it comes in
(`storable`) and escaped wherever it is quoted back (`shown`), as it is in a log line (`controlplane.access_log`: a
path's `%0a` wrote forged lines).
"""

from __future__ import annotations

import unicodedata


def storable(text: str) -> bool:
    """Whether PostgreSQL can take the text, in a `text` column or inside `jsonb`."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def is_plain(text: str) -> bool:
    """Storable and without control characters: fit for an identifier a caller chooses."""
    return not any(unicodedata.category(character) in ("Cc", "Cs") for character in text)


def shown(text: str) -> str:
    """The text with each control character and lone surrogate escaped (`\\x00`, `\\ud800`): safe to
    store and to show, and still readable."""
    if is_plain(text):
        return text
    return "".join(ascii(character)[1:-1] if unicodedata.category(character) in ("Cc", "Cs") else character
                   for character in text)


def one_line(text: str) -> str:
    """The text with each run of whitespace, line breaks included, as one space: fit for a mail's subject. A name from
    before sign-up refused control characters may hold a line break, and no header may (Django refuses the message)."""
    return " ".join(text.split())
