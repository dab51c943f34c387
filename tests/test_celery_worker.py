"""Tasks run in a real Celery worker process over the real Redis broker, never eagerly."""

import pytest

from controlplane.tasks import ping
from endpoints.models import Endpoint, Replica
from endpoints.replicas import request_reconcile
from tests.factories import EndpointFactory
from tests.processes import wait_until


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


@pytest.mark.django_db(transaction=True)
def test_a_requested_reconcile_reaches_the_worker_after_commit(celery_worker):
    endpoint = EndpointFactory(min_replicas=1, max_replicas=1)
    request_reconcile(endpoint.pk)  # sent by the task's name: the worker must know it
    wait_until(lambda: Endpoint.objects.get(pk=endpoint.pk).status_message, 60, message="the reconcile to run")
    endpoint.refresh_from_db()
    assert endpoint.status_message == "waiting for capacity: no READY node of GPU type l4"
