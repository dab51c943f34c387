"""The official `openai` client against the gateway, with a mock upstream standing in for the engine.

What only a real engine shows (its own refusals, aborting a request whose client left, prefix-cache
hits billed at the cached price) is tested against real vLLM in tests/gateway/test_vllm_gateway.py.
"""

import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from billing.models import UsageRecord
from tests.conftest import wait_until
from tests.gateway.conftest import counting_openai_client, serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "Hello"}]


def test_chat_and_completions_answer_with_usage_and_write_one_usage_row_each(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    client = tenant.client(gateway)
    chat = client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=5)
    assert chat.choices[0].message.content == "tok tok tok tok tok"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (7, 5)
    completion = client.completions.create(model=endpoint.name, prompt="Once upon", max_tokens=3)
    assert completion.usage.completion_tokens == 3
    rows = wait_until(lambda: list(UsageRecord.objects.order_by("started_at")) if UsageRecord.objects.count() == 2 else None, 10,
                      message="two usage rows")
    assert [(r.prompt_tokens, r.completion_tokens, r.status) for r in rows] == [(7, 5, "ok"), (7, 3, "ok")]
    assert rows[0].api_key_id == tenant.api_key.pk and rows[0].endpoint_id == endpoint.pk
    assert rows[0].replica_id and rows[0].first_token_at and rows[0].cold_start_s == 0


def test_models_lists_the_organisations_endpoints_only(gateway, tenant, start_mock_upstream):
    from tests.factories import EndpointFactory

    mine = serve_endpoint(tenant.org, start_mock_upstream())
    EndpointFactory(name="someone-elses")
    assert [m.id for m in tenant.client(gateway).models.list().data] == [mine.name]


def test_streams_chunks_and_hides_usage_unless_asked(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    client = tenant.client(gateway)
    chunks = list(client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=4, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "tok tok tok tok "
    assert all(c.usage is None for c in chunks)
    with_usage = list(client.chat.completions.create(
        model=endpoint.name, messages=MESSAGES, max_tokens=4, stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in with_usage[:-1])
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 4
    rows = wait_until(lambda: list(UsageRecord.objects.all()) if UsageRecord.objects.count() == 2 else None, 10, message="rows")
    assert sorted(r.completion_tokens for r in rows) == [4, 4]


def test_the_async_client_streams_concurrently(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(token_delay_ms=5))

    async def one(client):
        text = ""
        async for chunk in await client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=8, stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        return text

    async def many():
        client = tenant.async_client(gateway)
        return await asyncio.gather(*(one(client) for _ in range(16)))

    assert asyncio.run(many()) == ["tok " * 8] * 16
    wait_until(lambda: UsageRecord.objects.filter(status="ok").count() == 16, 10, message="16 rows")


def test_error_cases_use_openais_shape_and_codes(gateway, tenant, start_mock_upstream, member_client_factory):
    from tests.factories import OrganizationFactory

    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    other_org_endpoint = serve_endpoint(OrganizationFactory(), start_mock_upstream(), name="private-model")

    with pytest.raises(openai.AuthenticationError) as bad_key:
        openai.OpenAI(base_url=f"{gateway}/v1", api_key="ip_000000000000_wrong", max_retries=0).models.list()
    assert bad_key.value.code == "invalid_api_key"

    from controlplane.accounts.keys import create_api_key
    from controlplane.accounts.services import Actor

    manage_only = create_api_key(Actor(user=tenant.owner), tenant.org, name="m", scopes=["manage"]).plain
    with pytest.raises(openai.PermissionDeniedError):
        openai.OpenAI(base_url=f"{gateway}/v1", api_key=manage_only, max_retries=0).chat.completions.create(
            model=endpoint.name, messages=MESSAGES)

    client = tenant.client(gateway)
    for name in ("no-such-model", other_org_endpoint.name):
        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(model=name, messages=MESSAGES)
        assert missing.value.code == "model_not_found"
        assert name in missing.value.message

    with pytest.raises(openai.BadRequestError) as absurd:
        client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=10_000_000)
    assert absurd.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=endpoint.name, messages=[])

    raw = httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {tenant.key}"})
    malformed = raw.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert malformed.status_code == 400 and malformed.json()["error"]["type"] == "invalid_request_error"
    wrong_type = raw.post("/v1/chat/completions", json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": "ten"})
    assert wrong_type.status_code == 400 and wrong_type.json()["error"]["param"] == "max_tokens"
    assert raw.post("/v1/chat/completions", json={"model": endpoint.name, "messages": MESSAGES, "stream": "yes"}).status_code == 400
    assert raw.get("/v1/chat/completions").status_code == 405
    assert raw.post("/v1/audio/speech", json={}).json()["error"]["code"] == "unknown_url"
    assert not UsageRecord.objects.exists()


def test_a_revoked_key_stops_working_within_seconds(gateway, tenant, start_mock_upstream):
    from controlplane.accounts.keys import revoke_api_key
    from controlplane.accounts.services import Actor

    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    client = tenant.client(gateway)
    client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=1)
    revoke_api_key(Actor(user=tenant.owner), tenant.api_key)

    def refused():
        try:
            client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=1)
        except openai.AuthenticationError:
            return True
        return False

    wait_until(refused, 10, interval_s=0.5, message="the revoked key to be refused")


