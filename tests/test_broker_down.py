"""A Celery broker out of reach never turns a management call whose writes committed into a 500.

The calls that change an endpoint ask for its reconcile (`replicas.request_reconcile`) once they commit, and a node
pool's demand asks for the pool tick: hints, since the autoscaler's and the pools' ticks reach them anyway. A broker
that refused the task raised out of the request after its writes had committed: a 500 for an endpoint created, and a
client retrying made it again (a 400 for its name, or a second endpoint under another)."""

import kombu.exceptions
import pytest
from celery import current_app

from endpoints.models import Endpoint
from tests.test_endpoint_failures import FIRST_USE

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def broker_down(monkeypatch):
    def send_task(*args, **kwargs):
        raise kombu.exceptions.OperationalError("Error 111 connecting to the broker. Connection refused.")

    monkeypatch.setattr(current_app, "send_task", send_task)


def test_an_endpoint_is_created_changed_and_deleted_while_the_broker_is_down(owner_client, broker_down):
    created = owner_client.post("/api/v1/endpoints/", FIRST_USE | {"min_replicas": 1}, format="json")
    assert created.status_code == 201, created.content
    endpoint_id = created.json()["id"]
    changed = owner_client.patch(f"/api/v1/endpoints/{endpoint_id}/", {"min_replicas": 0}, format="json")
    assert changed.status_code == 200, changed.content
    assert Endpoint.objects.get(pk=endpoint_id).min_replicas == 0
    assert owner_client.delete(f"/api/v1/endpoints/{endpoint_id}/").status_code == 204
