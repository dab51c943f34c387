"""Faults between client, gateway and replica: nothing lost, nothing counted twice."""

import asyncio
import contextlib
import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import httpx
import pytest

from billing.models import UsageRecord
from billing.quota.sweeper import sweep_expired_reservations
from controlplane.redis_client import get_redis
from controlplane.redis_keys import reservations_key
from endpoints.gateway.estimate import worst_case
from endpoints.models import Endpoint, Replica
from tests.conftest import free_port, start_web_server, wait_until
from tests.gateway.conftest import serve_endpoint
from tests.outages import redis_out_of_memory

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "Hello"}]


def _stream_request(gateway, key, model, **extra):
    return httpx.stream("POST", f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                        json={"model": model, "messages": MESSAGES, "stream": True} | extra, timeout=30)


def test_a_client_that_disconnects_mid_stream_leaves_one_aborted_row_with_the_tokens_it_received(gateway, tenant, start_mock_upstream):
    upstream = start_mock_upstream(token_delay_ms=40)
    endpoint = serve_endpoint(tenant.org, upstream)
    received = 0
    with _stream_request(gateway, tenant.key, endpoint.name, max_tokens=100) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                received += 1
            if received == 5:
                break
    row = wait_until(lambda: UsageRecord.objects.first(), 15, message="the usage row")
    assert row.status == "client_aborted"
    # Billed only for what was sent before the disconnect was noticed, never the full 100.
    assert received <= row.completion_tokens <= received + 3
    assert row.prompt_tokens == 7
    assert UsageRecord.objects.count() == 1
    # The engine saw its client (the gateway) leave: the connection closed, the request aborted, not run to its end.
    wait_until(lambda: httpx.get(f"{upstream}/_stats").json()["num_streams_left"] == 1, 10, message="the engine's abort")


def test_a_client_that_leaves_a_non_streamed_call_is_billed_for_the_answer_the_engine_computed(
        gateway, tenant, start_mock_upstream):
    # A non-streamed answer's usage comes only with the whole answer. A client that left before it came had the
    # engine's request aborted and was billed nothing: any prompt prefilled, most of an answer generated, free.
    upstream = start_mock_upstream(token_delay_ms=20)
    endpoint = serve_endpoint(tenant.org, upstream)
    with pytest.raises(httpx.ReadTimeout):  # leaves 1.5 s into a ~3 s answer
        httpx.post(f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {tenant.key}"},
                   json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 150},
                   timeout=httpx.Timeout(30, read=1.5))

    row = wait_until(lambda: UsageRecord.objects.first(), 30, message="the usage row")
    assert row.status == "client_aborted"
    assert (row.prompt_tokens, row.completion_tokens) == (7, 150) and row.cost > 0
    assert UsageRecord.objects.count() == 1
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 1  # read to its end, never sent again
    wait_until(lambda: not get_redis().hlen(reservations_key(tenant.org.pk)), 10, message="the reservation settled")


def test_a_stream_left_during_its_prefill_is_billed_for_its_prompt_and_stopped_at_its_first_event(
        gateway, tenant, start_mock_upstream):
    # A stream's first event comes once the engine has prefilled its prompt. A client that left before it had the
    # engine's request aborted and was billed nothing: a long prompt's prefill, again and again, for free.
    upstream = start_mock_upstream(token_delay_ms=40, prefill_ms=1500)
    endpoint = serve_endpoint(tenant.org, upstream)
    with _stream_request(gateway, tenant.key, endpoint.name, max_tokens=100) as response:
        assert response.status_code == 200
        time.sleep(0.5)  # leaves during the prefill, before any event

    row = wait_until(lambda: UsageRecord.objects.first(), 15, message="the usage row")
    assert row.status == "client_aborted"
    assert row.prompt_tokens == 7 and row.completion_tokens <= 1 and row.cost > 0
    assert UsageRecord.objects.count() == 1
    # Stopped at that first event: the engine's request aborted, never run to its end.
    wait_until(lambda: httpx.get(f"{upstream}/_stats").json()["num_streams_left"] == 1, 10, message="the engine's abort")
    wait_until(lambda: not get_redis().hlen(reservations_key(tenant.org.pk)), 10, message="the reservation settled")