def test_an_endpoint_without_capacity_answers_503_with_retry_after(gateway, tenant):
    from tests.factories import EndpointFactory

    # NOTE: held its whole cold-start timeout for a replica that never comes, then the 503: 1 s of holding shows it as
    # 10 did (the API's least), 9 s sooner.
    endpoint = EndpointFactory(organization=tenant.org, cold_start_timeout_s=1)
    response = httpx.post(f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {tenant.key}"},
                          json={"model": endpoint.name, "messages": MESSAGES}, timeout=30)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_capacity"
    assert int(response.headers["retry-after"]) > 0


def test_metrics_count_requests_and_tokens(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    tenant.client(gateway).chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=3)
    list(tenant.client(gateway).chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=2, stream=True))
    labels = {"endpoint_id": str(endpoint.pk), "organization_id": str(tenant.org.pk)}

    def counted_both():
        # Debugging without a token: open to loopback clients. A stream is counted just after its last chunk.
        values = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                  for family in text_string_to_metric_families(httpx.get(f"{gateway}/metrics").text)
                  for sample in family.samples}
        return values if values.get(("inferplane_requests_total", _sorted(labels, status="ok"))) == 2 else None

    values = wait_until(counted_both, 10, message="both requests counted")
    assert values[("inferplane_tokens_total", _sorted(labels, kind="completion"))] == 5
    assert any(name == "inferplane_time_to_first_token_seconds_bucket" for name, _ in values)
    assert values[("inferplane_replicas", _sorted(labels, state="READY"))] == 1


def _sorted(labels: dict, **more) -> tuple:
    return tuple(sorted((labels | more).items()))


def test_a_paused_endpoints_503_does_not_set_the_openai_client_retrying_for_two_minutes(gateway, tenant, monkeypatch):
    # Before: `retry-after: 60`, which openai-python honours (up to 60 s), and no `x-should-retry`: with its default two
    # retries a call to a paused endpoint slept 60 s twice and sent the call three times before it raised, though a
    # paused endpoint answers 503 until someone resumes it.
    from django.utils import timezone

    from tests.factories import EndpointFactory

    endpoint = EndpointFactory(organization=tenant.org, paused_at=timezone.now())
    client, sent, slept = counting_openai_client(f"{gateway}/v1", tenant.key, monkeypatch)
    with pytest.raises(openai.InternalServerError) as refused:
        client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=1)
    assert refused.value.status_code == 503 and refused.value.code == "endpoint_paused"
    assert (len(sent), slept) == (1, [])
    assert not UsageRecord.objects.exists()


def test_a_method_a_v1_path_does_not_serve_is_a_405_naming_the_methods_it_does(gateway, tenant, start_mock_upstream):
    """HTTP requires a 405 to say in `Allow` which methods the path serves (RFC 9110, 15.5.6); before, none did."""
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    raw = httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {tenant.key}"})
    for method, path, allowed in (("GET", "/v1/chat/completions", "POST"), ("PUT", "/v1/completions", "POST"),
                                  ("GET", "/v1/embeddings", "POST"), ("GET", "/v1/responses", "POST"),
                                  ("HEAD", "/v1/chat/completions", "POST"), ("OPTIONS", "/v1/embeddings", "POST"),
                                  ("POST", "/v1/models", "GET, HEAD"), ("OPTIONS", "/v1/models", "GET, HEAD"),
                                  ("DELETE", f"/v1/models/{endpoint.name}", "GET, HEAD"),
                                  ("PUT", "/v1/files", "GET, HEAD, POST"), ("OPTIONS", "/v1/files", "GET, HEAD, POST"),
                                  ("PUT", "/v1/files/file-x", "GET, HEAD, DELETE"),
                                  ("POST", "/v1/files/file-x/content", "GET, HEAD"),
                                  ("PATCH", "/v1/batches", "GET, HEAD, POST"), ("DELETE", "/v1/batches/batch_x", "GET, HEAD"),
                                  ("OPTIONS", "/v1/batches/batch_x/cancel", "POST"),
                                  ("GET", "/v1/batches/batch_x/cancel", "POST")):
        answer = raw.request(method, path)
        assert answer.status_code == 405, (method, path, answer.text)
        assert answer.headers.get("allow") == allowed, (method, path, answer.headers)
        if method != "HEAD":
            assert answer.json()["error"]["message"] == f"Method {method} not allowed on {path}."
        assert answer.headers["x-request-id"].startswith("req_")



