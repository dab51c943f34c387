"""A stream's first event, from a replica whose engine took the request and sends nothing for it (wedged, or busy on
CPU with something else, which its agent spares on purpose): waited for `GATEWAY_STREAM_FIRST_EVENT_TIMEOUT_S` of
silence, then only while the engine generates (its agent's last report), as a non-streamed answer past the read timeout
is. Before, the call, its reservation and its client waited out the whole read timeout (600 s), as long as the OpenAI
clients' own timeout, which they follow with a try of their own."""

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import pytest
from django.conf import LazySettings

from billing.models import UsageRecord
from controlplane.asgi import application
from controlplane.redis_client import get_redis
from controlplane.redis_keys import reservations_key
from endpoints.gateway import presence
from endpoints.gateway.call import InferenceCall
from endpoints.models import Endpoint, Replica
from tests.conftest import start_web_server, wait_until
from tests.fakes import responses_engine
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "Hello"}]
FIRST_EVENT_TIMEOUT_S = 1.0


# A prompt of ~10,000 bytes: bounded at ~10,000 tokens (`estimate`), whose prefill the gateway allows 5 s at
# `PREFILL_TOKENS_PER_S` (production: 200 a second, ~50 s) on top of the first event's bound.
LONG_MESSAGES = [{"role": "user", "content": "word " * 2000}]
PREFILL_TOKENS_PER_S = 2000


def _gateway(tmp_path, web_zygote):
    """A gateway waiting 1 s of silence for a stream's first event (production: 120 s), and 1 s more a 2,000 tokens of
    its prompt; its read timeout the production one (600 s)."""
    return start_web_server(tmp_path, name="gateway", zygote=web_zygote, extra_env={
        "INFERPLANE_GATEWAY_STREAM_FIRST_EVENT_TIMEOUT_S": str(FIRST_EVENT_TIMEOUT_S),
        "INFERPLANE_GATEWAY_STREAM_PREFILL_TOKENS_PER_S": str(PREFILL_TOKENS_PER_S)})


def _serve_long_prompts(organization, address: str):
    """An endpoint with room for `LONG_MESSAGES`, whose engine generated nothing in its agent's last report."""
    endpoint = serve_endpoint(organization, address)
    Endpoint.objects.filter(pk=endpoint.pk).update(max_model_len=32768)
    Replica.objects.filter(endpoint=endpoint).update(tokens_per_s=0.0)
    return endpoint


def _responses_stream(gateway: str, key: str, model: str, prefill_ms: int,
                      pause_ms: int = 0) -> tuple[list[bytes], float]:
    """A `/v1/responses` stream's events (each its lines) and how long it took, from the scripted engine, which writes
    `response.created` and `response.in_progress` at once, its first output `prefill_ms` later, and its second delta
    `pause_ms` after its first."""
    started = time.monotonic()
    metadata = {"scenario": "ok", "prefill_ms": str(prefill_ms), "pause_ms": str(pause_ms)}
    with httpx.stream("POST", f"{gateway}/v1/responses", headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "input": "hi", "stream": True, "max_output_tokens": 100,
                            "metadata": metadata}, timeout=20) as response:
        assert response.status_code == 200
        body = response.read()
    return [event for event in body.split(b"\n\n") if event], time.monotonic() - started


def _stream(gateway: str, key: str, model: str, messages: list[dict] = MESSAGES) -> tuple[int, list[dict], float]:
    """The stream's status, its events and how long it took; the client waits 20 s at most between bytes."""
    started = time.monotonic()
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "messages": messages, "stream": True, "max_tokens": 5}, timeout=20) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    return response.status_code, events, time.monotonic() - started


def test_a_stream_whose_engine_computes_nothing_for_it_ends_soon_with_an_error_event_unbilled_and_released(
        tenant, start_mock_upstream, tmp_path, web_zygote):
    silent = start_mock_upstream(prefill_ms=60_000)  # took the request, sends its headers, never gets to a token
    endpoint = serve_endpoint(tenant.org, silent)
    Replica.objects.filter(endpoint=endpoint).update(tokens_per_s=0.0)  # its agent's last report: generating nothing
    child, gateway = _gateway(tmp_path, web_zygote)
    try:
        status, events, seconds = _stream(gateway, tenant.key, endpoint.name)
        wait_until(lambda: not get_redis().hlen(reservations_key(tenant.org.pk)), 10, message="the reservation settled")
    finally:
        child.stop()

    assert status == 200 and len(events) == 1 and events[0]["error"]["code"] == "upstream_timeout", events
    assert seconds < 10 * FIRST_EVENT_TIMEOUT_S
    row = UsageRecord.objects.get()
    assert (row.status, row.prompt_tokens, row.completion_tokens, row.cost) == ("upstream_error", 0, 0, 0)
    assert httpx.get(f"{silent}/_stats").json()["num_requests"] == 1


