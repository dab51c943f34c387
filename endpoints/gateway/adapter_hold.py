"""Calls that name a LoRA adapter (`"<endpoint>:<adapter>"`): resolve the name, and hold the call
until a READY replica holds the adapter.

The gateway never loads an adapter itself: it marks the adapter wanted (`endpoints.adapters.
want_adapter`, one conditional update), which wakes the endpoint's agents (their desired specs
change); an agent loads it into its running engine in the background and reports it in its next
heartbeat, which announces it on the endpoint's READY channel (`endpoints.adapters.record_replica_adapters`).

A call held for a load is held as a cold start is (`cold_start`): it first takes a place in line (the process's,
the endpoint's and the plan's bounds, refused 503/429 alike), is counted waiting, and waits on the process's one
subscription to that channel. The waiters one message wakes share one read of the replicas (`Memo.get`'s
`fresh_since`); between messages they read the cached list. The adapter is marked wanted once a second per process,
however many calls wait for it. NOTE: before, each held call took no place, and read the replicas and wrote the mark
itself four times a second: a dozen held calls took the database from 5 to 185 commits a second.

An adapter an engine refused (FAILED) held by no READY replica is a 400 `adapter_failed` with the engine's reason,
for a call and a batch line alike (`refuse_if_failed`): it held each call the endpoint's whole cold start timeout,
then answered 503 "not loaded yet", which clients retried without end. A failure its agent tries again
(`failure_retried`: the store unreachable, a disk full) is held for as a load is: a call until the retry loads it or
its hold times out (503 `adapter_loading`), a batch line tried again later.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from controlplane import pubsub
from controlplane.worker_threads import in_worker_thread
from endpoints.adapters import parse_model_name, want_adapter
from endpoints.gateway import cold_start, directory, errors, traffic
from endpoints.models import AdapterState
from endpoints.nodes.notify import endpoint_ready_channel

POLL_S = 0.25
WANT_EVERY_S = 1.0  # `want_adapter` writes once a second at most: this process asks no more often
MAX_WANTED_KEPT = 4096  # adapters whose last mark this process keeps; past it, those older than `WANT_EVERY_S` go

_wanted_at: dict[str, float] = {}  # adapter id -> when (monotonic) this process last marked it wanted


async def resolve(organization_id: int, model: str, *, before_lookup: Callable[[], Awaitable[None]] | None = None,
                  ) -> tuple[directory.EndpointInfo, directory.AdapterInfo | None] | None:
    """The endpoint (priced for the adapter) and the adapter a call's `model` names; None if unknown.

    `before_lookup` is awaited once before the first database lookup (a name, or an endpoint's adapters, not cached)
    and may raise to refuse the call before it costs a query (`admission.resolve_model`)."""
    names = parse_model_name(model)
    if names is None:
        # NOTE: `"<endpoint>:"` names no adapter, so no model: it was served as the endpoint (`/v1/models/{id}` said
        # 200 with the endpoint's id), and a real engine refused its name only once the call was admitted
        return None
    endpoint_name, adapter_name = names
    if before_lookup is not None and not directory.knows_endpoint(organization_id, endpoint_name):
        await before_lookup()
        before_lookup = None
    endpoint = await directory.find_endpoint(organization_id, endpoint_name)
    if endpoint is None or not adapter_name:
        return (endpoint, None) if endpoint is not None else None
    if before_lookup is not None and not directory.knows_adapters(endpoint.id):
        await before_lookup()
    adapter = (await directory.endpoint_adapters(endpoint.id)).get(adapter_name)
    if adapter is None:
        return None
    return adapter.priced(endpoint), adapter


def held_by(adapter: directory.AdapterInfo, replicas: list[directory.ReplicaInfo]) -> list[directory.ReplicaInfo]:
    """The replicas among `replicas` that hold `adapter`."""
    return [replica for replica in replicas if adapter.name in replica.adapters]


def not_loaded(adapter: directory.AdapterInfo) -> errors.OpenAIError:
    return errors.OpenAIError(
        503, f"The adapter '{adapter.name}' is not loaded yet; see its state on the endpoint.",
        type="server_error", code="adapter_loading", headers={"retry-after": "10"})


def _refused(adapter: directory.AdapterInfo) -> bool:
    """FAILED for good: an engine refused it (or its files). A failure its agent tries again is not (`failure_retried`:
    held for as a load is)."""
    return adapter.state == AdapterState.FAILED and not adapter.failure_retried


async def refuse_if_failed(endpoint: directory.EndpointInfo, adapter: directory.AdapterInfo) -> None:
    """The 400 `adapter_failed` (with the engine's reason) for a call naming `adapter`, which no READY replica
    holds, when an engine refused it: FAILED for good as read, and again when read fresh (a load since may have
    worked). NOTE: a failure the agent tries again (a Hub 5xx, a disk full) was a 400 too, which SDKs do not retry,
    and failed batch lines for good."""
    if not _refused(adapter):
        return
    adapter = (await directory.endpoint_adapters(endpoint.id, fresh=True)).get(adapter.name) or adapter
    if _refused(adapter):
        raise errors.OpenAIError(
            400, f"The adapter '{adapter.name}' could not be loaded: {adapter.status_message or 'its engine refused it'}.",
            param="model", code="adapter_failed")


async def want(adapter: directory.AdapterInfo) -> None:
    """Mark `adapter` wanted (`endpoints.adapters.want_adapter`), at most once per `WANT_EVERY_S` in this process."""
    now = time.monotonic()
    if now - _wanted_at.get(adapter.id, -WANT_EVERY_S) < WANT_EVERY_S:
        return
    if len(_wanted_at) >= MAX_WANTED_KEPT:
        for adapter_id in [key for key, at in _wanted_at.items() if now - at >= WANT_EVERY_S]:
            del _wanted_at[adapter_id]
    _wanted_at[adapter.id] = now
    await in_worker_thread(want_adapter)(adapter.id)


async def hold(call: cold_start.HeldCall, adapter: directory.AdapterInfo,
               place: cold_start.Place | None) -> list[directory.ReplicaInfo] | None:
    """The READY replicas of `call.endpoint` that hold `adapter` once one does (the call is then counted in flight, no
    longer waiting); None if the client left first.

    Raises a 503 after the endpoint's `cold_start_timeout_s`, a 400 if the adapter fails meanwhile. The place
    (`cold_start.take_place`) is given up however it ends."""
    endpoint = call.endpoint
    deadline = time.monotonic() + endpoint.cold_start_timeout_s
    call.metrics.waiting.inc()
    try:
        async with pubsub.subscribe(endpoint_ready_channel(endpoint.id)) as signal:
            holding = await _wait_for_holders(call, adapter, place, signal, deadline)
    finally:
        call.metrics.waiting.dec()
        await cold_start.give_up(place)
    if holding is not None:
        await traffic.promote_request(endpoint.organization_id, endpoint.id, call.request_id)
    return holding


async def _wait_for_holders(call: cold_start.HeldCall, adapter: directory.AdapterInfo, place: cold_start.Place | None,
                            signal: pubsub.Signal, deadline: float) -> list[directory.ReplicaInfo] | None:
    endpoint = call.endpoint
    since = None  # when the message that woke this wait came: read what it announced (one read for all it woke)
    while True:
        if call.disconnected.is_set():
            return None
        replicas = await directory.ready_replicas(endpoint.id, fresh_since=since, generation=endpoint.engine_generation)
        holding = held_by(adapter, replicas)
        if holding:
            return holding
        adapter = (await directory.endpoint_adapters(endpoint.id, fresh_since=since)).get(adapter.name) or adapter
        await refuse_if_failed(endpoint, adapter)
        await want(adapter)
        await cold_start.keep_place(place)
        if time.monotonic() >= deadline:
            raise not_loaded(adapter)
        since = signal.arrived_at if await signal.wait(POLL_S) else None
