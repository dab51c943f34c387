"""Tasks run in a real Celery worker process over the real Redis broker, never eagerly."""

import pytest

from controlplane.tasks import ping
from endpoints.models import Replica
from tests.factories import EndpointFactory


def test_a_real_worker_runs_a_task(celery_worker):
    result = ping.delay("hello from the test")
    assert result.get(timeout=60) == "hello from the test"


@pytest.mark.django_db(transaction=True)
def test_the_worker_reconciles_an_endpoint_without_capacity_into_waiting(celery_worker):
    endpoint = EndpointFactory(min_replicas=1, max_replicas=1)
    from endpoints.tasks import reconcile_endpoint

    reconcile_endpoint.delay(str(endpoint.pk)).get(timeout=60)
    endpoint.refresh_from_db()
    assert endpoint.status_message == "waiting for capacity: no READY node of GPU type l4"
    assert not Replica.objects.filter(endpoint=endpoint).exists()
