"""How far this process's clock is from Redis's, checked where Celery compares two machines' clocks.

Celery turns a task's `expires` (seconds) into a time on its sender's clock (beat's: `celery.app.amqp`), and a worker
drops the task unrun once its own clock has passed that time (`celery.worker.request.Request.maybe_expire`), saying so
at INFO only. A worker more than `expires` ahead of beat (10 s for `sweep-stuck`, twice the pools' tick for
`provision-nodes`) dropped every run: no silent node judged, no machine launched, nothing in the logs above INFO.

Beat and each worker compare their clock with Redis's when they start, beat again every `CHECK_EVERY_S` as it sends,
and a worker whenever it drops a task as expired (`controlplane.celery_app`). Past `SKEW_ERROR_S` the process logs an
ERROR; each records what it found in Redis (`CLOCK_SKEWS_KEY`), which `/metrics` reports as
`inferplane_clock_skew_seconds` per process, for an alert.

A gateway process needs Redis's clock on every request (the rate limits' minutes, `endpoints.gateway.limits`) and
cannot spend a round trip on it: it keeps its offset to Redis's clock, read with `TIME` on each of its heartbeats
(`read_offset`, `endpoints.gateway.presence`), and `redis_now` adds it to its steady clock (`steady`), which no step
moves.
The offset is its skew: the beat records it as `check` does, every `CHECK_EVERY_S` (`record_offset`, role "gateway"),
with an ERROR past `SKEW_ERROR_S`. A gateway stamps its calls' starts by `redis_datetime`, Redis's clock too, not its own (their later
times: the start plus the monotonic time since, `InferenceCall._now`), and picks the month it reserves them in by it.

PostgreSQL's clock (`database_now`, `DatabaseClock`, `database_time_ago`) is what every claim, lease and deadline that
one process stamps and another judges is stamped and judged by: a worker's or a web pod's own clock may be minutes off
(a VM resumed, NTP broken), and judged by it, a live run's claim read as left, or a deadline as passed.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import redis.exceptions
from django.db import connection, models

from controlplane.redis_client import get_redis, redis_time
from controlplane.redis_keys import CLOCK_SKEWS_KEY

logger = logging.getLogger(__name__)

# `CLOCK_SKEWS_KEY`, a hash: "<role>:<host>-<pid>" -> {"s": seconds ahead of Redis, "at": when (Redis's clock)}.
# Ahead of or behind Redis by more than this: an ERROR. Beat and a worker each this far off on either side stay within
# the shortest beat entry's expiry (10 s) of each other.
SKEW_ERROR_S = 2.0
CHECK_EVERY_S = 60.0  # a process checks at most this often (beat, as it sends; a worker, as it drops expired tasks)
FORGET_AFTER_S = 86400.0  # a process not heard from for this long (gone) leaves the hash


def database_now() -> datetime:
    """PostgreSQL's clock now (the moment, not its transaction's start), for times one process stamps and another
    judges (a node launch's deadline, a batch's completion window, a Stripe push's first try), as `DatabaseClock`."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]


class DatabaseClock(models.Func):
    """PostgreSQL's clock as the statement reads it (`clock_timestamp()`), not its transaction's start (`Now()`): a
    claim stamped and judged in one statement (`filter(...).update(...)`)."""

    template = "CLOCK_TIMESTAMP()"
    output_field = models.DateTimeField()


def database_time_ago(seconds: float) -> models.Expression:
    """`seconds` before this moment by PostgreSQL's clock (`DatabaseClock`), as heartbeats are stamped
    (`Node.last_heartbeat_at`): a web pod stamped them by its clock and a worker judged them by its own, so a worker
    ~25 s ahead took every node OFFLINE at every sweep. Also what a claim's, a start's or a drain's age is judged by."""
    return models.ExpressionWrapper(DatabaseClock() - timedelta(seconds=seconds), output_field=models.DateTimeField())


class _Checked:
    at: float = float("-inf")  # when this process last checked (monotonic)


@dataclass(slots=True)
class _Offset:
    s: float = 0.0  # Redis's clock minus this process's: 0 (this process's own) until first read
    round_trip_s: float = float("inf")  # how long the reading it came from took: half of it bounds its error
    # Redis's clock minus this process's steady clock (`steady`), from the same reading: what `redis_now` adds to it
    monotonic_s: float = 0.0


_offset = _Offset()
_NEVER_READ = float("inf")  # `_Offset.round_trip_s` before the first reading

# Linux's clock that no step moves and that counts a suspend; elsewhere none such (None): the monotonic clock.
_STEADY_CLOCK_ID: int | None = getattr(time, "CLOCK_BOOTTIME", None)


def steady() -> float:
    """Seconds on a clock that no step moves, counting the time a suspended machine slept: `CLOCK_BOOTTIME` where the
    platform has it (Linux), the monotonic clock elsewhere.

    NOTE: `CLOCK_MONOTONIC` stops while a VM is suspended: after a resume, `redis_now` (that clock plus the offset read
    before) ran behind Redis's by the time suspended until the gateway's next beat read the offset again, and the calls
    started meanwhile were stamped that far in the past (their billing hour and month, their grant)."""
    if _STEADY_CLOCK_ID is None:
        return time.monotonic()
    return time.clock_gettime(_STEADY_CLOCK_ID)


def redis_now() -> float:
    """Redis's clock, in Unix seconds, without a round trip: this process's steady clock (`steady`) plus its offset to
    Redis's, as last read (`note_redis_time`). Where the offset was never read, this process's own clock.

    NOTE: by the steady clock, which no step moves: added to the wall clock, the offset read before a step (NTP, a VM
    resumed) was off by the whole step until the next beat read it again, and a call started meanwhile had its usage
    row's times (its billing hour and month, the grant that pays it: `billing.models.credit_shares`), its reservation's
    month and its hold's deadline off by as much (`tests/gateway/test_usage_clock.py`)."""
    offset = _offset
    if offset.round_trip_s == _NEVER_READ:
        return time.time()
    # NOTE: `steady`, inline: a request reads this clock ~7 times (its minute, its times, its beat's track)
    if _STEADY_CLOCK_ID is None:
        return time.monotonic() + offset.monotonic_s
    return time.clock_gettime(_STEADY_CLOCK_ID) + offset.monotonic_s


def redis_datetime() -> datetime:
    """`redis_now` as an aware datetime (UTC): what a gateway stamps its calls' times with (started, first token,
    finished), no round trip. NOTE: the gateway stamped them by its own clock: one a minute or more off (a VM resumed,
    NTP broken) had its prepaid usage drawn from a grant made after the call, or from none (`billing.models.credit_shares`
    judges a row's start against `CreditGrant.granted_at`, PostgreSQL's clock, with a minute's slack)."""
    return datetime.fromtimestamp(redis_now(), UTC)


def note_redis_time(sent_at: float, redis_at: float, received_at: float) -> None:
    """Redis's `TIME` (`redis_at`), read by a command sent at `sent_at` and answered at `received_at` (this process's
    clock): the offset `redis_now` adds lies between `redis_at - received_at` and `redis_at - sent_at`.

    NOTE: the offset kept is the one read in the shortest round trip, as long as every later reading agrees with it (a
    stalled event loop answers late: its reading is loose, not wrong); one that cannot hold it (this process's clock
    stepped or drifted, or Redis restarted on another server's clock, a failover) replaces it at once."""
    round_trip_s = received_at - sent_at
    if round_trip_s < 0:  # this process's clock stepped back while it waited: no bound on either side
        return
    wall_ahead_s = time.time() - steady()  # this process's two clocks, now as at `received_at`
    agrees = (redis_at - received_at <= _offset.s <= redis_at - sent_at
              and redis_at - received_at + wall_ahead_s <= _offset.monotonic_s <= redis_at - sent_at + wall_ahead_s)
    if not agrees or round_trip_s <= _offset.round_trip_s:
        _offset.s = redis_at - (sent_at + received_at) / 2
        _offset.round_trip_s = round_trip_s
        _offset.monotonic_s = _offset.s + wall_ahead_s


async def read_offset(client) -> None:
    """Read Redis's clock (`TIME`, on the async `client`) for this process's offset to it (`redis_now`).

    NOTE: a command of its own, in no pipeline: Redis Cluster's clients refuse TIME in one, and alone its round trip,
    which bounds the offset's error, is the shortest."""
    sent_at = time.time()
    seconds, microseconds = await client.time()
    note_redis_time(sent_at, seconds + microseconds / 1_000_000, time.time())


async def record_offset(client) -> None:
    """A gateway process's `check`, from the offset its beat read (`read_offset`; no other round trip): recorded for
    `/metrics` (role "gateway") every `CHECK_EVERY_S`, an ERROR past `SKEW_ERROR_S`. `client`: the async client."""
    if _offset.round_trip_s == float("inf") or time.monotonic() - _Checked.at < CHECK_EVERY_S:
        return  # never read, or recorded less than a minute ago
    _Checked.at = time.monotonic()
    skew = -_offset.s
    await client.hset(CLOCK_SKEWS_KEY, f"gateway:{socket.gethostname()}-{os.getpid()}",
                      json.dumps({"s": round(skew, 3), "at": redis_now()}))
    if abs(skew) > SKEW_ERROR_S:
        logger.error("this gateway's clock is %.1f s %s Redis's: its rate limits, reservations and usage rows' times "
                     "follow Redis's, by the offset its beat reads, off while its clock steps between beats; keep the "
                     "machines' clocks in step (NTP)", abs(skew), "ahead of" if skew > 0 else "behind")


def skew_s(client=None) -> tuple[float, float]:
    """Seconds this process's clock is ahead of Redis's (negative: behind), to within half a round trip, and Redis's
    clock when it was read."""
    client = client or get_redis()
    before = time.time()
    now = redis_time(client)
    return (before + time.time()) / 2 - now, now


def check(role: str, *, reason: str = "") -> float | None:
    """Compare this process's clock with Redis's: an ERROR past `SKEW_ERROR_S`, recorded for `/metrics` either way.
    Returns the skew (None when Redis could not be read). `reason`: what prompted the check, for the log."""
    _Checked.at = time.monotonic()
    client = get_redis()
    try:
        skew, now = skew_s(client)
        gone = [name for name, value in client.hgetall(CLOCK_SKEWS_KEY).items()
                if now - json.loads(value)["at"] > FORGET_AFTER_S]
        with client.pipeline(transaction=False) as pipe:
            if gone:
                pipe.hdel(CLOCK_SKEWS_KEY, *gone)
            pipe.hset(CLOCK_SKEWS_KEY, f"{role}:{socket.gethostname()}-{os.getpid()}",
                      json.dumps({"s": round(skew, 3), "at": now}))
            pipe.execute()
    except (redis.exceptions.RedisError, ValueError, KeyError) as exc:
        logger.warning("could not compare this %s's clock with Redis's: %r", role, exc)
        return None
    if abs(skew) > SKEW_ERROR_S:
        logger.error("this %s's clock is %.1f s %s Redis's%s: Celery drops a task unrun once a worker's clock passes "
                     "its expiry set on beat's, so beat's runs (sweep-stuck, provision-nodes, the autoscaler) may never "
                     "run; keep the machines' clocks in step (NTP)", role, abs(skew),
                     "ahead of" if skew > 0 else "behind", f" ({reason})" if reason else "")
    return skew


def check_now_and_then(role: str, *, reason: str = "") -> float | None:
    """`check`, unless this process checked less than `CHECK_EVERY_S` ago (None then)."""
    if time.monotonic() - _Checked.at < CHECK_EVERY_S:
        return None
    return check(role, reason=reason)


def recorded_skews() -> dict[str, float]:
    """What each process found when it last checked ("<role>:<host>-<pid>" -> seconds ahead of Redis). A value that
    is not such a record is left out, with a warning. NOTE: before, it raised out of the scrape (`/metrics` 500)."""
    skews = {}
    for name, value in get_redis().hgetall(CLOCK_SKEWS_KEY).items():
        try:
            skews[name] = float(json.loads(value)["s"])
        except (ValueError, TypeError, KeyError):
            logger.warning("the clock skew of %r in Redis is %r, not a record of one; left out", name, value)
    return skews
