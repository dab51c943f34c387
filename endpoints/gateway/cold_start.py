"""Holding a request while its endpoint cold-starts: bounded, and on one shared subscription.

A request that finds no READY replica first takes a place in line (`take_place`), refused before
anything is counted or streamed when it would pass a bound:

- this gateway process's (`INFERPLANE_MAX_HELD_REQUESTS_PER_PROCESS`), shared fairly between organisations: one
  holding N of them takes another only while more than N are free (`_may_hold_here`), so one tenant waking a big
  model holds at most half of them, and a tenant holding none is refused only when every place is taken: 503 with
  Retry-After;
- the endpoint's (`MAX_WAITING_PER_ENDPOINT`): 503 with Retry-After;
- its organisation's plan (`max_held_requests`): 429;

the last two checked and counted in one step in Redis, across gateway processes. A held call puts its place back
every `KEEP_PLACE_EVERY_S` should Redis have lost it (`keep_place`: a flush, a restart without persistence).

Then `hold` wakes the endpoint's reconcile and waits for the READY message on the process's one
pub/sub connection (`controlplane.pubsub.subscribe`), however many requests wait, polling the
database as a fallback; streaming clients get progress as SSE comments meanwhile. So held requests never take connections from the shared Redis pool, and
other tenants' cold starts and the agents' long polls keep working whatever one tenant holds.

A call held for a LoRA adapter's load (`adapter_hold.hold`) takes its place here too, under the same bounds.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import redis
from django.conf import settings

from controlplane import pubsub, redis_scripts
from controlplane.hot_settings import hot
from controlplane.redis_keys import endpoint_held_key, held_key
from controlplane.redis_scripts import Script
from endpoints.gateway import directory, errors, standing, traffic
from endpoints.gateway.directory import EndpointInfo, ReplicaInfo
from endpoints.gateway.metrics import EndpointMetrics
from endpoints.gateway.request import InferenceRequest
from endpoints.gateway.wake import wake_endpoint
from endpoints.nodes.notify import endpoint_ready_channel

logger = logging.getLogger("inferplane.gateway")

COLD_START_POLL_S = 0.25
MAX_WAITING_PER_ENDPOINT = 256
# A place outlives its hold's deadline by this much before it stops counting (its gateway died).
PLACE_GRACE_S = 30
# How often a held call puts its place back should Redis have lost it (`keep_place`).
KEEP_PLACE_EVERY_S = 2.0

# K: the organisation's held set and the endpoint's (a call's "<request id>|<call token>" scored by the time its place
# lapses, Redis's clock: every gateway's places are judged by one clock, so one whose clock ran ahead never read the
# others' as lapsed and held past the quota). A: that member, seconds the place lasts, quota, the endpoint's bound.
# Returns 1 when the place is taken, 0 when the quota is full, -1 when the endpoint's bound is.
# NOTE: a place the call holds already (this call sent again by a cluster client's retry) is counted among the
# quota's: it is its own, never a reason to answer full. Another try under the same request id (a batch line tried
# again while its earlier try still waits) is another call: keyed by the request id alone, the two shared one place,
# and the first's give-up freed it while the second waited (two waiting on a quota of one).
# NOTE: a set lives as long as its longest place: set to expire with each place taken, one of 1 s taken after one of
# 300 s (another endpoint's cold_start_timeout_s) dropped the whole set a second later, the 300 s call still waiting.
# NOTE: both bounds are checked and counted in this one step: the endpoint's was read from its waiting set, where a
# call is counted only at its admission, so a burst of calls each read the count before any was in it and all were held.
_TAKE_PLACE = Script("""
local now = tonumber(redis.call('TIME')[1])
local function full(key, bound)
    local own = redis.call('ZSCORE', key, ARGV[1])
    return not (own and tonumber(own) > now) and redis.call('ZCOUNT', key, '(' .. now, '+inf') >= bound
