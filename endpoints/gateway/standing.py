"""Calls to an endpoint that cannot start now fail at once, with the reason, instead of waiting.

An endpoint that FAILED (its replicas failed the same way until the scheduler gave up, or the
model cannot run its spec) answers 503 `endpoint_failed` with its status message; one WAITING FOR
CAPACITY (no node has room for a replica) answers 503 `capacity_unavailable` with `x-should-retry: false` and
`Retry-After` = the soonest another try could see room (`capacity_retry_after_s`), unless the client asked to wait for capacity with the header `X-Inferplane-Wait-For-Capacity: true`:
then it is held like any cold start, up to the endpoint's `cold_start_timeout_s`. One BACKING OFF after failures
(`Endpoint.next_attempt_at`) past its `cold_start_timeout_s`, with no replica starting, answers 503
`endpoint_backing_off` with its status message and `Retry-After` = the time left. One whose organisation started as
many replicas as it may this hour (`endpoints.quota_room.ReplicaStarts`) answers 429 `replica_starts_exceeded` with the
reason and `x-should-retry: false`: held, the call waited its whole cold-start timeout for a replica none would place.

The gateway learns the state from its cached `EndpointInfo` (at most `ENDPOINT_CACHE_S` old): once when
a call finds no READY replica, and again every few seconds while a call is held (the wake it sent may
be what found no room).
"""

from __future__ import annotations

import math
import time

from django.conf import settings

from endpoints.gateway import errors
from endpoints.gateway.directory import ENDPOINT_CACHE_S, EndpointInfo, find_endpoint
from endpoints.quota_room import (
    REPLICA_STARTS_REFUSAL,
    REPLICA_STARTS_WINDOW_S,
    refused_for_hold,
)

WAIT_FOR_CAPACITY_HEADER = "x-inferplane-wait-for-capacity"
FAILED_RETRY_AFTER_S = 300
# `Retry-After` of `replica_starts_exceeded`: a start leaves the hour's count any time within it; an answer sooner than
# this is as likely refused again.
STARTS_RETRY_AFTER_S = REPLICA_STARTS_WINDOW_S // 12


def capacity_retry_after_s() -> int:
    """`Retry-After` of `capacity_unavailable`: the scheduler's next try to place a replica (an autoscaler tick) and
    this gateway's view of the endpoint catching up with it (`ENDPOINT_CACHE_S`); no try sooner can see room.

    NOTE: with `x-should-retry: false`: room frees when another endpoint scales down or a node joins, minutes apart or
    never, so the OpenAI clients' own retries (two by default, more where a caller raised `max_retries`) only held the
    caller's thread; before, `Retry-After: 30` made openai-python sleep 30 s twice and then fail anyway. A client that
    wants to wait sends `X-Inferplane-Wait-For-Capacity: true` and is held as a cold start."""
    return math.ceil(settings.AUTOSCALER_TICK_S + ENDPOINT_CACHE_S)


def wants_to_wait(headers: dict[str, str]) -> bool:
    """Whether the client asked to be held while the endpoint waits for capacity."""
    return headers.get(WAIT_FOR_CAPACITY_HEADER, "").strip().lower() in ("true", "1", "yes")


async def refuse_if_stopped_meanwhile(endpoint: EndpointInfo, *, wait_for_capacity: bool) -> None:
    """During a hold: the call this hold's wake set off may have found no room, or failed; say so now. So does an
    endpoint its organisation paused or deleted meanwhile (its replicas drain and none starts: the call was held its
    whole cold-start timeout for nothing, its reservation and place with it)."""
    latest = await find_endpoint(endpoint.organization_id, endpoint.name)
    if latest is None:
        raise errors.model_not_found(endpoint.name)
    if latest.id != endpoint.id:  # deleted, and another endpoint of its name made since
        raise errors.service_unavailable(f"The endpoint '{endpoint.name}' was replaced while this call waited; please retry.")
    if latest.paused:
        raise errors.endpoint_paused(endpoint.name)
    refuse_unless_startable(latest, wait_for_capacity=wait_for_capacity)


def refuse_unless_startable(endpoint: EndpointInfo, *, wait_for_capacity: bool) -> None:
    """Raise the fast 503 for an endpoint with no READY replica that cannot get one soon."""
    reason = endpoint.status_message or "no reason recorded"
    if endpoint.state == "FAILED":
        # NOTE: the status of a FAILED endpoint starts "failed: " (`replicas.py`), which this sentence says already.
        raise errors.OpenAIError(
            503, f"The endpoint '{endpoint.name}' has failed and is not starting replicas: {reason.removeprefix('failed: ')}. "
                 f"Change its configuration, or press Retry on its console page (POST /api/v1/endpoints/{endpoint.id}/resume/) "
                 "to try again.",
            type="server_error", code="endpoint_failed", headers={"retry-after": str(FAILED_RETRY_AFTER_S)},
        )
    backing_off_s = endpoint.backing_off_until - time.time()
    if backing_off_s > endpoint.cold_start_timeout_s:
        # NOTE: held, it would take a held place for its whole cold-start timeout, then get 503 "no replica became ready".
        raise errors.OpenAIError(
            503, f"The endpoint '{endpoint.name}' has no replica and starts none for {math.ceil(backing_off_s)} s, "
                 f"backing off after failures: {reason}. Retry then, or change its configuration to try again now.",
            type="server_error", code="endpoint_backing_off", headers={"retry-after": str(math.ceil(backing_off_s))},
        )
    if refused_for_hold(endpoint.status_message):
        # NOTE: the answer every call of an organisation on hold gets (its reservation's refusal), not a 429 its
        # clients would read as a rate to wait out: what lifts it is a payment, on the billing page.
        raise errors.insufficient_quota(
            f"The endpoint '{endpoint.name}' has no replica and starts none: "
            f"{reason.removeprefix(f'waiting for quota: {REPLICA_STARTS_REFUSAL}: ')}.")
    if endpoint.starts_refused:
        # NOTE: whether or not the client would wait for capacity: no replica starts for it before a start of its
        # organisation's leaves the hour's count (none starting: `directory._starts_refused`).
        raise errors.OpenAIError(
            429, f"The endpoint '{endpoint.name}' has no replica and starts none now: "
                 f"{reason.removeprefix('waiting for quota: ')}. Retry later, or call an endpoint that is serving.",
            type="requests", code="replica_starts_exceeded",
            headers={"retry-after": str(STARTS_RETRY_AFTER_S), "x-should-retry": "false"},
        )
    if endpoint.state == "WAITING_FOR_CAPACITY" and not wait_for_capacity:
        raise errors.OpenAIError(
            503, f"The endpoint '{endpoint.name}' has no replica and is {reason}. Retry later, or send "
                 "'X-Inferplane-Wait-For-Capacity: true' to wait up to its cold-start timeout.",
            type="server_error", code="capacity_unavailable",
            headers={"retry-after": str(capacity_retry_after_s()), "x-should-retry": "false"},
        )