def test_a_stream_left_during_its_prefill_whose_first_event_passes_its_reservation_is_cut_off_there(
        gateway, tenant, start_mock_upstream):
    # The engine counts far more prompt than the estimate allowed (a template's own text): the first event spends
    # the reservation. Billed the reservation as a stream cut off there (and counted as usage past its reservation: a
    # prompt past the estimate is the estimate's failure, `test_spend_caps.py`).
    upstream = start_mock_upstream(token_delay_ms=40, prefill_ms=1500, prompt_tokens=5000)
    endpoint = serve_endpoint(tenant.org, upstream)
    with _stream_request(gateway, tenant.key, endpoint.name, max_tokens=100) as response:
        assert response.status_code == 200
        time.sleep(0.5)

    row = wait_until(lambda: UsageRecord.objects.first(), 15, message="the usage row")
    reserved = worst_case({"messages": MESSAGES, "max_tokens": 100}, "chat", endpoint.max_model_len).max_cost(endpoint)
    assert row.status == "cut_off" and row.prompt_tokens == 5000 and row.cost == reserved
    wait_until(lambda: httpx.get(f"{upstream}/_stats").json()["num_streams_left"] == 1, 10, message="the engine's abort")


def test_a_non_streamed_answer_past_the_size_limit_is_refused_and_billed_for_what_the_engine_computed(
        gateway, tenant, start_mock_upstream):
    # Dropped at the limit, such an answer (n: 16 with logprobs, say) was billed nothing: up to n × max_tokens
    # generated free. It is read to its end, not held, for its usage.
    upstream = start_mock_upstream(whole_answer_bytes=65 * 2**20)
    endpoint = serve_endpoint(tenant.org, upstream)
    response = httpx.post(f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {tenant.key}"},
                          json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 5}, timeout=60)

    assert response.status_code == 400 and response.json()["error"]["code"] == "response_too_large"
    row = wait_until(lambda: UsageRecord.objects.first(), 15, message="the usage row")
    assert (row.prompt_tokens, row.completion_tokens) == (7, 5) and row.cost > 0
    assert "billed" in response.json()["error"]["message"]
    assert UsageRecord.objects.count() == 1
    wait_until(lambda: not get_redis().hlen(reservations_key(tenant.org.pk)), 10, message="the reservation settled")


def _slow_gateway(tmp_path, web_zygote, **env):
    """A gateway giving up on a silent replica after 1 s (production: 600 s)."""
    return start_web_server(tmp_path, name="gateway", extra_env={"INFERPLANE_GATEWAY_UPSTREAM_READ_TIMEOUT_S": "1"} | env,
                            zygote=web_zygote)


def test_a_non_streamed_answer_longer_than_the_read_timeout_is_waited_for_while_its_engine_generates_and_billed(
        tenant, start_mock_upstream, tmp_path, web_zygote):
    # A non-streamed answer comes whole when the engine is done. One asked to take longer than the read timeout
    # (a large max_tokens or n on a slow model) was given up on: its connection closed, the engine's request
    # aborted after all that generating, nothing billed, and the call sent again to another replica.
    upstream = start_mock_upstream(token_delay_ms=20)
    endpoint = serve_endpoint(tenant.org, upstream)
    Replica.objects.filter(endpoint=endpoint).update(tokens_per_s=50.0)  # its agent's last report: generating
    child, gateway = _slow_gateway(tmp_path, web_zygote)
    try:
        response = httpx.post(f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {tenant.key}"},
                              json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 100}, timeout=60)
    finally:
        child.stop()

    # NOTE: 100 tokens (150 before): 2 s of generating, twice the gateway's 1 s read timeout
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 100
    row = UsageRecord.objects.get()
    assert (row.status, row.completion_tokens) == ("ok", 100) and row.cost > 0
    assert httpx.get(f"{upstream}/_stats").json()["num_requests"] == 1


