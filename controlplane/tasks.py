"""The worker's liveness task (the project's own; each app keeps its tasks in its `tasks.py`), and `send_task`, the way
a web process queues a task it never waits on."""

from celery import current_app, shared_task


def send_task(name: str, **options) -> None:
    """Queue the task named `name` for a worker (`options` as Celery's `send_task` takes them), its result never
    waited for.

    NOTE: `ignore_result`: with Redis as the result backend, Celery's `send_task` otherwise subscribes the sending
    thread's result consumer to the task's result channel (until the result object is collected), each worker thread
    that ever sent one on a pub/sub connection of its own that nothing reads: a gateway sent a SUBSCRIBE per cold-start
    wake and kept one more Redis connection per thread that had woken an endpoint (found by the gateway's soak)."""
    current_app.send_task(name, ignore_result=True, **options)


@shared_task(name="controlplane.ping", acks_late=True, time_limit=10, soft_time_limit=5)
def ping(value: str = "pong") -> str:
    """Proves a worker is alive and consuming; the beat sends one a minute."""
    return value
