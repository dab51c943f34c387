"""A media part's `uuid` reaches the engine scoped to the calling key.

vLLM takes a part's `uuid` for the identity of its media in place of a hash of the bytes: it keys the engine's
cache of processed media, and a part naming a uuid with no media is answered from the cached item. Passed through,
another key of the same endpoint (a colleague's, or an organisation's customer's) named an item someone else had
sent and got an answer about it; a caller could also put its own image under a uuid someone else would use.
"""

import json

import httpx
import pytest

from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import Scope
from controlplane.accounts.services import Actor
from endpoints.gateway.errors import OpenAIError
from endpoints.gateway.media_uuids import scoped_uuid
from endpoints.gateway.request import InferenceRequest
from tests.gateway.conftest import serve_endpoint
from tests.gateway.test_media_urls import PNG, _chat


def _parts_reaching_the_engine(body: dict, scope: str) -> list[dict]:
    request = InferenceRequest.parse(json.dumps(body).encode(), kind="chat", path="/v1/chat/completions")
    return json.loads(request.upstream_body(media_scope=scope))["messages"][1]["content"]


def test_a_media_uuid_reaches_the_engine_as_one_of_the_calling_keys_own():
    body = _chat(
        {"type": "image_url", "image_url": {"url": PNG}, "uuid": "cat"},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}, "uuid": "meow"},
        {"type": "video_url", "video_url": None, "uuid": "cat-video"},
    )

    first = _parts_reaching_the_engine(body, "key:1")
    again = _parts_reaching_the_engine(body, "key:1")
    other = _parts_reaching_the_engine(body, "key:2")

    assert [part.get("uuid") for part in first] == [
        None,
        scoped_uuid("key:1", "cat"),
        scoped_uuid("key:1", "meow"),
        scoped_uuid("key:1", "cat-video"),
    ]
    assert first == again  # the key's own item, named again, is found again
    assert {part["uuid"] for part in first[1:]}.isdisjoint(part["uuid"] for part in other[1:])
    assert not {"cat", "meow", "cat-video"} & {part.get("uuid") for part in first + other}
    assert first[1]["image_url"] == {"url": PNG} and first[0] == {"type": "text", "text": "What is this?"}


def test_a_body_without_a_media_uuid_is_proxied_as_the_client_sent_it():
    raw = json.dumps(_chat({"type": "image_url", "image_url": {"url": PNG}})).encode()
    request = InferenceRequest.parse(raw, kind="chat", path="/v1/chat/completions")

    assert request.upstream_body(media_scope="key:1") is raw


def test_a_media_uuid_that_is_not_a_string_is_a_400_naming_it():
    with pytest.raises(OpenAIError) as refused:
        InferenceRequest.parse(
            json.dumps(_chat({"type": "image_url", "image_url": None, "uuid": 7})).encode(),
            kind="chat",
            path="/v1/chat/completions",
        )

    assert (refused.value.status, refused.value.param, refused.value.code) == (
        400,
        "messages[1].content[1].uuid",
        "invalid_type",
    )


@pytest.mark.django_db(transaction=True)
def test_two_keys_naming_the_same_media_uuid_never_reach_the_same_engine_item(
    gateway, tenant, start_mock_upstream
):
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    # Another key of the same organisation (as a customer key it minted would be) on the same endpoint.
    colleague = create_api_key(
        Actor(user=tenant.owner), tenant.org, name="customer", scopes=[Scope.INFERENCE]
    ).plain
    sent = {"type": "image_url", "image_url": {"url": PNG}, "uuid": "holiday-photo"}
    named = {
        "type": "image_url",
        "image_url": None,
        "uuid": "holiday-photo",
    }  # "the item you have under this uuid"

    seen = []
    for key, part in ((tenant.key, sent), (colleague, named), (tenant.key, named)):
        response = httpx.post(
            f"{gateway}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json=_chat(part) | {"model": endpoint.name, "max_tokens": 2},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        seen.append(httpx.get(f"{upstream}/_stats").json()["last_payload"]["messages"][1]["content"][1])

    owner_sent, colleague_named, owner_named = (part["uuid"] for part in seen)
    assert colleague_named != owner_sent  # the colleague's key cannot name the owner's image
    assert owner_named == owner_sent  # the owner's own key still can
    assert "holiday-photo" not in {owner_sent, colleague_named}
    assert seen[0]["image_url"] == {"url": PNG}


def _salt_reaching_the_engine(body: dict, scope: str, kind: str = "chat") -> str | None:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    request = InferenceRequest.parse(json.dumps(body).encode(), kind=kind, path=path)
    return json.loads(request.upstream_body(media_scope=scope)).get("cache_salt")


def test_a_cache_salt_reaches_the_engine_as_one_of_the_calling_keys_own():
    # vLLM shares prefix-cache blocks only between requests with the same `cache_salt`: a caller salts its prompts to
    # keep their cached blocks, and the timing they reveal, from others. Passed through, another key of the endpoint
    # that sent the same salt shared them.
    chat = _chat() | {"cache_salt": "tenant-a"}
    completion = {"model": "m", "prompt": "Once upon a time", "cache_salt": "tenant-a"}

    assert _salt_reaching_the_engine(chat, "key:1") == scoped_uuid("key:1", "tenant-a")
    assert _salt_reaching_the_engine(chat, "key:2") == scoped_uuid("key:2", "tenant-a") != scoped_uuid("key:1", "tenant-a")
    assert _salt_reaching_the_engine(completion, "key:1", "completion") == scoped_uuid("key:1", "tenant-a")
    assert _salt_reaching_the_engine(_chat(), "key:1") is None


@pytest.mark.parametrize("salt", [7, "", "a/b", "x" * 129])
def test_a_cache_salt_the_engine_would_refuse_is_a_400(salt):
    with pytest.raises(OpenAIError) as refused:
        InferenceRequest.parse(json.dumps(_chat() | {"cache_salt": salt}).encode(), kind="chat",
                               path="/v1/chat/completions")
    assert refused.value.status == 400 and refused.value.param == "cache_salt"