def test_a_stream_whose_engine_generates_is_waited_for_past_the_first_event_bound_and_billed(
        tenant, start_mock_upstream, tmp_path, web_zygote):
    upstream = start_mock_upstream(prefill_ms=3000, token_delay_ms=10)  # a queue, a long prefill: three bounds' wait
    endpoint = serve_endpoint(tenant.org, upstream)
    Replica.objects.filter(endpoint=endpoint).update(tokens_per_s=50.0)  # its agent's last report: generating
    child, gateway = _gateway(tmp_path, web_zygote)
    try:
        status, events, _ = _stream(gateway, tenant.key, endpoint.name)
    finally:
        child.stop()

    assert status == 200 and not any("error" in event for event in events), events
    row = UsageRecord.objects.get()
    assert (row.status, row.completion_tokens) == ("ok", 5) and row.cost > 0
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 1


def test_a_streams_first_event_bound_is_read_without_djangos_lazy_look_up(
        tenant, start_mock_upstream, gateway_alone, monkeypatch):
    # Every streamed call read its first event's bound through `django.conf.settings` (`LazyObject.__getattribute__`,
    # 0.4-0.8 us), on the gateway's warm path, which reads its settings through `controlplane.hot_settings`.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    read = []
    look_up = LazySettings.__getattribute__

    def counted(self, name):
        if name == "GATEWAY_STREAM_FIRST_EVENT_TIMEOUT_S":
            read.append(name)
        return look_up(self, name)

    async def stream() -> int:
        transport = httpx.ASGITransport(app=application, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as http:
            response = await http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {tenant.key}"},
                                       json={"model": endpoint.name, "messages": MESSAGES, "stream": True,
                                             "max_tokens": 5})
        return response.status_code

    async def two_streams() -> list[int]:
        await presence.beat()
        first = await stream()  # each setting read once
        monkeypatch.setattr(LazySettings, "__getattribute__", counted)
        return [first, await stream()]

    assert asyncio.run(asyncio.wait_for(two_streams(), 60)) == [200, 200]
    assert read == []


def test_a_responses_stream_whose_engine_computes_nothing_after_its_lifecycle_events_ends_soon_unbilled_and_released(
        tenant, scripted_responses_engine, tmp_path, web_zygote):
    # vLLM writes `response.created` and `response.in_progress` as it takes the request, before the prefill: the bound
    # is on the first event from the engine's output. Before, those two counted as the first event, and a hung engine
    # held the stream, its reservation and a place in its caller's concurrency for the whole read timeout (600 s).
    endpoint = serve_endpoint(tenant.org, scripted_responses_engine)
    Replica.objects.filter(endpoint=endpoint).update(tokens_per_s=0.0)  # its agent's last report: generating nothing
    child, gateway = _gateway(tmp_path, web_zygote)
    try:
        events, seconds = _responses_stream(gateway, tenant.key, endpoint.name, prefill_ms=60_000)
        wait_until(lambda: not get_redis().hlen(reservations_key(tenant.org.pk)), 10, message="the reservation settled")
    finally:
        child.stop()

    names = [event.split(b"\n", 1)[0] for event in events]
    assert names == [b"event: response.created", b"event: response.in_progress", b"event: error"], events
    error = json.loads(events[-1].split(b"data: ", 1)[1])
    assert (error["code"], error["sequence_number"]) == ("upstream_timeout", 2), error
    assert seconds < 10 * FIRST_EVENT_TIMEOUT_S
    row = UsageRecord.objects.get()
    assert (row.status, row.prompt_tokens, row.completion_tokens, row.cost) == ("upstream_error", 0, 0, 0)


def test_a_responses_stream_whose_engine_generates_is_waited_for_past_the_first_event_bound_and_billed(
        tenant, scripted_responses_engine, tmp_path, web_zygote):
    endpoint = serve_endpoint(tenant.org, scripted_responses_engine)
    Replica.objects.filter(endpoint=endpoint).update(tokens_per_s=50.0)  # its agent's last report: generating
    child, gateway = _gateway(tmp_path, web_zygote)
    try:
        events, _ = _responses_stream(gateway, tenant.key, endpoint.name, prefill_ms=3000)
    finally:
        child.stop()

    assert events[-1].startswith(b"event: response.completed"), events[-1][:200]
    row = UsageRecord.objects.get()
    assert row.status == "ok" and row.completion_tokens == responses_engine.NUM_DELTAS and row.cost > 0


def test_a_responses_stream_silent_after_its_engines_first_output_is_bounded_by_the_read_timeout_alone(
        tenant, scripted_responses_engine, tmp_path, web_zygote):
    # Its first output ends the first event's bound (`upstream.Response.first_event_came`), as a chat stream's first
    # event does: a silence after it is the read timeout's (600 s). Untold, the stream stayed under the first event's
    # bound to its end, and a silence mid-stream longer than it, its engine's agent reporting nothing generated, was
    # cut, the output still to come thrown away; no test said so.
    endpoint = serve_endpoint(tenant.org, scripted_responses_engine)
    Replica.objects.filter(endpoint=endpoint).update(tokens_per_s=0.0)  # its agent's last report: generating nothing
    child, gateway = _gateway(tmp_path, web_zygote)
    try:
        events, seconds = _responses_stream(gateway, tenant.key, endpoint.name, prefill_ms=0,
                                            pause_ms=int(3000 * FIRST_EVENT_TIMEOUT_S))
    finally:
        child.stop()

    assert events[-1].startswith(b"event: response.completed"), events[-1][:200]
    assert seconds > 3 * FIRST_EVENT_TIMEOUT_S
    row = UsageRecord.objects.get()
    assert row.status == "ok" and row.completion_tokens == responses_engine.NUM_DELTAS and row.cost > 0