@pytest.mark.parametrize(("why", "status", "code"), [("engine stopped generating", 504, "upstream_timeout"),
                                                     ("longest wait passed", 400, "answer_wait_exceeded")])
def test_a_replica_silent_past_the_read_timeout_is_refused_and_the_call_is_never_sent_again(
        tenant, start_mock_upstream, tmp_path, web_zygote, why, status, code):
    # Given up on, a call is never sent to another replica: the first has it (and may be computing it).
    first, second = start_mock_upstream(token_delay_ms=20), start_mock_upstream(token_delay_ms=20)
    endpoint = serve_endpoint(tenant.org, first, second)
    env = {}
    if why == "longest wait passed":
        Replica.objects.filter(endpoint=endpoint).update(tokens_per_s=50.0)
        env = {"INFERPLANE_GATEWAY_MAX_ANSWER_WAIT_S": "1"}
    child, gateway = _slow_gateway(tmp_path, web_zygote, **env)
    try:
        response = httpx.post(f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {tenant.key}"},
                              json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 150}, timeout=60)
        assert response.status_code == status, response.text
        assert response.json()["error"]["code"] == code
        wait_until(lambda: not get_redis().hlen(reservations_key(tenant.org.pk)), 10, message="the reservation settled")
    finally:
        child.stop()

    sent = [httpx.get(f"{address}/_stats").json()["num_requests"] for address in (first, second)]
    assert sorted(sent) == [0, 1]
    assert not UsageRecord.objects.exists()


def test_a_call_that_runs_past_its_reservation_deadline_keeps_its_hold_until_its_own_end(
        tenant, start_mock_upstream, tmp_path, web_zygote):
    # A reservation's deadline is how long a dead gateway's hold lasts. A live gateway's call that ran longer (a
    # long stream, a long non-streamed answer) had its hold released by the sweeper while it still ran: as much
    # again could be admitted against the same credit and caps.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(token_delay_ms=40))
    child, gateway = start_web_server(tmp_path, name="gateway", extra_env={"INFERPLANE_RESERVATION_TTL_S": "3"},
                                      zygote=web_zygote)
    received = 0
    try:
        # NOTE: 125 tokens (150 before): the call runs on 0.6 s after the look at 110, which takes a few milliseconds
        with _stream_request(gateway, tenant.key, endpoint.name, max_tokens=125) as response:  # ~5 s
            for line in response.iter_lines():
                received += line.startswith("data: {")
                if received == 110:  # ~4.4 s in, past the first deadline
                    assert sweep_expired_reservations() == 0
                    assert get_redis().hlen(reservations_key(tenant.org.pk)) == 1
    finally:
        child.stop()
    assert received >= 125
    row = UsageRecord.objects.get()
    assert (row.status, row.completion_tokens) == ("ok", 125)
    assert not get_redis().hlen(reservations_key(tenant.org.pk))  # settled by the call's own end


def test_a_replica_down_before_the_first_byte_is_retried_once_on_another(gateway, tenant, start_mock_upstream):
    dead = f"http://127.0.0.1:{free_port()}"
    endpoint = serve_endpoint(tenant.org, dead, start_mock_upstream())
    client = tenant.client(gateway)
    for _ in range(6):
        answer = client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=2)
        assert answer.usage.completion_tokens == 2
    wait_until(lambda: UsageRecord.objects.count() == 6, 10, message="six rows")
    assert set(UsageRecord.objects.values_list("status", flat=True)) == {"ok"}


def test_a_replica_restarted_on_a_new_port_is_reached_there_while_the_cache_still_names_the_old_one(
        gateway, tenant, start_mock_upstream):
    # An engine killed and restarted by its agent listens on a new port. The gateway's cached replica list
    # (reloaded in the background) still names the old address for a moment: the call that finds it dead
    # reloads the list and must try the same replica at its new address, not answer 502 "please retry".
    old = start_mock_upstream()
    endpoint = serve_endpoint(tenant.org, old)
    client = tenant.client(gateway)
    assert client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=2).usage.completion_tokens == 2
    new = start_mock_upstream()
    Replica.objects.filter(endpoint=endpoint).update(address=new)
    start_mock_upstream.stop(old)
    answer = client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=2)
    assert answer.usage.completion_tokens == 2
    rows = wait_until(lambda: list(UsageRecord.objects.all()) if UsageRecord.objects.count() == 2 else None, 10,
                      message="two rows")
    assert {row.status for row in rows} == {"ok"}


