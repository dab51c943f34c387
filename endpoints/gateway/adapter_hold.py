"""Calls that name a LoRA adapter (`"<endpoint>:<adapter>"`): resolve the name, and hold the call
until a READY replica holds the adapter.

The gateway never loads an adapter itself: it marks the adapter wanted (`endpoints.adapters.
want_adapter`, one conditional update), which wakes the endpoint's agents (their desired specs
change); an agent loads it into its running engine in the background and reports it in its next
heartbeat. Meanwhile the call waits, like a cold start, re-reading the READY replicas.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from controlplane.worker_threads import in_worker_thread
from endpoints.adapters import parse_model_name, want_adapter
from endpoints.gateway import directory, errors

POLL_S = 0.25


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


async def holders(endpoint: directory.EndpointInfo, adapter: directory.AdapterInfo,
                  replicas: list[directory.ReplicaInfo], timeout_s: float) -> list[directory.ReplicaInfo]:
    """The READY replicas that hold `adapter`, waiting (at most `timeout_s`) for one to load it.

    NOTE: the wanted mark is refreshed while waiting, so the agents keep the most recently called
    adapters loaded; a 503 says the adapter did not load in time (its state says why, if refused).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        holding = [replica for replica in replicas if adapter.name in replica.adapters]
        if holding:
            return holding
        await in_worker_thread(want_adapter)(adapter.id)
        if time.monotonic() >= deadline:
            raise errors.OpenAIError(
                503, f"The adapter '{adapter.name}' is not loaded yet; see its state on the endpoint.",
                type="server_error", code="adapter_loading", headers={"retry-after": "10"})
        await asyncio.sleep(POLL_S)
        replicas = await directory.ready_replicas(endpoint.id, fresh=True, generation=endpoint.engine_generation) or replicas
