"""A stream's first event, from a replica whose engine took the request and sends nothing for it (wedged, or busy on
CPU with something else, which its agent spares on purpose): waited for `GATEWAY_STREAM_FIRST_EVENT_TIMEOUT_S` of
silence, then only while the engine generates (its agent's last report), as a non-streamed answer past the read timeout
is. Before, the call, its reservation and its client waited out the whole read timeout (600 s), as long as the OpenAI
clients' own timeout, which they follow with a try of their own."""

import asyncio
import json
import time

import httpx
import pytest
from django.conf import LazySettings

from billing.models import UsageRecord
from controlplane.asgi import application
from controlplane.redis_client import get_redis
from controlplane.redis_keys import reservations_key
from endpoints.gateway import presence
from endpoints.models import Replica
from tests.conftest import start_web_server, wait_until
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "Hello"}]
FIRST_EVENT_TIMEOUT_S = 1.0


def _gateway(tmp_path, web_zygote):
    """A gateway waiting 1 s of silence for a stream's first event (production: 120 s); its read timeout the
    production one (600 s)."""
    return start_web_server(tmp_path, name="gateway", zygote=web_zygote, extra_env={
        "INFERPLANE_GATEWAY_STREAM_FIRST_EVENT_TIMEOUT_S": str(FIRST_EVENT_TIMEOUT_S)})


def _stream(gateway: str, key: str, model: str) -> tuple[int, list[dict], float]:
    """The stream's status, its events and how long it took; the client waits 20 s at most between bytes."""
    started = time.monotonic()
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "messages": MESSAGES, "stream": True, "max_tokens": 5}, timeout=20) as response:
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