def test_a_replica_that_fails_mid_stream_ends_with_an_error_event_and_bills_what_was_sent(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(fail_after_chunks=3))
    events = []
    with _stream_request(gateway, tenant.key, endpoint.name, max_tokens=10) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert len([e for e in events if '"choices"' in e]) == 3
    assert json.loads(events[-1])["error"]["code"] == "upstream_error"
    row = wait_until(lambda: UsageRecord.objects.first(), 10, message="the usage row")
    assert (row.status, row.completion_tokens) == ("upstream_error", 3)


def test_no_replica_reachable_is_a_502_and_no_usage(gateway, tenant):
    endpoint = serve_endpoint(tenant.org, f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}")
    response = httpx.post(f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {tenant.key}"},
                          json={"model": endpoint.name, "messages": MESSAGES})
    assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_error"
    assert not UsageRecord.objects.exists()


def test_ledger_sums_equal_the_usage_clients_saw(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(), start_mock_upstream())
    client = tenant.client(gateway)
    seen_prompt = seen_completion = 0
    for max_tokens in range(1, 13):
        if max_tokens % 2:
            answer = client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=max_tokens)
            seen_prompt += answer.usage.prompt_tokens
            seen_completion += answer.usage.completion_tokens
        else:
            chunks = list(client.chat.completions.create(model=endpoint.name, messages=MESSAGES, max_tokens=max_tokens,
                                                         stream=True, stream_options={"include_usage": True}))
            seen_prompt += chunks[-1].usage.prompt_tokens
            seen_completion += chunks[-1].usage.completion_tokens
    wait_until(lambda: UsageRecord.objects.count() == 12, 10, message="12 rows")
    from django.db.models import Sum

    totals = UsageRecord.objects.aggregate(prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"))
    assert (totals["prompt"], totals["completion"]) == (seen_prompt, seen_completion)


def test_the_request_limit_is_exact_across_two_gateway_processes(gateway, tenant, start_mock_upstream, tmp_path,
                                                                 web_zygote):
    from controlplane.accounts.models import ApiKey

    ApiKey.objects.filter(pk=tenant.api_key.pk).update(requests_per_minute=5)
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    second, second_url = start_web_server(tmp_path, name="gateway-2", zygote=web_zygote)
    try:
        statuses, retry_after = [], None
        first_minute = int(time.time() // 60)
        for index in range(12):
            base = gateway if index % 2 else second_url
            response = httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {tenant.key}"},
                                  json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 1})
            statuses.append(response.status_code)
            if response.status_code == 429:
                retry_after = int(response.headers["retry-after"])
                assert response.json()["error"]["code"] == "rate_limit_exceeded"
        # The limit counts per clock minute: inside one minute exactly 5 pass; when the loop spans a boundary,
        # each side's minute allows 5, so 5 to 10 pass (as many as fit after the boundary), never more.
        passed = statuses.count(200)
        assert passed == 5 if int(time.time() // 60) == first_minute else 5 <= passed <= 10
        assert statuses.count(429) == 12 - passed
        assert retry_after is not None and 1 <= retry_after <= 61
    finally:
        second.stop()


def test_a_redis_out_of_memory_is_a_503_with_retry_after_and_the_next_call_is_served(gateway, tenant, start_mock_upstream):
    # `-OOM` (Redis at maxmemory with noeviction; `-MISCONF` after a failed save alike) was read as an
    # error in the call: a 500, and a finish that failed so left its request counted in flight.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    headers = {"Authorization": f"Bearer {tenant.key}"}
    body = {"model": endpoint.name, "messages": MESSAGES, "max_tokens": 2}
    assert httpx.post(f"{gateway}/v1/chat/completions", headers=headers, json=body, timeout=30).status_code == 200

    with redis_out_of_memory():
        refused = httpx.post(f"{gateway}/v1/chat/completions", headers=headers, json=body, timeout=30)

    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["type"] == "server_error" and "retry-after" in refused.headers
    assert httpx.post(f"{gateway}/v1/chat/completions", headers=headers, json=body, timeout=30).status_code == 200


def test_a_stream_cut_at_the_graceful_shutdown_deadline_is_billed_for_what_was_sent(tenant, start_mock_upstream, tmp_path):
    # A pod stopping in a rolling deploy stops the calls still streaming at the end of its drain. Their
    # finishes (usage row, settlement) then ran on a loop that was ending: the process exited without them,
    # the stream served and never billed, its reservation held until the sweeper.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(token_delay_ms=200))
    child, gateway = start_web_server(tmp_path, name="gateway", server_args=("--timeout-graceful-shutdown", "1"),
                                      extra_env={"INFERPLANE_GATEWAY_DRAIN_S": "1"})
    received, last = 0, ""
    try:
        with _stream_request(gateway, tenant.key, endpoint.name, max_tokens=100) as response:
            with contextlib.suppress(httpx.HTTPError):
                for line in response.iter_lines():
                    if line.startswith("data: {") and '"choices"' in line:
                        received += 1
                        if received == 3:
                            child.kill(signal.SIGTERM)
                    last = line or last
        child.process.wait(30)
    finally:
        child.stop()

    row = UsageRecord.objects.get()
    assert received <= row.completion_tokens < 100
    assert json.loads(last[6:])["error"]["code"] == "server_stopping"  # the stream says why it ended
    assert not get_redis().hlen(reservations_key(tenant.org.pk))  # settled, not left to the sweeper


def test_a_call_in_flight_when_its_endpoints_prices_change_is_billed_at_the_prices_it_was_admitted_at(
        gateway, tenant, start_mock_upstream):
    # Its row was priced by the endpoint's prices when it was written: a tenant moving its endpoint to a cheaper
    # GPU type (its prices follow) while long calls ran on the dearer replicas had them billed at the cheaper prices.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(token_delay_ms=40), gpu_type="h200")
    admitted_at = (endpoint.price_input_per_million, endpoint.price_output_per_million)
    with _stream_request(gateway, tenant.key, endpoint.name, max_tokens=50) as response:
        chunks = response.iter_bytes()
        next(chunks)  # under way
        Endpoint.objects.filter(pk=endpoint.pk).update(
            price_input_per_million=Decimal("0.01"), price_cached_input_per_million=Decimal("0.01"),
            price_output_per_million=Decimal("0.01"))
        for _ in chunks:
            pass
    row = wait_until(lambda: UsageRecord.objects.first(), 15, message="the usage row")
    assert row.status == "ok" and row.completion_tokens == 50
    assert row.cost == (Decimal(row.prompt_tokens) * admitted_at[0] + 50 * admitted_at[1]) / 10**6


def test_a_streamed_event_past_the_largest_the_gateway_relays_ends_the_stream_billed_and_one_below_it_is_relayed(
        gateway, tenant, start_mock_upstream):
    # An event is held whole until its end: the echo of a long prompt with each token's logprobs is ~80 MB, and it
    # was held (and joined piece by piece, seconds of the event loop) with no bound.
    large = serve_endpoint(tenant.org, start_mock_upstream(whole_answer_bytes=20 * 2**20))
    with _stream_request(gateway, tenant.key, large.name, max_tokens=1) as response:
        received = b"".join(response.iter_bytes())
    assert len(received) < 2**20 and b"data: [DONE]" not in received
    error = json.loads(received.split(b"data: ")[-1])["error"]
    assert error["code"] == "response_too_large" and "billed" in error["message"]
    row = wait_until(lambda: UsageRecord.objects.first(), 15, message="the usage row")
    assert (row.status, row.prompt_tokens, row.completion_tokens) == ("upstream_error", 7, 1) and row.cost > 0

    allowed = serve_endpoint(tenant.org, start_mock_upstream(whole_answer_bytes=6 * 2**20))
    with _stream_request(gateway, tenant.key, allowed.name, max_tokens=2) as response:
        events = [e for e in b"".join(response.iter_bytes()).split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and len(events) == 3  # two events of ~3 MiB, intact
    assert all(json.loads(e[6:])["choices"][0]["logprobs"]["content"] for e in events[:2])


def test_a_call_whose_counters_rebuild_keeps_beginning_again_gets_a_503_never_a_500(tenant, start_mock_upstream,
                                                                                   monkeypatch):
    # Its organisation's gateways hold calls again (after Redis lost them) faster than the counter's rebuild can read
    # the ledger: each try finds one held again since it read them, and begins again. Before, the admission rebuilt it
    # `MAX_REBUILDS` x `REBUILD_TRIES` times, then failed with a RuntimeError: a 500.
    from billing.periods import period_containing
    from billing.quota import counters, rebuild
    from controlplane.asgi import application

    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    build, held_again = rebuild._rebuild_from_database, []

    def hold_another_call_again() -> None:
        held_again.append(counters.Reservation(f"req_held_{len(held_again)}", tenant.org.pk, None, Decimal("0.01"),
                                               period_containing().key))
        assert asyncio.run(counters.restore_reservations(tenant.org.pk, held_again[-1:])) == 1

    def build_then_another_held_again(*args):
        rebuilt = build(*args)
        with ThreadPoolExecutor(max_workers=1) as pool:  # its own event loop: another gateway's beat
            pool.submit(hold_another_call_again).result(timeout=30)
        return rebuilt

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=application, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as http:
            return await http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {tenant.key}"},
                                   json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 5})

    monkeypatch.setattr(rebuild, "_rebuild_from_database", build_then_another_held_again)
    response = asyncio.run(asyncio.wait_for(call(), 120))

    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "service_unavailable"
    assert int(response.headers["retry-after"]) >= 1
    assert len(held_again) == rebuild.REBUILD_TRIES  # one rebuild's tries, not four admissions' worth

    monkeypatch.setattr(rebuild, "_rebuild_from_database", build)  # the beats have put every call back: its retry
    assert asyncio.run(asyncio.wait_for(call(), 120)).status_code == 200
    assert UsageRecord.objects.count() == 1