def test_the_openai_client_may_pass_audio_as_none_and_a_responses_call_its_prompt_cache_retention(
        gateway, tenant, start_mock_upstream):
    """Both were a 400 before: `audio=None` (OpenAI's nullable field, sent as null) said audio was not supported, and
    `prompt_cache_retention`, which a chat call may send, was an unrecognised argument on `/v1/responses`."""
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    client = tenant.client(gateway)
    chat = client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=2, audio=None)
    assert chat.choices[0].message.content == "tok tok"
    response = client.responses.create(model=endpoint.name, input="Hello", max_output_tokens=2,
                                       prompt_cache_key="k", prompt_cache_retention="24h")
    assert response.output_text


def test_the_openai_client_may_send_its_newer_nullable_fields_as_none_and_is_told_why_one_set_is_refused(
        gateway, tenant, start_mock_upstream):
    """`moderation` (chat, Responses) and `context_management` (Responses) sent as None passed nowhere, and each set
    field was an "Unrecognized request argument", as a misspelt one is."""
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    client = tenant.client(gateway)
    chat = client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=2, moderation=None)
    assert chat.choices[0].message.content == "tok tok"
    response = client.responses.create(model=endpoint.name, input="Hello", max_output_tokens=2, moderation=None,
                                       context_management=None)
    assert response.output_text
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=endpoint.name, input="Hello", max_output_tokens=2,
                                background_options={"completion_window": "2h"})
    assert (refused.value.param, refused.value.code) == ("background_options", "unsupported_parameter")
    assert "not run in the background" in refused.value.message


def test_max_completion_tokens_past_the_context_is_refused_naming_max_completion_tokens(gateway, tenant,
                                                                                       start_mock_upstream):
    # The openai client's current name for the output cap is `max_completion_tokens`; before, its refusal named
    # `max_tokens`, a field the client never sent, and no code.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    client = tenant.client(gateway)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_completion_tokens=10_000_000)
    assert (refused.value.param, refused.value.code) == ("max_completion_tokens", "invalid_value")
    assert "max_completion_tokens is 10000000" in refused.value.message
    with pytest.raises(openai.BadRequestError) as legacy:
        client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=10_000_000)
    assert (legacy.value.param, legacy.value.code) == ("max_tokens", "invalid_value")
    assert not UsageRecord.objects.exists()


def test_deprecated_functions_are_refused_naming_tools_not_silently_dropped(gateway, tenant, start_mock_upstream):
    # Before, `functions` and `function_call` passed to the engine, which does not read them: the model answered in
    # text, and a caller waiting for `message.function_call` (old LangChain and LlamaIndex agents) got none.
    upstream = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, upstream)
    client = tenant.client(gateway)
    weather = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    with pytest.raises(openai.BadRequestError) as functions:
        client.chat.completions.create(model=endpoint.name, messages=MESSAGES, functions=[weather])
    assert (functions.value.param, functions.value.code) == ("functions", "unsupported_parameter")
    assert "'tools'" in functions.value.message
    with pytest.raises(openai.BadRequestError) as function_call:
        client.chat.completions.create(model=endpoint.name, messages=MESSAGES, function_call={"name": "get_weather"})
    assert (function_call.value.param, function_call.value.code) == ("function_call", "unsupported_parameter")
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 0
    # sent as null (not set), they change nothing
    answer = client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=1,
                                            extra_body={"functions": None, "function_call": None})
    assert answer.choices[0].message.content == "tok"


def test_an_engines_error_mid_stream_reaches_the_openai_client_in_openais_shape(gateway, tenant, start_mock_upstream):
    # vLLM writes a generation failing mid-stream as `data: {"error": …}` with its own type name and the HTTP status as
    # a numeric code; before, relayed as it was, the client's APIError had type "InternalServerError" and code 500.
    from tests.fakes.mock_openai import ENGINE_ERRORS_MID_STREAM

    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    client = tenant.client(gateway)
    received = []
    with pytest.raises(openai.APIError) as failed:
        for chunk in client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=4, stream=True,
                                                    user=ENGINE_ERRORS_MID_STREAM):
            received.append(chunk.choices[0].delta.content)
    assert received == ["tok "]
    assert (failed.value.type, failed.value.code, failed.value.param) == ("server_error", None, None)
    assert failed.value.message == "Internal server error"
    row = wait_until(lambda: UsageRecord.objects.first(), 10, message="the usage row")
    assert (row.status, row.completion_tokens) == ("upstream_error", 1)
