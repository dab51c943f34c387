from celery import shared_task

from endpoints import scheduler


@shared_task(name="endpoints.reconcile_endpoint", acks_late=True, time_limit=60, soft_time_limit=50)
def reconcile_endpoint(endpoint_id: str) -> None:
    scheduler.reconcile_endpoint(endpoint_id)


@shared_task(name="endpoints.reconcile_all", acks_late=True, time_limit=120, soft_time_limit=100)
def reconcile_all() -> None:
    from endpoints.models import Endpoint

    for endpoint_id in Endpoint.objects.values_list("pk", flat=True):
        scheduler.reconcile_endpoint(str(endpoint_id))
