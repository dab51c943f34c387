"""The worker's liveness task (the project's own; each app keeps its tasks in its `tasks.py`)."""

from celery import shared_task


@shared_task(name="controlplane.ping", acks_late=True, time_limit=10, soft_time_limit=5)
def ping(value: str = "pong") -> str:
    """Proves a worker is alive and consuming; the beat sends one a minute."""
    return value
