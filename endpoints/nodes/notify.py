"""Push instead of poll: Redis pub/sub messages that cut a cold start's waiting.

- A node's desired replicas changed → its agent, long-polling `/agent/v1/watch`,
  heartbeats at once instead of at its next interval.
- A replica turned READY → requests the gateway holds for that endpoint go at once.
  So too when a replica loaded an adapter, or an engine refused one: calls held for it
  (`endpoints.gateway.adapter_hold`) go, or are refused, at once.

Messages are published after the transaction commits, so a listener that reacts
always reads the new state. A lost message costs only the old polling delay.
"""

from __future__ import annotations

from django.db import transaction

from controlplane.redis_client import get_redis


def node_channel(node_id) -> str:
    return f"agent:node:{node_id}"


def endpoint_ready_channel(endpoint_id) -> str:
    return f"gw:ready:{endpoint_id}"


def _publish_after_commit(channel: str) -> None:
    transaction.on_commit(lambda: get_redis().publish(channel, "1"), robust=True)  # a wake-up: its listeners poll too


def notify_node(node_id) -> None:
    if node_id is not None:
        _publish_after_commit(node_channel(node_id))


def notify_endpoint_ready(endpoint_id) -> None:
    _publish_after_commit(endpoint_ready_channel(endpoint_id))
