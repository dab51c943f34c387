"""A content part is the one kind of content its `type` names, as the engine reads it, or it is a 400 naming the part.

vLLM reads a part with a `uuid` by its keys, not its `type`: `{"type": "text", "text": "x", "uuid": "u1",
"image_url": ...}` is an image to the engine (with `"image_url": null`, the caller's cached image of that uuid). The
gateway took it for its text: twenty such parts were reserved as ~140 tokens while the engine prefilled twenty images
(a genuine image is reserved as the whole context), and the bill stops at the reservation, so the images went unbilled
past a hard cap and prepaid credit (found by a review). Such a part is now refused before anything is reserved, on
chat, on `/v1/responses` and in a batch's lines, and the estimate reads a part's text only when the engine would.
"""

import json

import httpx
import pytest

from billing.models import UsageRecord
from billing.quota import reads
from endpoints.batches.validation import parse_lines
from endpoints.gateway import estimate
from endpoints.gateway.content_parts import kind_of
from endpoints.gateway.errors import OpenAIError
from endpoints.gateway.request import parse_payload
from tests.gateway.conftest import serve_endpoint
from tests.gateway.test_media_urls import PNG

CONTEXT = 32_768
DISGUISED = {"type": "text", "text": "x", "uuid": "u1", "image_url": {"url": PNG}}
CACHED = {"type": "text", "text": "x", "uuid": "u1", "image_url": None}  # the caller's cached image, by its uuid

# Each: a part, and the kind vLLM reads it as (None: it refuses the part).
PARTS = [
    (DISGUISED, "image_url"),
    (CACHED, "image_url"),
    ({"type": "text", "text": "x", "uuid": "u1", "input_audio": {"data": "AAAA", "format": "wav"}}, "input_audio"),
    ({"type": "input_text", "text": "x", "uuid": "u1", "video_url": None}, "video_url"),
    ({"type": "refusal", "refusal": "x", "uuid": "u1", "audio_url": None}, "audio_url"),
    ({"type": "image_url", "uuid": "u1", "video_url": None}, "video_url"),
    ({"type": "text", "text": "x", "uuid": "u1"}, None),
    ({"type": "text", "text": "x", "uuid": "u1", "tool_reference": "t"}, "tool_reference"),
    ({"type": "image_url", "uuid": "u1", "image_url": None, "audio_url": None}, "image_url"),
    ({"type": "text", "text": "x", "image_url": {"url": PNG}}, "text"),  # no uuid: read by its type
    ({"type": "text", "text": "x", "image_url": None}, "text"),  # a null media key, as generated clients send
    ({"type": "input_text", "text": "x", "video_url": None, "uuid": None}, "input_text"),
    ({"type": "image_url", "image_url": {"url": PNG}}, "image_url"),
    ({"type": "image_url", "image_url": None, "uuid": "u1"}, "image_url"),
    ({"type": "input_image", "image_url": PNG, "detail": "auto"}, "input_image"),
    ({"type": "input_image", "image_url": PNG, "detail": "auto", "uuid": "u1"}, "image_url"),
    ({"type": "text", "text": "x"}, "text"),
    ({"type": "text", "text": "x", "uuid": None}, "text"),
    ({"type": "sticker", "text": "x"}, "sticker"),  # unknown: the engine refuses it by its name
]
# Parts an OpenAI client may send, each the kind its type names: they pass.
PLAIN = [
    {"type": "text", "text": "What is this?"},
    {"type": "image_url", "image_url": {"url": PNG, "detail": "auto"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "image_url", "image_url": None, "uuid": "seen-before"},
    {"type": "video_url", "video_url": None, "uuid": "seen-before"},
    {"type": "input_image", "image_url": PNG},
    {"type": "text", "text": "hi", "image_url": None},  # clients generated from OpenAI's schema send every field
    {"type": "image_url", "image_url": {"url": PNG}, "input_audio": None, "video_url": None},
]
# Parts that carry another kind than their type names, or name media they do not carry.
REFUSED = [part for part, kind in PARTS if kind not in (part["type"], "sticker")]


def _chat(*parts: dict) -> dict:
    return {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                                       *parts]}]}


def _refusal(payload: dict, kind: str = "chat") -> OpenAIError:
    with pytest.raises(OpenAIError) as refused:
        parse_payload(json.dumps(payload).encode(), kind)
    return refused.value


@pytest.mark.parametrize("part, kind", PARTS)
def test_a_parts_kind_is_the_one_vllm_reads_it_as(part, kind):
    chat_utils = pytest.importorskip("vllm.renderers.chat_utils")
    from vllm.exceptions import VLLMValidationError

    try:
        vllm_kind = chat_utils._parse_chat_message_content_mm_part(part)[0]
    except VLLMValidationError:  # the engine refuses the part
        vllm_kind = None

    assert (kind_of(part), vllm_kind) == (kind, kind)


