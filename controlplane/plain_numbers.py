"""Whole numbers typed into console forms and query strings."""

from __future__ import annotations

INT32_MAX = 2**31 - 1  # PostgreSQL's `integer`
INT64_MAX = 2**63 - 1  # PostgreSQL's `bigint`


def plain_int(text: str, *, maximum: int = INT32_MAX) -> int | None:
    """`text` as a whole number from 0 to `maximum` (ASCII digits, surrounding spaces allowed), or None.

    NOTE: `str.isdigit()` is true of "²" and "٣", which `int()` refuses or reads as 3, and `int()` refuses a
    string of over 4,300 digits: each was a 500 where a form or query string checked `isdigit()` only."""
    text = text.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(maximum)):
        return None
    value = int(text)
    return value if value <= maximum else None
