"""Logs name no person: every process's log lines are written with each email address replaced by a keyed digest.

The rule: a log line names a person by their id (user, invitation, organisation), never by their address or name.
Logs are shipped and kept where account erasure (`controlplane.accounts.erasure`) never reaches, so an address written
there outlives the account's deletion. Call sites log ids; this module is the net under them, for the lines no call site
of ours writes: an exception's message in a traceback (`SMTPRecipientsRefused({'ada@…': …})`, PostgreSQL's
`Key (username)=(ada@…) already exists`), Celery's task failure and retry lines with their exception, Django's
`django.request` and `django.security.*` lines. An address becomes `<address 1f2e…>` (`address_digest`): the same
address, the same digest, in every process, so an operator who knows a mailbox can still follow it
(`manage.py shell -c "from controlplane.log_privacy import address_digest; print(address_digest('ada@example.test'))"`),
and a reader of the log learns none. Django's lines name the request's path, which for a mailed link holds its secret
token (an email verification's token carries the address too, base64): written as the access log writes it
(`access_log.redacted_path`).

NOTE: installed as the log record factory (`configure`, Django's `LOGGING_CONFIG`), not as a handler's filter: Celery's
worker replaces the root logger's handlers with its own (`worker_hijack_root_logger`), and pytest's `caplog` has its
own; a record made by the factory is scrubbed before any handler sees it. A line without `@` costs one substring test.
"""

from __future__ import annotations

import logging
import logging.config
import re

from django.utils.crypto import salted_hmac

from controlplane.access_log import redacted_path

DIGEST_SALT = "inferplane.log-address"
# Loggers of Django's whose lines name the request's path as an argument (`log_response`, the CSRF refusal).
_PATH_LOGGERS = ("django.request", "django.security")
# An address as a log line may hold one: a local part, `@`, a domain with a dot and a top label of letters (or IDNA's
# `xn--`), so `redis://:secret@localhost` or a version `pkg@1.2` is left as it is.
# NOTE: each part bounded (a local part as long as a stored address may be, `backends.EMAIL_MAX_LENGTH`; a label 63
# and 127 labels, as DNS does): unbounded, the local part was tried from each character of a run of word characters to
# the run's end, quadratic in a line an outsider writes (a Host header, a path, an input an error names: 100 KB held the
# logging thread and the GIL 20 s, the web process with them).
# NOTE: `xn--` tried first: tried second, `xn` matched as a top label of letters and `ada@example.xn--p1ai` was hidden
# as the digest of `ada@example.xn`, its `--p1ai` left beside it.
_DOMAIN = r"[\w-]{1,63}(?:\.[\w-]{1,63}){0,126}\.(?:xn--[\w-]{1,59}|[^\W\d_]{2,63})\b"
_LOCAL_PUNCTUATION = r".!#$%&'*+/=?^`{|}~-"
_LOCAL_CHARACTER = rf"[\w{_LOCAL_PUNCTUATION}]"
_LOCAL_PART_MAX_LENGTH = 254
# What an address in a log line is; `hide_addresses` finds its matches, not `ADDRESS.sub` (see there).
ADDRESS = re.compile(rf"\w{_LOCAL_CHARACTER}{{0,{_LOCAL_PART_MAX_LENGTH - 1}}}@{_DOMAIN}")
_WHOLE_DOMAIN = re.compile(_DOMAIN)
# From the last word character of a local part (only its punctuation after it) to the end of its domain: tried from a
# word character, it reads no further than the next one, so the search is linear, and an `@` with no local part
# (` @b.cd`, `+@b.cd`) is passed over by it, not by a step of Python's each.
_LAST_WORD_TO_DOMAIN = re.compile(rf"\w[{_LOCAL_PUNCTUATION}]{{0,{_LOCAL_PART_MAX_LENGTH - 1}}}(?P<at>@){_DOMAIN}")
_LOCAL_RUN = re.compile(_LOCAL_CHARACTER + "*")
_WORD_CHARACTER = re.compile(r"\w")
# NOTE: each address costs a keyed digest (`address_digest`, microseconds): a line of ours names one or two, a stranger's
# 8 KB path of `1@b.cd/2@b.cd/…` 940, 5 ms of CPU and GIL on each request's access line (the gateway's 401 included),
# and a line 3 times longer. Past these, the line is cut to the end of its last address, never written unhidden.
MAX_ADDRESSES_A_LINE = 16


def hides_domain(domain: str) -> bool:
    """Whether a log line's address at `domain` is hidden whole (`hide_addresses`): a name with a dot and a top label of
    letters (or IDNA's `xn--`), as mail on the internet is addressed. NOTE: `backends.normalize_email` stores no other:
    `ada@localhost` and `ada@[10.0.0.1]` pass Django's check, and were written whole in every line naming them."""
    return _WHOLE_DOMAIN.fullmatch(domain) is not None


