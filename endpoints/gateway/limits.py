"""Per-key rate limits: requests and tokens per minute, atomic in Redis across gateway processes.

Fixed one-minute windows of Redis's clock: each gateway process counts a request in the minute that
`controlplane.clock.redis_now` says (its own clock plus its offset to Redis's, read on every heartbeat),
so gateways whose clocks are tens of seconds apart count the same moment's requests in the same minute's
counters. Before, each took the minute from its own clock: with two gateways 40 s apart, a key limited
to N requests a minute had N admitted by each, and their `x-ratelimit-reset-*` headers disagreed.

A key (or console session) that sets no limit of its own gets the platform's
(`INFERPLANE_DEFAULT_KEY_RPM`, `INFERPLANE_DEFAULT_KEY_TPM`); 0 means none.

Tokens are reserved before the call, not counted after it: admission adds the request's worst
case (its prompt estimate plus every output token it may ask for) to the minute's token counter in
the same script that checks it (`endpoints/gateway/admission.py`), so concurrent requests, from
any number of gateway processes, can never take more than the limit together. When the request
ends, the part it did not use is given back to the minute it was admitted in.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from django.conf import settings

from controlplane import clock, redis_keys
from controlplane.script_parts import ScriptPart
from endpoints.gateway import errors

WINDOW_TTL_S = 120

# `limits_read` reads this minute's two counters (one MGET); `limits_check` judges them and changes
# nothing (1: too many requests, 2: too many tokens this minute, 3: more tokens than a whole minute
# allows); `limits_take` (the same keys and arguments) counts the admitted request, reserves its tokens
# and returns the counters as it left them, for the rate-limit headers
# (`endpoints.gateway.ratelimit_headers`). `limits_give_back` replaces the reservation by the real count.
# Their keys and arguments are `CHECK`'s and `GIVE_BACK`'s below.
# NOTE: a counter gets its TTL when its INCR creates it (the value is then the increment): a minute's
# key is written by these functions only, and INCRBY keeps a TTL, so one EXPIRE per key and minute does.
LIMITS_LUA = f"""
local function limits_read(K)
  local used = redis.call('MGET', K[1], K[2])
  return {{tonumber(used[1] or '0'), tonumber(used[2] or '0')}}
end
local function limits_check(K, A, used)
  if tonumber(A[1]) > 0 and used[1] >= tonumber(A[1]) then return 1 end
  if tonumber(A[2]) > 0 then
    if tonumber(A[3]) > tonumber(A[2]) then return 3 end
    if used[2] + tonumber(A[3]) > tonumber(A[2]) then return 2 end
  end
  return 0
end
local function limits_take(K, A, used)
  if tonumber(A[1]) > 0 then
    used[1] = redis.call('INCR', K[1])
    if used[1] == 1 then redis.call('EXPIRE', K[1], {WINDOW_TTL_S}) end
  end
  local tokens = tonumber(A[3])
  if tonumber(A[2]) > 0 and tokens > 0 then
    used[2] = redis.call('INCRBY', K[2], tokens)
    if used[2] == tokens then redis.call('EXPIRE', K[2], {WINDOW_TTL_S}) end
  end
  return used
end
local function limits_give_back(K, A)
  local change = tonumber(A[3]) - tonumber(A[2])
  if tonumber(A[1]) > 0 and change ~= 0 and redis.call('EXISTS', K[1]) == 1 then
    redis.call('INCRBY', K[1], change)
  end
end
"""

CHECK = ScriptPart("limits_check", keys=("this minute's request counter", "this minute's token counter"),
                   args=("requests per minute", "tokens per minute (0 = none)", "the request's worst-case tokens"),
                   lua=LIMITS_LUA)
GIVE_BACK = ScriptPart("limits_give_back", keys=("the token counter of the minute it was admitted in",),
                       args=("tokens per minute", "tokens reserved", "tokens used"), lua=LIMITS_LUA)


@functools.lru_cache(maxsize=4096)
def _window_keys(organization_id: int, subject: str, minute: int) -> tuple[str, str]:
    """A subject's two counters of one minute (the same for every request of that minute: built once)."""
    return (redis_keys.requests_window_key(organization_id, subject, minute),
            redis_keys.tokens_window_key(organization_id, subject, minute))


@dataclass(slots=True, frozen=True)
class Window:
    """One subject's counters for the current minute, and what this request reserves in them."""

    requests_key: str
    tokens_key: str
    requests_per_minute: int
    tokens_per_minute: int
    retry_after_s: int
    num_tokens: int  # the request's worst case, reserved at admission
    resets_at: float = 0.0  # epoch seconds: when this minute's counters give way to the next minute's

    @classmethod
    def now(cls, organization_id: int, subject: str, requests_per_minute: int | None, tokens_per_minute: int | None,
            num_tokens: int = 0) -> Window:
        """This minute's window of `subject` (a key or a user) in its organisation; a limit of None is the
        platform default."""
        if requests_per_minute is None:
            requests_per_minute = settings.DEFAULT_KEY_REQUESTS_PER_MINUTE
        if tokens_per_minute is None:
            tokens_per_minute = settings.DEFAULT_KEY_TOKENS_PER_MINUTE
        now = clock.redis_now()  # NOTE: every gateway's minutes are Redis's: see the module's docstring
        minute = int(now // 60)
        requests_key, tokens_key = _window_keys(organization_id, subject, minute)
        return cls(requests_key, tokens_key, requests_per_minute, tokens_per_minute, int((minute + 1) * 60 - now) + 1,
                   max(0, num_tokens), (minute + 1) * 60)

    def check_keys_and_args(self) -> tuple[list[str], list[int]]:
        """`CHECK`'s keys and arguments (`limits_check` and `limits_take`)."""
        return [self.requests_key, self.tokens_key], [self.requests_per_minute, self.tokens_per_minute, self.num_tokens]

    def give_back_keys_and_args(self, num_tokens_used: int) -> tuple[list[str], list[int]]:
        """`GIVE_BACK`'s: the reservation made at admission becomes what the request used."""
        return [self.tokens_key], [self.tokens_per_minute, self.num_tokens, max(0, num_tokens_used)]

    def refusal(self, verdict: int) -> errors.OpenAIError:
        """The 429 for a `limits_check` verdict."""
        if verdict == 1:
            return errors.rate_limited(f"Rate limit reached: {self.requests_per_minute} requests per minute.",
                                       self.retry_after_s)
        if verdict == 3:
            return errors.rate_limited(
                f"Request too large: it may use up to {self.num_tokens} tokens (prompt and max_tokens), more than "
                f"this key's limit of {self.tokens_per_minute} tokens per minute. Lower max_tokens.", 60)
        return errors.rate_limited(
            f"Rate limit reached: {self.tokens_per_minute} tokens per minute (this request may use up to "
            f"{self.num_tokens}, reserved until it ends).", self.retry_after_s)
