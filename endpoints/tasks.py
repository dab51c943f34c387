"""Celery's entry points for endpoints: thin wrappers over `endpoints.scheduler`, named by the
constants their senders use (`RECONCILE_TASK`, `WAKE_TASK`, `PROVISION_TASK`), so a sender never imports this module."""

from celery import shared_task

from endpoints import closing, scheduler
from endpoints.fleet import pool_strays, pools
from endpoints.fleet.pool_demand import PROVISION_TASK
from endpoints.gateway.wake import WAKE_TASK
from endpoints.replicas import RECONCILE_TASK


@shared_task(name=RECONCILE_TASK, acks_late=True, time_limit=60, soft_time_limit=50)
def reconcile_endpoint(endpoint_id: str) -> None:
    scheduler.reconcile_endpoint(endpoint_id)


@shared_task(name="endpoints.autoscale", acks_late=True, time_limit=30, soft_time_limit=25, ignore_result=True)
def autoscale() -> None:
    scheduler.autoscale_tick()


@shared_task(name="endpoints.sweep_stuck", acks_late=True, time_limit=60, soft_time_limit=50, ignore_result=True)
def sweep_stuck() -> None:
    scheduler.sweep_stuck()


@shared_task(name=WAKE_TASK, acks_late=True, time_limit=60, soft_time_limit=50)
def wake_endpoint(endpoint_id: str) -> None:
    """A request is waiting for a replica: decide now rather than at the next autoscaler tick."""
    scheduler.reconcile_endpoint(endpoint_id)


@shared_task(name=PROVISION_TASK, acks_late=True, time_limit=120, soft_time_limit=110, ignore_result=True)
def provision_nodes() -> None:
    """Launch machines for replicas with nowhere to go; release idle and dead ones (`endpoints.fleet.pools`)."""
    pools.provision_tick()


@shared_task(name="endpoints.sweep_stray_machines", acks_late=True, time_limit=240, soft_time_limit=220, ignore_result=True)
def sweep_stray_machines() -> None:
    """Terminate pool machines no launch record knows, once past the grace (`endpoints.fleet.pool_strays`)."""
    pool_strays.sweep_stray_machines()


@shared_task(name="endpoints.end_closed_subscriptions", acks_late=True, time_limit=300, soft_time_limit=270,
             ignore_result=True)
def end_closed_subscriptions() -> int:
    return closing.end_closed_subscriptions()