def hides_local_part(local_part: str) -> bool:
    """Whether a log line's address with `local_part` is hidden (`hide_addresses`): one with a word character, where
    `ADDRESS` starts it. NOTE: `backends.normalize_email` stores no other: `+@example.test` passes Django's check, and
    was written whole, domain and all, in every line naming it (`-ada@example.test` is hidden from its `a`)."""
    return _WORD_CHARACTER.search(local_part) is not None


def address_digest(address: str) -> str:
    """The keyed digest that stands for `address` in the logs (16 hex digits, case folded)."""
    return salted_hmac(DIGEST_SALT, address.strip().lower()).hexdigest()[:16]


def shown_address(address: str) -> str:
    """How a log line writes `address`: `<address DIGEST>` (`address_digest`)."""
    return f"<address {address_digest(address)}>"


def hide_addresses(text: str) -> str:
    """`text` with each email address in it written as `<address DIGEST>`: `ADDRESS.sub`'s answer, in time linear in
    `text` with a small constant; past `MAX_ADDRESSES_A_LINE` addresses, the rest cut.

    NOTE: `ADDRESS.sub` itself, bounded, still read a local part's up to 254 characters again from each of them, and the
    labels after its `@`: about 10 microseconds a character of a hostile line (`a` * 253, `@`, 126 labels, `1`, again),
    80 ms of the web process's CPU and GIL for the 8 KB path a proxy lets through, 1 s for 100 KB. Found from its `@`
    instead (a local part holds none, so each match belongs to the first `@` after its start, and its domain does not
    depend on where it starts): `_LAST_WORD_TO_DOMAIN` finds an `@` with a word character before it and its domain, then
    the local part is read backwards once, at most 254 characters, to its first word character (where `ADDRESS`,
    leftmost, starts it), never into the address before it.
    """
    if "@" not in text:
        return text
    parts, copied = [], 0
    while (found := _LAST_WORD_TO_DOMAIN.search(text, copied)) is not None:
        at = found.start("at")
        window = text[max(copied, at - _LOCAL_PART_MAX_LENGTH):at][::-1]
        local_start = at - _LOCAL_RUN.match(window).end()
        # NOTE: the local part's first word character, where `ADDRESS` starts it: one there is (`found` starts at one)
        first_word = _WORD_CHARACTER.search(text, local_start, at)
        if len(parts) == 2 * MAX_ADDRESSES_A_LINE:
            # NOTE: cut up to the end of the last `@`'s domain: what follows holds no `@`, so no address, and the line's
            # own ending (an access line's status and time) is kept.
            last_at = text.rfind("@")
            last_domain = _WHOLE_DOMAIN.match(text, last_at + 1)
            kept_from = last_domain.end() if last_domain is not None else last_at + 1
            parts += [text[copied:first_word.start()],
                      f"<{kept_from - first_word.start()} characters cut: more than {MAX_ADDRESSES_A_LINE} addresses>",
                      text[kept_from:]]
            return "".join(parts)
        parts += [text[copied:first_word.start()], shown_address(text[first_word.start():found.end()])]
        copied = found.end()
    if not parts:
        return text
    parts.append(text[copied:])
    return "".join(parts)


def scrub(record: logging.LogRecord) -> logging.LogRecord:
    """`record` with no address in its message or its exception's text, and no secret in a Django line's path."""
    if record.name.startswith(_PATH_LOGGERS) and isinstance(record.args, tuple):
        record.args = tuple(redacted_path(arg) if isinstance(arg, str) and arg.startswith("/") else arg
                            for arg in record.args)
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - arguments that do not fit the message: logging reports that itself
        return record
    if "@" in message:
        record.msg, record.args = hide_addresses(message), ()
    if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
        text = logging.Formatter().formatException(record.exc_info)
        if "@" in text:
            # NOTE: a handler's formatter writes `exc_text` when it is set, never the exception again
            record.exc_text = hide_addresses(text)
    return record


def _make_record(*args, **kwargs) -> logging.LogRecord:
    record = _made_by(*args, **kwargs)
    try:
        return scrub(record)
    except Exception:  # noqa: BLE001 - NOTE: a log call never raises; the record is written as it was made
        return record


_made_by = logging.getLogRecordFactory()


def configure(logging_settings: dict) -> None:
    """Django's `LOGGING_CONFIG`: `LOGGING` as `logging.config.dictConfig` reads it, every record scrubbed (`scrub`)."""
    if logging.getLogRecordFactory() is not _make_record:
        logging.setLogRecordFactory(_make_record)
    logging.config.dictConfig(logging_settings)