end
if full(KEYS[2], tonumber(ARGV[4])) then return -1 end
if full(KEYS[1], tonumber(ARGV[3])) then return 0 end
local lasts = math.ceil(tonumber(ARGV[2]))
for _, key in ipairs(KEYS) do
    redis.call('ZADD', key, now + tonumber(ARGV[2]), ARGV[1])
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    if redis.call('TTL', key) < lasts then redis.call('EXPIRE', key, lasts) end
end
return 1
""")
# K: the organisation's held set and the endpoint's (a place taken by a gateway of the release before is in the first
# alone); A: the member.
_LEAVE_PLACE = Script("redis.call('ZREM', KEYS[2], ARGV[1]) return redis.call('ZREM', KEYS[1], ARGV[1])")
# K: as `_TAKE_PLACE`'s; A: the member, the seconds it lasts still. Puts a place still held back where Redis lost it, as
# `_TAKE_PLACE` took it (no bound checked: the call is held already), lapsing when it would have. Returns how many sets
# lacked it. NOTE: the seconds left, measured by the gateway's monotonic clock, not a time: a Redis that came back on
# another clock (restarted on another server) has the place lapse when it would have, not minutes off. Sent again (a
# cluster client's retry after a lost reply), it finds the place there and changes nothing (NX).
# NOTE: a flush dropped the held sets, and the calls still held counted nowhere for the rest of their cold start: an
# organisation held twice its `max_held_requests`, an endpoint twice its bound.
_KEEP_PLACE = Script("""
local now = tonumber(redis.call('TIME')[1])
local left = tonumber(ARGV[2])
if left <= 0 then return 0 end
local lapses = now + left
local lost = 0
for _, key in ipairs(KEYS) do
    lost = lost + redis.call('ZADD', key, 'NX', lapses, ARGV[1])
    if redis.call('TTL', key) < left then redis.call('EXPIRE', key, math.ceil(left)) end
