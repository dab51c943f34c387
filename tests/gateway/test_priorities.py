"""A client's `priority`: only within what its key allows, and what the engine then gets.

vLLM's convention: lower runs sooner, interactive calls at 0, batch work later. A key without
`max_priority_boost` may not pass `priority` at all; one with N may pass -N … N. Refusals are 400s
in OpenAI's shape naming `priority`. The real engine accepting a prioritised call is
`test_vllm_gateway` and `test_embeddings_vllm`.
"""

from __future__ import annotations

import json

import openai
import pytest

from billing.models import UsageRecord
from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import ApiKey, Scope
from controlplane.accounts.services import Actor
from endpoints.gateway.request import InferenceRequest
from tests.conftest import wait_until
from tests.gateway.conftest import serve_endpoint

MESSAGES = [{"role": "user", "content": "hi"}]


def _key(tenant, **limits) -> str:
    return create_api_key(Actor(user=tenant.owner), tenant.org, name="p", scopes=[Scope.INFERENCE], **limits).plain


def _client(gateway, key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0)


@pytest.mark.django_db(transaction=True)
def test_a_key_without_a_priority_range_may_not_pass_priority(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    with pytest.raises(openai.BadRequestError) as refused:
        tenant.client(gateway).chat.completions.create(model=endpoint.name, messages=MESSAGES,
                                                       extra_body={"priority": -1})
    assert refused.value.param == "priority" and refused.value.code == "priority_not_allowed"
    assert not UsageRecord.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_key_may_pass_priority_within_its_range_only(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    client = _client(gateway, _key(tenant, max_priority_boost=5))
    for outside in (-6, 6):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=endpoint.name, messages=MESSAGES, extra_body={"priority": outside})
        assert refused.value.param == "priority" and "-5" in refused.value.message
    with pytest.raises(openai.BadRequestError) as not_a_number:
        client.chat.completions.create(model=endpoint.name, messages=MESSAGES, extra_body={"priority": "high"})
    assert not_a_number.value.param == "priority"
    for inside in (-5, 0, 5):
        assert client.chat.completions.create(model=endpoint.name, messages=MESSAGES, extra_body={"priority": inside}).choices
    wait_until(lambda: UsageRecord.objects.count() == 3, 10, message="three usage rows")


def test_the_engine_gets_the_calls_engine_priority():
    body = json.dumps({"model": "m", "messages": MESSAGES, "priority": -3}).encode()
    asked = InferenceRequest.parse(body, kind="chat", path="/v1/chat/completions", max_priority_boost=3)
    assert asked.priority == -3 and asked.upstream_body(media_scope="key:1") == body  # passed through unchanged
    plain = InferenceRequest.parse(json.dumps({"model": "m", "messages": MESSAGES}).encode(), kind="chat",
                                   path="/v1/chat/completions")
    assert plain.priority == 0 and "priority" not in json.loads(plain.upstream_body(media_scope="key:1"))
    # Batch work sets the engine priority itself: the engine gets it, streamed or not.
    batch = InferenceRequest(plain.kind, plain.path, plain.body, plain.payload | {"stream": True}, priority=100)
    upstream = json.loads(batch.upstream_body(media_scope="key:1"))
    assert upstream["priority"] == 100 and upstream["stream_options"]["include_usage"] is True


@pytest.mark.django_db
def test_the_api_sets_a_keys_priority_range_with_field_errors(owner_client):
    owner_client.credentials()  # signed in, not with a key: a key mints no key beyond its own priority range
    owner_client.force_login(owner_client.user)
    for bad in (-1, 100, "wide"):
        refused = owner_client.post("/api/v1/keys/", {"name": "p", "scopes": ["inference"], "max_priority_boost": bad},
                                    format="json")
        assert refused.status_code == 400 and "max_priority_boost" in refused.json()
    created = owner_client.post("/api/v1/keys/", {"name": "p", "scopes": ["inference"], "max_priority_boost": 10},
                                format="json")
    assert created.status_code == 201 and created.json()["api_key"]["max_priority_boost"] == 10
    assert ApiKey.objects.get(pk=created.json()["api_key"]["id"]).max_priority_boost == 10
    default = owner_client.post("/api/v1/keys/", {"name": "q", "scopes": ["inference"]}, format="json")
    assert default.json()["api_key"]["max_priority_boost"] is None
