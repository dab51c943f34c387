"""Per-key rate limits: requests and tokens per minute, atomic in Redis across gateway processes.

Fixed one-minute windows. A request is admitted only while both counters are
under their limits, and admission increments the request counter in the same
script, so N gateway processes can never admit more than the limit together.
Tokens are added after the response, from the usage the engine reported.
"""

from __future__ import annotations

import time

from controlplane.redis_client import get_async_redis
from endpoints.gateway import errors

_ADMIT = """
local requests = tonumber(redis.call('GET', KEYS[1]) or '0')
local tokens = tonumber(redis.call('GET', KEYS[2]) or '0')
if tonumber(ARGV[1]) > 0 and requests >= tonumber(ARGV[1]) then return 1 end
if tonumber(ARGV[2]) > 0 and tokens >= tonumber(ARGV[2]) then return 2 end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], 120)
return 0
"""

_scripts: dict[int, object] = {}


def _window() -> tuple[int, int]:
    now = time.time()
    minute = int(now // 60)
    return minute, int((minute + 1) * 60 - now) + 1


def _keys(subject: str, minute: int) -> list[str]:
    return [f"rl:req:{subject}:{minute}", f"rl:tok:{subject}:{minute}"]


async def admit(subject: str, requests_per_minute: int | None, tokens_per_minute: int | None) -> None:
    if not requests_per_minute and not tokens_per_minute:
        return
    redis = get_async_redis()
    script = _scripts.get(id(redis))
    if script is None:
        script = _scripts[id(redis)] = redis.register_script(_ADMIT)
    minute, retry_after_s = _window()
    verdict = int(await script(keys=_keys(subject, minute), args=[requests_per_minute or 0, tokens_per_minute or 0]))
    if verdict == 1:
        raise errors.rate_limited(f"Rate limit reached: {requests_per_minute} requests per minute.", retry_after_s)
    if verdict == 2:
        raise errors.rate_limited(f"Rate limit reached: {tokens_per_minute} tokens per minute.", retry_after_s)


async def add_tokens(subject: str, tokens_per_minute: int | None, num_tokens: int) -> None:
    if not tokens_per_minute or num_tokens <= 0:
        return
    minute, _ = _window()
    key = _keys(subject, minute)[1]
    redis = get_async_redis()
    async with redis.pipeline(transaction=False) as pipe:
        pipe.incrby(key, num_tokens)
        pipe.expire(key, 120)
        await pipe.execute()
