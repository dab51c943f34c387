"""The endpoint page shows a capacity wait, a failure and a scale-up backing off as what they are, with the reason."""

import pytest

from controlplane.accounts.services import SYSTEM
from endpoints import scheduler
from endpoints.fleet.services import create_join_token
from endpoints.models import Endpoint, Replica
from endpoints.nodes.models import NodePool
from tests.factories import EndpointFactory
from tests.test_agent_api import register
from tests.test_endpoint_failures import IDLE, TINY, beat, failed
from tests.test_scale_up_backoff import fail_extra_replicas, serving

pytestmark = pytest.mark.django_db


def test_an_endpoint_waiting_for_capacity_says_so_and_why(owner, org):
    endpoint = EndpointFactory(organization=org, model_source=TINY, gpu_type="cpu", min_replicas=1)
    scheduler.reconcile_endpoint(str(endpoint.pk), IDLE)
    page = owner.get(f"/console/endpoints/{endpoint.pk}/").content.decode()
    assert "Waiting for capacity" in page and "Scaled to zero" not in page
    assert "waiting for capacity: no READY node of GPU type cpu" in page
    assert "X-Inferplane-Wait-For-Capacity" in page


def test_a_failed_endpoint_shows_its_reason_and_offers_a_retry(owner, org, client):
    secret = register(client, create_join_token(SYSTEM, name="test").plain).json()["node_secret"]
    endpoint = EndpointFactory(organization=org, model_source=TINY, gpu_type="cpu", min_replicas=1, max_model_len=4096)
    scheduler.reconcile_endpoint(str(endpoint.pk), IDLE)
    beat(client, secret, replicas=[failed(Replica.objects.get(endpoint=endpoint), permanent=True)])
    page = owner.get(f"/console/endpoints/{endpoint.pk}/").content.decode()
    assert 'class="badge state-failed"' in page
    assert "above this model&#x27;s context of 2048 tokens" in page and ">Retry</button>" in page
    listing = owner.get("/console/endpoints/").content.decode()
    assert "state-failed" in listing and "above this model&#x27;s context" in listing


def test_an_endpoint_whose_node_pool_is_bringing_a_node_says_it_is_provisioning_one(owner, org):
    NodePool.objects.create(name="cpu-pool", gpu_type="cpu", provider="local", gpus_per_node=0, gpu_memory_mb=8192,
                            max_nodes=1)
    endpoint = EndpointFactory(organization=org, model_source=TINY, gpu_type="cpu", min_replicas=1)
    scheduler.reconcile_endpoint(str(endpoint.pk), IDLE)
    page = owner.get(f"/console/endpoints/{endpoint.pk}/").content.decode()
    assert "provisioning a node" in page and "Starting" in page
    assert "Waiting for capacity" not in page and "X-Inferplane-Wait-For-Capacity" not in page


def test_the_endpoint_page_says_its_scale_up_backs_off_and_offers_a_retry(org, owner):
    # Before: no Retry on the page of an endpoint backing off that was neither paused nor failed.
    endpoint, _replica = serving(org)
    fail_extra_replicas(endpoint, 2)
    page = owner.get(f"/console/endpoints/{endpoint.pk}/").content.decode()
    assert "scale-up backing off: engine exited with code -9; next try in" in page and ">Retry</button>" in page
    owner.post(f"/console/endpoints/{endpoint.pk}/resume/")
    assert Endpoint.objects.get(pk=endpoint.pk).next_attempt_at is None
    assert ">Retry</button>" not in owner.get(f"/console/endpoints/{endpoint.pk}/").content.decode()
