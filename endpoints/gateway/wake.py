"""Waking an endpoint's autoscaler at once when a request arrives to no READY replica."""

from asgiref.sync import sync_to_async

from controlplane.redis_client import get_async_redis
from controlplane.redis_keys import wake_key
from controlplane.tasks import send_task

WAKE_DEDUPE_S = 2
# NOTE: sent by name: the task (`endpoints.tasks`) calls the scheduler, which reads the gateway's
# counters, so importing the task here would close a cycle.
WAKE_TASK = "endpoints.wake_endpoint"


def _send_wake(endpoint_id: str) -> None:
    send_task(WAKE_TASK, args=[endpoint_id])


async def wake_endpoint(endpoint_id: str) -> None:
    # NOTE: many held requests of one endpoint send one task per WAKE_DEDUPE_S, not one each.
    if await get_async_redis().set(wake_key(endpoint_id), 1, nx=True, ex=WAKE_DEDUPE_S):
        await sync_to_async(_send_wake, thread_sensitive=False)(endpoint_id)
