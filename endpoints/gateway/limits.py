"""Per-key rate limits: requests and tokens per minute, atomic in Redis across gateway processes.

Fixed one-minute windows. A request is admitted only while both counters are under their limits,
and admission increments the request counter in the same script (the gateway's admission script,
`endpoints/gateway/admission.py`), so N gateway processes can never admit more than the limit
together. Tokens are added after the response, from the usage the engine reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from endpoints.gateway import errors

WINDOW_TTL_S = 120

# K: this minute's request counter, token counter. A: requests per minute, tokens per minute (0 = none).
# `limits_check` changes nothing; `limits_take` counts the admitted request; `limits_add_tokens`
# (K: the token counter; A: tokens per minute, tokens used) counts what the engine reported.
LIMITS_LUA = f"""
local function limits_check(K, A)
  if tonumber(A[1]) > 0 and tonumber(redis.call('GET', K[1]) or '0') >= tonumber(A[1]) then return 1 end
  if tonumber(A[2]) > 0 and tonumber(redis.call('GET', K[2]) or '0') >= tonumber(A[2]) then return 2 end
  return 0
end
local function limits_take(K, A)
  if tonumber(A[1]) > 0 or tonumber(A[2]) > 0 then
    redis.call('INCR', K[1])
    redis.call('EXPIRE', K[1], {WINDOW_TTL_S})
  end
end
local function limits_add_tokens(K, A)
  if tonumber(A[1]) > 0 and tonumber(A[2]) > 0 then
    redis.call('INCRBY', K[1], A[2])
    redis.call('EXPIRE', K[1], {WINDOW_TTL_S})
  end
end
"""


@dataclass(slots=True, frozen=True)
class Window:
    """One subject's counters for the current minute."""

    requests_key: str
    tokens_key: str
    requests_per_minute: int
    tokens_per_minute: int
    retry_after_s: int

    @classmethod
    def now(cls, subject: str, requests_per_minute: int | None, tokens_per_minute: int | None) -> Window:
        now = time.time()
        minute = int(now // 60)
        return cls(f"rl:req:{subject}:{minute}", f"rl:tok:{subject}:{minute}", requests_per_minute or 0,
                   tokens_per_minute or 0, int((minute + 1) * 60 - now) + 1)

    def check_keys_and_args(self) -> tuple[list[str], list[int]]:
        return [self.requests_key, self.tokens_key], [self.requests_per_minute, self.tokens_per_minute]

    def tokens_keys_and_args(self, num_tokens: int) -> tuple[list[str], list[int]]:
        return [self.tokens_key], [self.tokens_per_minute, max(0, num_tokens)]

    def refusal(self, verdict: int) -> errors.OpenAIError:
        """The 429 for a `limits_check` verdict of 1 (requests) or 2 (tokens)."""
        if verdict == 1:
            return errors.rate_limited(f"Rate limit reached: {self.requests_per_minute} requests per minute.",
                                       self.retry_after_s)
        return errors.rate_limited(f"Rate limit reached: {self.tokens_per_minute} tokens per minute.", self.retry_after_s)
