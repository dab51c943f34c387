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
    before sign-up refused control characters may hold a line break, and no header may (Django refuses the message);
    what else `name_problem` refuses is escaped (`shown_name`): a direction override in a name stored before it was
    refused reordered the subject, and the body that quotes it, of every mail naming the organisation."""
    return shown_name(" ".join(text.split()))


# Characters a name may not hold (`name_problem`): controls, format characters (the bidi overrides and isolates
# U+202A–U+202E and U+2066–U+2069, the marks U+200E/U+200F and U+061C, zero-width ones), lone surrogates, private-use and
# unassigned code points, and the line and paragraph separators.
# NOTE: a bidi override in an API key's name (`"prod\u202e"` …) showed another admin, on the keys page and in
# `/api/v1/keys`, text in another order than it has (Trojan Source): a key that looked like another.
HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
# And the default-ignorable characters of other categories that show as nothing and that no name needs: the Hangul
# fillers (letters, Lo), the combining grapheme joiner and Khmer's inherent vowels (marks, Mn). Variation selectors are
# not among them (an emoji's U+FE0F).
# NOTE: none of these is in HIDDEN_CATEGORIES: a key named "\u3164" was listed as unnamed, "prod\u3164key" as
# "prod key" (the review of the name rule).
INVISIBLE_CHARACTERS = frozenset("\u034f\u115f\u1160\u17b4\u17b5\u3164\uffa0")


# And the variation selectors that show as nothing but after a character of their own script, which no other name
# needs: Mongolian's free variation selectors (U+180B–U+180D, U+180F: a Mongolian letter's form) and the ideographic
# ones (U+E0100–U+E01EF: a CJK ideograph's glyph, as in a Japanese family name).
# NOTE: "prod\U000e0100" and "prod\u180b" read "prod" (marks, Mn, in no category above): a key that looked like another.
MONGOLIAN_SELECTORS = frozenset("\u180b\u180c\u180d\u180f")
IDEOGRAPHIC_SELECTORS = range(0xE0100, 0xE01F0)
# And the standard ones (U+FE00–U+FE0F), after a character they vary alone: a non-ASCII symbol (an emoji and U+FE0F,
# "©" and U+FE0E, a mathematical symbol), a CJK ideograph or Myanmar letter, a keycap's "#", "*" or digit
# (followed by the keycap, U+20E3). NOTE: they were allowed anywhere (for an emoji's U+FE0F): "prod\ufe0f-key" read
# "prod-key", as the selectors above did.
STANDARD_SELECTORS = frozenset(chr(code) for code in range(0xFE00, 0xFE10))
KEYCAP_BASES = frozenset("#*0123456789")
EMOJI_PUNCTUATION = frozenset("\u203c\u2049\u3030\u303d")  # "‼", "⁉", "〰", "〽": emoji, though punctuation


def _varies(before: str, after: str) -> bool:
    """Whether a standard variation selector between `before` and `after` varies `before` (`STANDARD_SELECTORS`)."""
    if not before or before in STANDARD_SELECTORS:
        return False
    if before.isascii():
        return before in KEYCAP_BASES and after == "\u20e3"
    if unicodedata.category(before)[0] == "S" or before in EMOJI_PUNCTUATION:
        return True
    return unicodedata.name(before, "").startswith(("CJK ", "MYANMAR "))


def _is_hidden(character: str, before: str = "", after: str = "") -> bool:
    """Whether `character`, after `before` and before `after` (its neighbours; "" at either end), is one a name may not
    hold."""
    if character in STANDARD_SELECTORS:
        return not _varies(before, after)
    if character in MONGOLIAN_SELECTORS:
        return not "\u1800" <= before <= "\u18af" or before in MONGOLIAN_SELECTORS
    if ord(character) in IDEOGRAPHIC_SELECTORS:
        return not (before and unicodedata.name(before, "").startswith("CJK "))
    return unicodedata.category(character) in HIDDEN_CATEGORIES or character in INVISIBLE_CHARACTERS


def _hidden(text: str) -> list[bool]:
    """`_is_hidden` of each character of `text`, in its place."""
    return [_is_hidden(character, text[position - 1] if position else "", text[position + 1:position + 2])
            for position, character in enumerate(text)]


def as_name(text: str) -> str:
    """A name a caller chose, in the one form it is stored and compared in: NFC (`e` and a combining acute, and `é`,
    are one name)."""
    return unicodedata.normalize("NFC", text)


def name_problem(text: str) -> str | None:
    """Why `text` may not be a name another person reads (a key's, an organisation's, an address), or None: it holds a
    character in `HIDDEN_CATEGORIES` or `INVISIBLE_CHARACTERS`, named by its code point."""
    for position, (character, hidden) in enumerate(zip(text, _hidden(text), strict=True), 1):
        if hidden:
            return (f"Use letters, digits, spaces and punctuation only: character {position} is U+{ord(character):04X}, "
                    "a control, format (such as a direction override), private-use, unassigned or invisible character.")
    return None


def shown_name(text: str) -> str:
    """A name stored before `name_problem` refused it, with each character it refuses escaped (`\\u202e`): shown as
    it is, never reordered or hidden."""
    if (text.isascii() and text.isprintable()) or not any(refused := _hidden(text)):
        return text
    return "".join(ascii(character)[1:-1] if hidden else character for character, hidden in zip(text, refused, strict=True))