def test_a_streams_first_event_bound_grows_with_its_prompts_bound_and_stops_at_the_read_timeout(settings):
    # The prompt's share is what lets a long prompt's prefill finish; its cap is what still cuts a hung engine before
    # the read timeout's own wait (a completions call's bound sums its prompts: 2,048 of a whole context each).
    settings.GATEWAY_STREAM_FIRST_EVENT_TIMEOUT_S = 120.0
    settings.GATEWAY_STREAM_PREFILL_TOKENS_PER_S = 200.0

    def bound_s(num_prompt_tokens_bound, read_timeout_s=600.0) -> float:
        call = SimpleNamespace(num_prompt_tokens_bound=num_prompt_tokens_bound,
                               client=SimpleNamespace(read_timeout_s=read_timeout_s))
        return InferenceCall._first_event_timeout_s(call)

    assert bound_s(None) == 120.0
    assert bound_s(2000) == 130.0
    assert bound_s(2048 * 131072) == 600.0
    assert bound_s(2000, read_timeout_s=60.0) == 120.0  # a read timeout set under it leaves the first event's own


def test_a_stream_whose_long_prompt_its_engine_prefills_past_the_first_event_bound_is_waited_for_and_billed(
        tenant, start_mock_upstream, tmp_path, web_zygote):
    # Its engine busy with this prompt alone generates nothing until its first token (`tokens_per_s` 0 in its agent's
    # report), so the engine's check could not tell it from a hung one: before, the stream was cut at the first
    # event's bound, the engine's prefill thrown away, however long its prompt.
    upstream = start_mock_upstream(prefill_ms=3000)  # three bounds' prefill, within the prompt's share (5 s)
    endpoint = _serve_long_prompts(tenant.org, upstream)
    child, gateway = _gateway(tmp_path, web_zygote)
    try:
        status, events, _ = _stream(gateway, tenant.key, endpoint.name, LONG_MESSAGES)
    finally:
        child.stop()

    assert status == 200 and not any("error" in event for event in events), events
    row = UsageRecord.objects.get()
    assert (row.status, row.completion_tokens) == ("ok", 5) and row.cost > 0


def test_a_stream_whose_long_prompt_its_engine_computes_nothing_for_is_still_cut_once_its_prefill_was_allowed(
        tenant, start_mock_upstream, tmp_path, web_zygote):
    silent = start_mock_upstream(prefill_ms=60_000)
    endpoint = _serve_long_prompts(tenant.org, silent)
    child, gateway = _gateway(tmp_path, web_zygote)
    try:
        status, events, seconds = _stream(gateway, tenant.key, endpoint.name, LONG_MESSAGES)
        wait_until(lambda: not get_redis().hlen(reservations_key(tenant.org.pk)), 10, message="the reservation settled")
    finally:
        child.stop()

    assert status == 200 and len(events) == 1 and events[0]["error"]["code"] == "upstream_timeout", events
    assert 5 < seconds < 20  # its bound and its prompt's share (~6 s), then the engine's check: not generating
    row = UsageRecord.objects.get()
    assert (row.status, row.cost) == ("upstream_error", 0)


def test_a_responses_stream_left_before_its_engines_first_output_is_released_once_its_bound_passes(
        tenant, scripted_responses_engine, tmp_path, web_zygote):
    # A stream left before its first output reads on to it, for its prompt's bill: its bound is that wait's too. Before,
    # a Responses stream read on to a hung engine's read timeout (600 s), holding its reservation meanwhile.
    endpoint = serve_endpoint(tenant.org, scripted_responses_engine)
    Replica.objects.filter(endpoint=endpoint).update(tokens_per_s=0.0)
    child, gateway = _gateway(tmp_path, web_zygote)
    try:
        with httpx.stream("POST", f"{gateway}/v1/responses", headers={"Authorization": f"Bearer {tenant.key}"},
                          json={"model": endpoint.name, "input": "hi", "stream": True, "max_output_tokens": 100,
                                "metadata": {"scenario": "ok", "prefill_ms": "60000"}}, timeout=20) as response:
            assert next(response.iter_bytes()).startswith(b"event: response.created")
        left = time.monotonic()
        wait_until(lambda: UsageRecord.objects.exists(), 15, message="the usage row")
        waited_s = time.monotonic() - left
        wait_until(lambda: not get_redis().hlen(reservations_key(tenant.org.pk)), 10, message="the reservation settled")
    finally:
        child.stop()

    assert waited_s < 10 * FIRST_EVENT_TIMEOUT_S
    row = UsageRecord.objects.get()
    assert (row.status, row.prompt_tokens, row.completion_tokens, row.cost) == ("upstream_error", 0, 0, 0)
