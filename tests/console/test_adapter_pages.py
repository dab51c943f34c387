"""The endpoint page's Adapters section: each adapter as calls name it, its state (with the reason
an engine refused it) and how many READY replicas hold it now."""

import pytest
from django.urls import reverse

from endpoints.models import Adapter, Replica
from gpu_agent.protocol import ReplicaState
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db


def test_the_endpoint_page_lists_its_adapters_with_their_state_and_the_replicas_holding_them(owner):
    endpoint = EndpointFactory(organization=owner.organization, name="llama", max_loras=2)
    Adapter.objects.create(endpoint=endpoint, name="tone", source="/a/tone", state="READY")
    Adapter.objects.create(endpoint=endpoint, name="big", source="/a/big", state="FAILED",
                           status_message="the adapter's rank 64 is above the endpoint's max_lora_rank 16")
    Replica.objects.create(endpoint=endpoint, state=ReplicaState.READY, adapters=["tone"])
    page = owner.get(reverse("console:endpoint", args=[endpoint.pk])).content.decode()
    assert "llama:tone" in page and "llama:big" in page
    assert "1 replica" in page and "above the endpoint&#x27;s max_lora_rank 16" in page


def test_an_endpoint_without_adapter_slots_says_adapters_are_off(owner):
    endpoint = EndpointFactory(organization=owner.organization, name="plain")
    page = owner.get(reverse("console:endpoint", args=[endpoint.pk])).content.decode()
    assert "Adapters are off for this endpoint" in page
