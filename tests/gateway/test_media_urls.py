"""Media in a chat comes inline, as a `data:` URL: the gateway refuses a URL an engine would fetch.

Before, any URL passed: vLLM fetched an `http(s)://` image, audio or video URL a caller named from any host,
following redirects, so a tenant with a multimodal endpoint made its engine send GETs to other tenants'
engines on the node (`http://127.0.0.1:8001/health`), internal services and the cloud's metadata service
(`http://169.254.169.254/…`). Engines now refuse every such URL themselves (tests/agent/test_engine_command.py);
the gateway says why first, in OpenAI's shape, naming the part.
"""

import json

import httpx
import pytest

from billing.models import UsageRecord
from endpoints.gateway.errors import OpenAIError
from endpoints.gateway.request import parse_payload
from tests.gateway.conftest import serve_endpoint

PNG = (  # one pixel
    "data:image/png;base64,"
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg=="
)


def _chat(*parts: dict) -> dict:
    return {"model": "m", "messages": [
        {"role": "system", "content": "Describe what you are shown."},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]},
    ]}  # fmt: skip


def _refusal(payload: dict) -> OpenAIError:
    with pytest.raises(OpenAIError) as refused:
        parse_payload(json.dumps(payload).encode(), "chat")
    return refused.value


@pytest.mark.parametrize("part, param", [
    ({"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data/iam/"}},
     "messages[1].content[1].image_url.url"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png", "detail": "auto"}},
     "messages[1].content[1].image_url.url"),
    ({"type": "video_url", "video_url": {"url": "http://127.0.0.1:8001/health"}}, "messages[1].content[1].video_url.url"),
    ({"type": "audio_url", "audio_url": {"url": "http://10.0.0.5/internal"}}, "messages[1].content[1].audio_url.url"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "messages[1].content[1].image_url.url"),
    ({"type": "image_url", "image_url": {"url": " data:image/png;base64,AAAA"}},
     "messages[1].content[1].image_url.url"),  # vLLM would not take it for a data: URL
    # The Responses API's image part, which vLLM's chat also reads: the URL is the field itself.
    ({"type": "input_image", "image_url": "http://169.254.169.254/"}, "messages[1].content[1].image_url"),
    # With a `uuid`, vLLM reads the media from whichever of these fields a part has, whatever its `type`.
    ({"type": "text", "text": "x", "uuid": "u1", "image_url": "http://127.0.0.1:9000/"},
     "messages[1].content[1].image_url"),
    ({"type": "image_url", "uuid": "u1", "video_url": {"url": "HTTP://metadata.google.internal/"}},
     "messages[1].content[1].video_url.url"),
])  # fmt: skip
def test_a_media_url_an_engine_would_fetch_is_a_400_naming_the_part(part, param):
    refusal = _refusal(_chat(part))

    assert (refusal.status, refusal.param, refusal.code) == (400, param, "unsupported_value")
    assert "data: URL" in refusal.message and "inline" in refusal.message
    assert json.loads(refusal.body())["error"]["param"] == param


def test_a_media_url_that_is_not_a_string_is_a_400_naming_it():
    refusal = _refusal(_chat({"type": "image_url", "image_url": {"url": ["http://127.0.0.1/"]}}))

    assert (refusal.param, refusal.code) == ("messages[1].content[1].image_url.url", "invalid_type")


def test_media_sent_inline_as_a_data_url_still_passes():
    """What OpenAI's SDKs send for a local file: the bytes, base64-encoded in a `data:` URL."""
    body = _chat(
        {"type": "image_url", "image_url": {"url": PNG, "detail": "auto"}},
        {"type": "image_url", "image_url": {"url": "DATA:image/png;base64,AAAA"}},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "image_url", "uuid": "seen-before", "image_url": None},  # vLLM's cache, by the part's uuid
    )

    assert parse_payload(json.dumps(body).encode(), "chat") == body


@pytest.mark.django_db(transaction=True)
def test_a_media_url_never_reaches_the_engine_and_costs_nothing(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    body = _chat({"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data/"}})

    response = httpx.post(
        f"{gateway}/v1/chat/completions",
        json=body | {"model": endpoint.name, "max_tokens": 2},
        headers={"Authorization": f"Bearer {tenant.key}"},
        timeout=30,
    )

    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[1].content[1].image_url.url"
    assert not UsageRecord.objects.exists()