end
return lost
""")

_num_held_here = 0  # places taken in this process and not yet given up
_num_held_here_by: dict[int, int] = {}  # of those, an organisation's (only those holding some)


def num_held_here() -> int:
    return _num_held_here


def _may_hold_here(organization_id: int) -> bool:
    """One more of this process's places is the organisation's fair share: it holds fewer than are free.

    NOTE: the process's places were first come, first served: one tenant waking a big model (a plan's
    `max_held_requests` in the thousands, or a few organisations of one stranger's) took all of them, and every other
    tenant's cold start in this process was a 503 until it was served. Now one organisation alone holds at most half,
    a second at most half of the rest, and an organisation holding none takes any place still free."""
    num_free = settings.MAX_HELD_REQUESTS_PER_PROCESS - _num_held_here
    return num_free > 0 and _num_held_here_by.get(organization_id, 0) < num_free


@dataclass(slots=True)
class Place:
    organization_id: int
    endpoint_id: str
    member: str  # its call's in the organisation's and the endpoint's held sets: "<request id>|<call token>"
    lasts_s: float = 0.0  # from when it was taken (`taken_at`) until it stops counting
    taken: bool = True
    taken_at: float = field(default_factory=time.monotonic)
    kept_at: float = field(default_factory=time.monotonic)  # when it was last put back (`keep_place`)

    def keys(self) -> list[str]:
        return [held_key(self.organization_id), endpoint_held_key(self.organization_id, self.endpoint_id)]


async def take_place(endpoint: EndpointInfo, organization_id: int, request_id: str, *, call_token: str) -> Place:
    """A place in line for a cold start for the request's call of `call_token` (`traffic.new_call_token`), or the
    503/429 that refuses it."""
    global _num_held_here
    lasts_s = endpoint.cold_start_timeout_s + PLACE_GRACE_S
    place = Place(organization_id, endpoint.id, f"{request_id}|{call_token}", lasts_s=lasts_s)
    taken = int(await _TAKE_PLACE(keys=place.keys(), args=[place.member, lasts_s,
                                                           endpoint.max_held_requests, MAX_WAITING_PER_ENDPOINT]))
    if taken < 0:
        raise errors.no_capacity(f"Too many requests are waiting for '{endpoint.name}' to start.", 10)
    if not taken:
        raise errors.OpenAIError(
            429, f"Your organisation already has {endpoint.max_held_requests} requests waiting for cold starts "
                 "(quota max_held_requests); retry when they are served.",
            type="requests", code="rate_limit_exceeded", headers={"retry-after": "5"})
    # NOTE: checked and counted with no await in between, so concurrent requests see each other.
    if not _may_hold_here(organization_id):
        place.taken = False
        await _LEAVE_PLACE(keys=place.keys(), args=[place.member])
        raise errors.no_capacity("This gateway is holding too many requests for cold starts; please retry.", 5)
    _num_held_here += 1
    _num_held_here_by[organization_id] = _num_held_here_by.get(organization_id, 0) + 1
    return place


async def give_up(place: Place | None) -> None:
    """The place is free again (idempotent); None is no place at all."""
    global _num_held_here
    if place is None or not place.taken:
        return
    place.taken = False
    _num_held_here -= 1
    if _num_held_here_by[place.organization_id] == 1:
        del _num_held_here_by[place.organization_id]
    else:
        _num_held_here_by[place.organization_id] -= 1
    await _LEAVE_PLACE(keys=place.keys(), args=[place.member])


async def keep_place(place: Place | None) -> None:
    """Put `place` back, at most every `KEEP_PLACE_EVERY_S`, should Redis have lost it: called by a hold's wait, so never
    after its own `give_up` (which follows the wait in the same task)."""
    if place is None or not place.taken or time.monotonic() - place.kept_at < KEEP_PLACE_EVERY_S:
        return
    place.kept_at = time.monotonic()
    try:
        left_s = place.lasts_s - (time.monotonic() - place.taken_at)
        lost = await _KEEP_PLACE(keys=place.keys(), args=[place.member, math.floor(left_s)])
    except (OSError, redis.exceptions.RedisError, redis_scripts.RedisError):  # Redis down: tried again, the call held on
        logger.warning("could not put back a cold start's place in line", exc_info=True)
        return
    if lost:
        logger.warning("put back a cold start's place in line Redis had lost (organisation %d, endpoint %s)",
                       place.organization_id, place.endpoint_id)


class HeldCall(Protocol):
    """What a hold reads of the call it holds (`endpoints.gateway.call.InferenceCall`)."""

    request_id: str
    request: InferenceRequest
    endpoint: EndpointInfo
    disconnected: asyncio.Event
    metrics: EndpointMetrics

    async def start_stream(self) -> None: ...

    async def send_body(self, data: bytes) -> None: ...


async def hold(call: HeldCall, place: Place | None, *, held_before_s: float = 0.0) -> tuple[list[ReplicaInfo], float] | None:
    """READY replicas of `call.endpoint` once there are any, and how long the call waited for them
    (it is then counted in flight, no longer waiting); None if the client left first.

    Raises a 503 once the call has been held the endpoint's `cold_start_timeout_s` in all, `held_before_s` (a call held
    again: `InferenceCall._hold_again`) counted. The place is given up however it ends.
    """
    held_from = time.monotonic()
    call.metrics.waiting.inc()
    try:
        replicas = await _wait_for_replicas(call, place,
                                            held_from + call.endpoint.cold_start_timeout_s - held_before_s)
    finally:
        call.metrics.waiting.dec()
    if replicas is None:
        return None
    waited_s = time.monotonic() - held_from
    call.metrics.cold_start.observe(waited_s)
    await traffic.promote_request(call.endpoint.organization_id, call.endpoint.id, call.request_id)
    return replicas, waited_s


async def _wait_for_replicas(call: HeldCall, place: Place | None, deadline: float) -> list[ReplicaInfo] | None:
    endpoint = call.endpoint
    try:
        await wake_endpoint(endpoint.id)
        if call.request.stream or call.request.progress:
            await call.start_stream()
        # NOTE: the control plane publishes when a replica turns READY; polling remains the fallback.
        async with pubsub.subscribe(endpoint_ready_channel(endpoint.id)) as ready_signal:
            return await _wait_for_ready(call, place, ready_signal, deadline)
    finally:
        await give_up(place)


async def _wait_for_ready(call: HeldCall, place: Place | None, ready_signal: pubsub.Signal,
                          deadline: float) -> list[ReplicaInfo] | None:
    endpoint = call.endpoint
    fresh, last_wake, last_progress = False, time.monotonic(), None
    while True:
        if call.disconnected.is_set():
            return None
        replicas = await directory.ready_replicas(endpoint.id, fresh=fresh, generation=endpoint.engine_generation)
        if replicas:
            return replicas
        now = time.monotonic()
        if now > deadline:
            raise await _not_ready_in_time(endpoint)
        await keep_place(place)
        if now - last_wake > hot.GATEWAY_REWAKE_EVERY_S:
            # An endpoint that failed, or ran out of capacity, while we waited says so now.
            await standing.refuse_if_stopped_meanwhile(endpoint, wait_for_capacity=call.request.wait_for_capacity)
            await wake_endpoint(endpoint.id)
            last_wake = now
        if call.request.stream:
            progress = await directory.cold_start_progress(endpoint.id)
            if progress != last_progress:
                await call.send_body(f": {progress}\n\n".encode())
                last_progress = progress
        elif call.request.progress:
            progress = await directory.cold_start_progress(endpoint.id)
            if progress != last_progress:
                await call.send_body(b" ")  # JSON's leading whitespace: the body still parses
                last_progress = progress
        fresh = await ready_signal.wait(COLD_START_POLL_S)


async def _not_ready_in_time(endpoint: EndpointInfo) -> errors.OpenAIError:
    """The 503 of a call held its whole cold-start timeout, with the reason the endpoint gives now (a replica that
    failed and is retried, no room): the one the client waited on.
    NOTE: before, it said only "No replica became ready": a model path that does not exist, a Hub out of reach, was on
    the endpoint's page for minutes and never told to the client who waited on it."""
    latest = await directory.find_endpoint(endpoint.organization_id, endpoint.name)
    reason = latest.status_message if latest is not None and latest.id == endpoint.id else ""
    waited = f"No replica of '{endpoint.name}' became ready within {endpoint.cold_start_timeout_s} s"
    return errors.no_capacity(f"{waited}: {reason}." if reason else f"{waited}.", 30)
