"""OpenAI's `x-ratelimit-*` headers on every `/v1` answer: the caller's limits, what is left of them
this minute, and when they reset.

    x-ratelimit-limit-requests / -remaining-requests / -reset-requests
    x-ratelimit-limit-tokens   / -remaining-tokens   / -reset-tokens

The limits are the key's own (or, where it sets none, the platform's: `endpoints.gateway.limits`),
counted in fixed one-minute windows of Redis's clock, so both resets are the time to the end of the
current minute, the same from every gateway, written as OpenAI writes them (Go's duration format:
`20ms`, `1s`, `6.5s`, `1m0s`). Tokens
remaining count what running requests have reserved (their worst case) until they end.

Where the numbers come from:
- an admitted request, or one refused with a 429: the admission script's own reply (the counters
  right after it counted this request), so the hot path makes no extra Redis call; a 404 for an unknown
  model likewise (`admission.refuse_unknown_model` counts it), and a 429 before a name is looked up from the read
  that refused it (`admission.resolve_model`);
- any other answer to a known caller (`/v1/models`, a 400, a 402): one read of the two counters;
- an answer to no known caller (a 401): the platform's default limits, untouched.

A dimension without a limit (a limit of 0: `INFERPLANE_DEFAULT_KEY_RPM=0` or `_TPM=0`) sends no
headers for it: a client reads their absence as "no limit". When Redis cannot be read, only the
`limit` headers are sent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from controlplane.clock import redis_now
from controlplane.redis_client import get_async_redis
from endpoints.gateway import limits
from endpoints.gateway.auth import Caller

logger = logging.getLogger("inferplane.gateway")


def format_reset(seconds: float) -> str:
    """A duration as OpenAI writes it in `x-ratelimit-reset-*` (Go's `time.Duration` format, to the
    millisecond): `0s`, `20ms`, `1s`, `6.5s`, `1m0s`, `1h2m3s`."""
    total_ms = max(0, round(seconds * 1000))
    if total_ms == 0:
        return "0s"
    if total_ms < 1000:
        return f"{total_ms}ms"
    hours, rest_ms = divmod(total_ms, 3_600_000)
    minutes, rest_ms = divmod(rest_ms, 60_000)
    whole_s, ms = divmod(rest_ms, 1000)
    text = f"{whole_s}.{ms:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    if minutes:
        return f"{minutes}m{text}"
    return text


@dataclass(slots=True)
class RateLimitReport:
    """What one `/v1` answer says about its caller's limits; filled in as the request learns it."""

    requests_per_minute: int = 0  # 0: none (no headers for requests)
    tokens_per_minute: int = 0
    num_requests: int | None = None  # counted this minute (None: not read)
    num_tokens: int | None = None
    resets_at: float = 0.0  # epoch seconds: the end of the minute the counts belong to
    window: limits.Window | None = None

    @classmethod
    def unauthenticated(cls) -> RateLimitReport:
        """For an answer to no known caller: the platform's default limits, untouched."""
        return cls.of_window(limits.Window.now(0, "", None, None), num_requests=0, num_tokens=0)

    @classmethod
    def of_window(cls, window: limits.Window, *, num_requests: int | None = None,
                  num_tokens: int | None = None) -> RateLimitReport:
        return cls(window.requests_per_minute, window.tokens_per_minute, num_requests, num_tokens,
                   window.resets_at, window)

    def for_caller(self, caller: Caller) -> None:
        """The caller is known: its limits (counts are read later, or come from admission)."""
        window = limits.Window.now(caller.organization_id, caller.limit_subject, caller.requests_per_minute,
                                   caller.tokens_per_minute)
        self.requests_per_minute, self.tokens_per_minute = window.requests_per_minute, window.tokens_per_minute
        self.num_requests = self.num_tokens = None
        self.resets_at, self.window = window.resets_at, window

    def counted(self, window: limits.Window, num_requests: int, num_tokens: int) -> None:
        """The admission script's reply: the counters of `window` as it left them."""
        self.requests_per_minute, self.tokens_per_minute = window.requests_per_minute, window.tokens_per_minute
        self.num_requests, self.num_tokens = num_requests, num_tokens
        self.resets_at, self.window = window.resets_at, window

    async def read_counts(self) -> None:
        """Off the hot path (an answer admission never counted): read this minute's counters once."""
        if self.num_requests is not None or self.window is None:
            return
        if not self.requests_per_minute and not self.tokens_per_minute:
            return
        try:
            num_requests, num_tokens = await get_async_redis().mget(self.window.requests_key, self.window.tokens_key)
        except Exception as exc:  # noqa: BLE001 - headers never turn an answer into a 500
            logger.info("rate-limit headers without counts: %r", exc)
            return
        self.num_requests, self.num_tokens = int(num_requests or 0), int(num_tokens or 0)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The `x-ratelimit-*` headers, raw, for an ASGI response."""
        raw: list[tuple[bytes, bytes]] = []
        reset = format_reset(self.resets_at - redis_now()).encode()  # `resets_at` is Redis's clock
        for (limit_name, remaining_name, reset_name), limit, used in (
                (_REQUESTS_NAMES, self.requests_per_minute, self.num_requests),
                (_TOKENS_NAMES, self.tokens_per_minute, self.num_tokens)):
            if not limit:
                continue
            raw.append((limit_name, b"%d" % limit))
            if used is not None:
                raw.append((remaining_name, b"%d" % max(0, limit - used)))
                raw.append((reset_name, reset))
        return raw


# Each dimension's three header names, made once (every `/v1` answer sends them).
_REQUESTS_NAMES = (b"x-ratelimit-limit-requests", b"x-ratelimit-remaining-requests", b"x-ratelimit-reset-requests")
_TOKENS_NAMES = (b"x-ratelimit-limit-tokens", b"x-ratelimit-remaining-tokens", b"x-ratelimit-reset-tokens")
# Every name, as text: what a browser page may read of an answer (`endpoints.gateway.cors`).
HEADER_NAMES = tuple(name.decode() for name in (*_REQUESTS_NAMES, *_TOKENS_NAMES))

