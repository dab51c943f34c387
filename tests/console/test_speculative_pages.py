"""Speculative decoding in the console: the deploy wizard offers it with a line of explanation, refuses a
bad setting next to its field, and the endpoint page shows what the endpoint does."""

import pytest
from django.urls import reverse

from endpoints.models import Endpoint
from tests.console.test_endpoint_pages import VALID_SPEC
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db


def test_the_wizard_offers_speculative_decoding_with_an_explanation(owner):
    page = owner.get(reverse("console:endpoint-new")).content.decode()
    assert "Speculative decoding" in page and "Prompt lookup (n-gram)" in page and "Draft model" in page
    assert "same output, faster when guesses land" in page


def test_the_wizard_deploys_an_endpoint_with_prompt_lookup(owner):
    response = owner.post(reverse("console:endpoint-new"), VALID_SPEC | {
        "speculative_method": "ngram", "num_speculative_tokens": "6", "prompt_lookup_max": "5", "prompt_lookup_min": "2",
    })
    assert response.status_code == 302, response.content.decode()[:2000]
    endpoint = Endpoint.objects.get(name="support-chat")
    assert (endpoint.speculative_method, endpoint.num_speculative_tokens, endpoint.prompt_lookup_max) == ("ngram", 6, 5)


def test_the_wizard_shows_a_draft_model_without_a_source_next_to_its_field(owner):
    response = owner.post(reverse("console:endpoint-new"), VALID_SPEC | {"speculative_method": "draft"})
    assert response.status_code == 400
    assert "A draft model needs a source" in response.content.decode()
    assert not Endpoint.objects.filter(name="support-chat").exists()


def test_the_endpoint_page_shows_its_speculative_decoding(owner):
    endpoint = EndpointFactory(organization=owner.organization, speculative_method="draft",
                               draft_model_source="hf:meta-llama/Llama-3.2-1B", num_speculative_tokens=3)
    page = owner.get(reverse("console:endpoint", args=[endpoint.pk])).content.decode()
    assert "Speculative decoding" in page and "hf:meta-llama/Llama-3.2-1B" in page and "3 tokens per step" in page
    plain = EndpointFactory(organization=owner.organization)
    assert "Speculative decoding</dt><dd>off" in owner.get(reverse("console:endpoint", args=[plain.pk])).content.decode()