@pytest.mark.parametrize("part", REFUSED)
def test_a_part_the_engine_reads_as_another_kind_than_its_type_is_a_400_naming_the_part(part):
    refusal = _refusal(_chat(part))

    assert (refusal.status, refusal.param, refusal.code) == (400, "messages[0].content[1]", "invalid_value")
    assert json.loads(refusal.body())["error"]["param"] == "messages[0].content[1]"
    assert repr(part["type"]) in refusal.message


def test_a_text_part_carrying_media_without_a_uuid_is_refused_too():
    # vLLM reads it as its text, but OpenAI's API has no such part, and vLLM's own check of a body's media reads any
    # part with a media key as media: one kind of content a part.
    refusal = _refusal(_chat({"type": "text", "text": "x", "image_url": {"url": PNG}}))

    assert (refusal.param, "'image_url'" in refusal.message) == ("messages[0].content[1]", True)


def test_a_text_part_with_a_media_key_set_to_null_is_its_text_and_a_uuid_makes_it_the_media_again():
    # vLLM reads a part without a `uuid` by its `type`: the null carries nothing; it was a 400 ("it also carries
    # 'image_url'"). With a `uuid` the engine reads the null as the caller's cached image: still refused.
    text = {"type": "text", "text": "hi", "image_url": None}
    batch_line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": _chat(text)}

    assert parse_payload(json.dumps(_chat(text)).encode(), "chat") == _chat(text)
    assert parse_payload(json.dumps({"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "hi", "image_url": None}]}]}).encode(), "responses")
    assert parse_lines([json.dumps(batch_line).encode() + b"\n"], request_path="/v1/chat/completions", kind="chat",
                       max_lines=10).num_lines == 1
    assert estimate.worst_case(_chat(text), "chat", CONTEXT).num_prompt_tokens < CONTEXT  # priced as its text
    assert _refusal(_chat(text | {"uuid": "u1"})).param == "messages[0].content[1]"


def test_parts_of_one_kind_each_pass():
    body = _chat(*PLAIN)

    assert parse_payload(json.dumps(body).encode(), "chat") == body


def test_a_part_the_engine_reads_as_media_is_reserved_as_media_whatever_its_type():
    genuine = estimate.worst_case(_chat({"type": "image_url", "image_url": {"url": PNG}}), "chat", CONTEXT)
    disguised = estimate.worst_case(_chat(*[DISGUISED] * 20), "chat", CONTEXT)  # before: 168 tokens
    cached = estimate.worst_case(_chat(CACHED), "chat", CONTEXT)

    assert genuine.num_prompt_tokens == disguised.num_prompt_tokens == cached.num_prompt_tokens == CONTEXT


def test_a_responses_part_carrying_another_kind_is_a_400_naming_the_part():
    item = {"role": "user", "content": [{"type": "input_text", "text": "x", "image_url": PNG}]}
    refusal = _refusal({"model": "m", "input": [item]}, "responses")

    assert (refusal.status, refusal.param, refusal.code) == (400, "input[0].content[0]", "invalid_value")


def test_a_responses_part_naming_a_uuid_is_still_refused_for_its_uuid():
    item = {"role": "user", "content": [{"type": "input_text", "text": "x", "uuid": "u1", "image_url": None}]}
    refusal = _refusal({"model": "m", "input": [item]}, "responses")

    assert (refusal.param, refusal.code) == ("input[0].content[0].uuid", "unsupported_parameter")


def test_a_batch_line_with_a_disguised_part_is_refused_when_the_batch_is_checked():
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": _chat(DISGUISED)}
    checked = parse_lines([json.dumps(line).encode() + b"\n"], request_path="/v1/chat/completions", kind="chat",
                          max_lines=10)

    assert checked.num_lines == 0
    assert [(error.code, error.param) for error in checked.errors] == [("invalid_value", "body.messages[0].content[1]")]


@pytest.mark.django_db(transaction=True)
def test_a_disguised_part_never_reaches_the_engine_and_costs_nothing(gateway, tenant, start_mock_upstream):
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)

    response = httpx.post(f"{gateway}/v1/chat/completions", json=_chat(*[CACHED] * 20) | {"model": endpoint.name},
                          headers={"Authorization": f"Bearer {tenant.key}"}, timeout=30)

    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages[0].content[1]"
    assert httpx.get(f"{upstream}/_stats", timeout=10).json()["num_requests"] == 0
    assert not UsageRecord.objects.exists()
    assert reads.reserved_now(tenant.org.pk) == 0
