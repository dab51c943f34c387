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

Each call's reservation is noted beside the minute's token counter under its own token (`traffic.new_call_token`), and
its finish replaces exactly that by what it used, once: a finish sent again finds it given back ('-'), and one whose
reservation Redis lost with the counter's memory (the note gone too) adds what it used. Before, the give-back went with
the call's entry in its gateway's requests hash: a finish whose entry the sweeper had released gave nothing back (the
minute read high by the unused part), and one whose entry its gateway had put back after Redis lost it gave back a
reservation the counter no longer held (the minute read low, below what was used).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from django.conf import settings

from controlplane import clock, redis_keys
from controlplane.script_parts import ComposedScript, ScriptPart
from endpoints.gateway import errors

WINDOW_TTL_S = 120

# `limits_read` reads this minute's two counters (one MGET); `limits_check` judges them and changes
# nothing (1: too many requests, 2: too many tokens this minute, 3: more tokens than a whole minute
# allows); `limits_take` (the same keys and arguments) counts the admitted request, reserves its tokens
# and returns the counters as it left them, for the rate-limit headers
# (`endpoints.gateway.ratelimit_headers`), noting the call's reservation under its token. `limits_give_back` replaces
# the call's reservation, as noted, by the real count (see the module's docstring).
# Their keys and arguments are `CHECK`'s and `GIVE_BACK`'s below.
# NOTE: a counter gets its TTL when its INCR creates it (the value is then the increment), the notes' hash when its
# first field makes it: a minute's keys are written by these functions only, and INCRBY and HSET keep a TTL, so one
# EXPIRE per key and minute does.
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
local function limits_note(key, token, value)
  if redis.call('HSET', key, token, value) == 1 and redis.call('HLEN', key) == 1 then
    redis.call('EXPIRE', key, {WINDOW_TTL_S})
  end
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
    if A[4] ~= '' then limits_note(K[3], A[4], tokens) end
  end
  return used
end
local function limits_give_back(K, A)
  if tonumber(A[1]) == 0 then return end
  local reserved = redis.call('HGET', K[2], A[3])
  if reserved == '-' then return end  -- this call's finish sent again: given back already
  -- no note: the counter holds none of its reservation (Redis lost both, or it reserved none), so it counts its use
  local change = tonumber(A[2]) - tonumber(reserved or '0')
  if change > 0 or (change < 0 and redis.call('EXISTS', K[1]) == 1) then
    if redis.call('INCRBY', K[1], change) == change then redis.call('EXPIRE', K[1], {WINDOW_TTL_S}) end
  end
  limits_note(K[2], A[3], '-')
end
"""

CHECK = ScriptPart("limits_check", keys=("this minute's request counter", "this minute's token counter",
                                         "this minute's reservations (call token -> tokens)"),
                   args=("requests per minute", "tokens per minute (0 = none)", "the request's worst-case tokens",
                         "the call's token ('': a check, nothing to note)"),
                   lua=LIMITS_LUA)
GIVE_BACK = ScriptPart("limits_give_back", keys=("the token counter of the minute it was admitted in",
                                                 "that minute's reservations"),
                       args=("tokens per minute", "tokens used", "the call's token"), lua=LIMITS_LUA)


# A call's give-back alone: its finish did not reach Redis, and its gateway's beat ends it (`presence.end_later`).
_GIVE_BACK_ALONE = ComposedScript([GIVE_BACK], glue="limits_give_back(limits_give_back_K, limits_give_back_A)")


def give_back_alone(keys_and_args: tuple[list[str], list]) -> None:
    """`Window.give_back_keys_and_args`'s give-back, without the rest of the call's finish (synchronous: a worker
    thread's). Once, however often it runs, and not again after the finish's own."""
    _GIVE_BACK_ALONE.run_sync(limits_give_back=keys_and_args)


@functools.lru_cache(maxsize=4096)
def _window_keys(organization_id: int, subject: str, minute: int) -> tuple[str, str, str]:
    """A subject's two counters of one minute and its calls' reservations (the same for every request of that minute:
    built once)."""
    return (redis_keys.requests_window_key(organization_id, subject, minute),
            redis_keys.tokens_window_key(organization_id, subject, minute),
            redis_keys.tokens_reserved_key(organization_id, subject, minute))


@dataclass(slots=True, frozen=True)
class Window:
    """One subject's counters for the current minute, and what this request reserves in them."""

    requests_key: str
    tokens_key: str
    reservations_key: str  # the tokens each call reserved in the minute (`limits_give_back`)
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
        requests_key, tokens_key, reservations_key = _window_keys(organization_id, subject, minute)
        return cls(requests_key, tokens_key, reservations_key, requests_per_minute, tokens_per_minute, int((minute + 1) * 60 - now) + 1,
                   max(0, num_tokens), (minute + 1) * 60)

    def check_keys_and_args(self, call_token: str = "") -> tuple[list[str], list]:
        """`CHECK`'s keys and arguments (`limits_check`, and `limits_take` noting `call_token`'s reservation)."""
        return ([self.requests_key, self.tokens_key, self.reservations_key],
                [self.requests_per_minute, self.tokens_per_minute, self.num_tokens, call_token])

    def give_back_keys_and_args(self, num_tokens_used: int, call_token: str) -> tuple[list[str], list]:
        """`GIVE_BACK`'s: the reservation `call_token`'s admission made becomes what the call used."""
        return ([self.tokens_key, self.reservations_key],
                [self.tokens_per_minute, max(0, num_tokens_used), call_token])

    def refusal(self, verdict: int, why_so_many: str = "") -> errors.OpenAIError:
        """The 429 for a `limits_check` verdict (`errors.RequestTooLarge` for a request past a whole minute's tokens:
        no retry admits it); `why_so_many` follows a refusal for the request's tokens (`errors.prompt_factor_note`)."""
        if verdict == 1:
            return errors.rate_limited(f"Rate limit reached: {self.requests_per_minute} requests per minute.",
                                       self.retry_after_s)
        if verdict == 3:
            return errors.RequestTooLarge(
                f"Request too large for this API key on tokens per min (TPM): Limit {self.tokens_per_minute}, "
                f"Requested {self.num_tokens}. The input or output tokens must be reduced in order to run "
                f"successfully (the prompt, or max_tokens).{why_so_many}")
        return errors.rate_limited(
            f"Rate limit reached: {self.tokens_per_minute} tokens per minute (this request may use up to "
            f"{self.num_tokens}, reserved until it ends).{why_so_many}", self.retry_after_s)