def test_an_organisation_whose_ledger_reads_slower_than_a_rebuild_may_take_gets_503s_then_its_calls(
        tenant, start_mock_upstream, monkeypatch):
    # Before, a counter rebuild slower than `REBUILD_MAX_S` never wrote its counter: each call rebuilt it four times,
    # each too slow, and answered a 500; every later call the same, for as long as the ledger took that long to read.
    from billing.quota import rebuild
    from controlplane.asgi import application

    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    monkeypatch.setattr(rebuild, "REBUILD_MAX_S", 1)
    read = rebuild.period_spend_and_pending

    def slow_read(*args, **kwargs):  # a large organisation's month of rows: longer than a rebuild's window
        time.sleep(2.5)
        return read(*args, **kwargs)

    monkeypatch.setattr(rebuild, "period_spend_and_pending", slow_read)

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=application, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as http:
            return await http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {tenant.key}"},
                                   json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 5})

    async def calls() -> list[httpx.Response]:
        # NOTE: one event loop for every call, as a gateway process has
        responses = []
        for _ in range(4):
            responses.append(await asyncio.wait_for(call(), 120))
            if responses[-1].status_code == 200:
                break
        return responses

    statuses = []
    for response in asyncio.run(calls()):
        statuses.append(response.status_code)
        if response.status_code == 200:
            break
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "service_unavailable"
        assert int(response.headers["retry-after"]) >= 1
    # The organisation's counter, then its key's: each written by the rebuild after the one that was too slow.
    assert statuses == [503, 503, 200]
    assert UsageRecord.objects.count() == 1
