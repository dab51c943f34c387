"""A `/v1/responses` stream whose end is not the usual one, against a scripted engine (`tests.fakes.responses_engine`):
its usage comes only in its last event, so a stream that never gets there is billed a floor, and one large event
before it must not keep it from getting there.

- An event past `sse.MAX_EVENT_BYTES` that is not the last (vLLM's `response.content_part.done` with every token's
  logprobs) is dropped, unrelayed, and the stream goes on to its last event, billed from there; vLLM's last event then
  carries the same logprobs, so it too passes the cap: the stream ends with the error event, billed from its usage.
- A stream cut before its last event (an engine's `event: error`, a replica lost, the drain's bound) is billed its delta
  events (one an engine step) as output tokens and its prompt as an engine of its endpoint renders it
  (`endpoints.gateway.rendered_prompt`), as an `upstream_error` row. Before, its prompt was free: a 30k-token prompt
  cut after its first delta cost nothing of it. With no engine left to ask (its only replica lost), and for a lost
  gateway (`gateway_lost`, by the sweeper), its deltas alone, as before; before the engine's first output (an event
  other than `response.created` and `response.in_progress`), no prompt (it may not have been prefilled).
- A client that leaves (or stops reading) is read on to the last event and billed the engine's usage.
"""

from __future__ import annotations

import signal
import sys
import threading
from decimal import Decimal

import httpx
import pytest

from billing.models import UsageRecord
from billing.quota.sweeper import sweep_expired_reservations
from tests.conftest import ChildProcess, child_env, free_port, start_web_server, wait_until
from tests.fakes import responses_engine
from tests.gateway.conftest import serve_endpoint, wait_until_healthy

pytestmark = [pytest.mark.django_db(transaction=True)]

PRICES = {
    "price_input_per_million": Decimal("100"),
    "price_cached_input_per_million": Decimal("10"),
    "price_output_per_million": Decimal("300"),
}
DELTA = b"event: response.output_text.delta\n"


def _start_engine(tmp_path, name: str) -> tuple[ChildProcess, str]:
    port = free_port()
    child = ChildProcess(
        [sys.executable, "-m", "tests.fakes.responses_engine", "--port", str(port)],
        child_env(),
        tmp_path / f"{name}.log",
    )
    address = f"http://127.0.0.1:{port}"
    wait_until_healthy(address, "the scripted engine")
    return child, address


@pytest.fixture
def engine(tmp_path):
    child, address = _start_engine(tmp_path, "responses-engine")
    yield address
    child.kill()  # a test double: nothing to finish (`start_mock_upstream`)
    child.stop()


@pytest.fixture
def second_engine(tmp_path):
    child, address = _start_engine(tmp_path, "second-engine")
    yield address
    child.kill()  # a test double: nothing to finish (`start_mock_upstream`)
    child.stop()


def _num_renders(address: str) -> int:
    try:
        return int(httpx.get(f"{address}/renders", timeout=5).text)
    except httpx.HTTPError:  # a replica that died
        return 0


def _body(endpoint, scenario: str) -> dict:
    return {
        "model": endpoint.name,
        "input": "hi",
        "stream": True,
        "max_output_tokens": 1000,
        "metadata": {"scenario": scenario},
    }


def _open(gateway: str, key: str, body: dict):
    return httpx.stream(
        "POST", f"{gateway}/v1/responses", headers={"authorization": f"Bearer {key}"}, json=body, timeout=60
    )


def _stream(gateway: str, key: str, body: dict) -> tuple[str, bytes]:
    received = b""
    with _open(gateway, key, body) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        for chunk in response.iter_bytes():
            received += chunk
    return request_id, received


def _row(request_id: str) -> UsageRecord:
    return wait_until(
        lambda: UsageRecord.objects.filter(request_id=request_id).first(), 30, message="the usage row"
    )


def test_a_complete_stream_is_billed_from_its_last_event(gateway, tenant, engine):
    endpoint = serve_endpoint(tenant.org, engine, **PRICES)
    request_id, received = _stream(gateway, tenant.key, _body(endpoint, "ok"))
    row = _row(request_id)
    assert received.count(DELTA) == responses_engine.NUM_DELTAS
    assert (row.status, row.prompt_tokens, row.completion_tokens) == ("ok", 7, responses_engine.NUM_DELTAS)


def test_a_large_event_before_the_last_is_dropped_and_the_stream_billed_from_its_last_event(
    gateway, tenant, engine
):
    # Before, the large `response.content_part.done` ended the stream with an error saying its tokens were billed, and
    # the row was `upstream_error` with 0 tokens: its usage comes only in `response.completed`, never read.
    endpoint = serve_endpoint(tenant.org, engine, **PRICES)
    request_id, received = _stream(gateway, tenant.key, _body(endpoint, "large_part"))
    assert received.count(DELTA) == responses_engine.NUM_DELTAS
    assert b"event: response.content_part.done" not in received  # dropped, unrelayed
    assert b"event: response.output_item.done" in received  # what came after it is relayed
    assert b"event: response.completed" in received
    assert b"billed" not in received
    row = _row(request_id)
    assert (row.status, row.prompt_tokens, row.completion_tokens) == ("ok", 7, responses_engine.NUM_DELTAS)
    assert row.cost > 0


@pytest.mark.parametrize("split", [3, 12, 40])
def test_a_last_event_too_large_to_relay_is_billed_from_its_usage_wherever_a_read_splits_its_name(
    gateway, tenant, engine, split
):
    # vLLM's `response.completed` carries every token's logprobs too: past the cap when `content_part.done` is. Before,
    # with the read boundary 12 bytes into it (`event: respo`), it was taken for another event, dropped unrelayed and
    # its usage unread: an `upstream_error` row of 0 prompt tokens, and the client's stream stopped with no event.
    endpoint = serve_endpoint(tenant.org, engine, **PRICES)
    request_id, received = _stream(
        gateway,
        tenant.key,
        _body(endpoint, "large_last") | {"metadata": {"scenario": "large_last", "split": str(split)}},
    )
    assert received.count(DELTA) == responses_engine.NUM_DELTAS
    assert b"event: response.content_part.done" not in received
    assert b"response_too_large" in received
    row = _row(request_id)
    assert (row.prompt_tokens, row.completion_tokens) == (7, responses_engine.NUM_DELTAS)


def test_a_stream_its_engine_ends_with_an_error_is_billed_its_rendered_prompt_and_its_deltas_once(
    gateway, tenant, engine
):
    # Before: an `upstream_error` row of 0 prompt tokens and the 50 deltas (and, before that, an `ok` row of 0 tokens).
    endpoint = serve_endpoint(tenant.org, engine, **PRICES)
    request_id, received = _stream(gateway, tenant.key, _body(endpoint, "error"))
    assert received.count(DELTA) == responses_engine.NUM_DELTAS
    row = _row(request_id)
    assert (row.status, row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (
        "upstream_error",
        responses_engine.USAGE["input_tokens"],
        0,
        responses_engine.NUM_DELTAS,
    )
    # The prompt at the input price, the deltas at the output price, billed once.
    assert row.cost == Decimal(7 * 100 + responses_engine.NUM_DELTAS * 300) / 1_000_000
    assert UsageRecord.objects.filter(request_id=request_id).count() == 1
    assert _num_renders(engine) == 1


def test_a_stream_whose_replica_dies_is_billed_its_prompt_as_another_replica_renders_it(
    gateway, tenant, engine, second_engine
):
    # Before: an `upstream_error` row of 0 prompt tokens: the prompt was free.
    endpoint = serve_endpoint(tenant.org, engine, second_engine, **PRICES)
    request_id, received = _stream(gateway, tenant.key, _body(endpoint, "dies"))
    assert received.count(DELTA) == responses_engine.NUM_DELTAS
    row = _row(request_id)
    assert (row.status, row.prompt_tokens, row.completion_tokens) == (
        "upstream_error",
        responses_engine.USAGE["input_tokens"],
        responses_engine.NUM_DELTAS,
    )
    assert _num_renders(engine) + _num_renders(second_engine) == 1  # the survivor's; the dead one never asked


def test_a_stream_longer_than_a_held_replica_list_is_trusted_is_billed_its_prompt_as_another_replica_renders_it(
    gateway, tenant, engine, second_engine
):
    # The count asks only replicas the gateway holds, trusted 5.5 s after their load. Before, a stream running longer
    # (~7.5 s here, no other call to its endpoint) found none held when its replica died: 0 prompt tokens, none asked.
    endpoint = serve_endpoint(tenant.org, engine, second_engine, **PRICES)
    request_id, received = _stream(gateway, tenant.key, _body(endpoint, "slow_dies"))
    assert received.count(DELTA) == responses_engine.NUM_SLOW_DIES_DELTAS
    row = _row(request_id)
    assert (row.status, row.prompt_tokens, row.completion_tokens) == (
        "upstream_error",
        responses_engine.USAGE["input_tokens"],
        responses_engine.NUM_SLOW_DIES_DELTAS,
    )
    assert UsageRecord.objects.filter(request_id=request_id).count() == 1
    assert _num_renders(engine) + _num_renders(second_engine) == 1


def test_a_stream_whose_only_replica_dies_is_billed_its_deltas_alone(gateway, tenant, engine):
    # No engine is left to count its prompt: the deltas' floor, as before; never the reservation's prompt estimate, an
    # upper bound that would overcharge (passes before and after: the documented behaviour, pinned).
    endpoint = serve_endpoint(tenant.org, engine, **PRICES)
    request_id, received = _stream(gateway, tenant.key, _body(endpoint, "dies"))
    assert received.count(DELTA) == responses_engine.NUM_DELTAS
    row = _row(request_id)
    assert (row.status, row.prompt_tokens, row.completion_tokens) == (
        "upstream_error",
        0,
        responses_engine.NUM_DELTAS,
    )
    assert row.cost == Decimal(responses_engine.NUM_DELTAS * 300) / 1_000_000


def test_a_cut_stream_whose_engine_never_answers_its_render_is_billed_its_deltas_alone_without_hanging(
    gateway, tenant, engine
):
    # Waited for up to `rendered_prompt.RENDER_TIMEOUT_S`, after the client's stream ended: the row is still written.
    endpoint = serve_endpoint(tenant.org, engine, **PRICES)
    request_id, received = _stream(gateway, tenant.key, _body(endpoint, "render_hangs"))
    assert received.count(DELTA) == responses_engine.NUM_DELTAS
    row = _row(request_id)
    assert (row.status, row.prompt_tokens, row.completion_tokens) == (
        "upstream_error",
        0,
        responses_engine.NUM_DELTAS,
    )
    assert _num_renders(engine) == 1


def test_a_stream_whose_engine_fails_before_its_first_output_is_billed_no_prompt(gateway, tenant, engine):
    # Only what vLLM writes as a stream starts (`response.created`, `response.in_progress`), no output: its prompt may
    # not have been prefilled whole, so none of it is billed, and no engine is asked (passes before and after).
    endpoint = serve_endpoint(tenant.org, engine, **PRICES)
    request_id, received = _stream(gateway, tenant.key, _body(endpoint, "error_first"))
    assert DELTA not in received
    row = _row(request_id)
    assert (row.status, row.prompt_tokens, row.completion_tokens) == ("upstream_error", 0, 0)
    assert _num_renders(engine) == 0


def test_a_stream_cut_after_its_engines_first_output_but_before_any_delta_is_billed_its_rendered_prompt(
    gateway, tenant, engine
):
    # vLLM announces a function call (`response.output_item.added`) once its parser has the name, before its arguments'
    # first delta: the engine had output, so its prompt was prefilled whole. Before: an `upstream_error` row of 0 prompt
    # tokens, no engine asked.
    endpoint = serve_endpoint(tenant.org, engine, **PRICES)
    request_id, received = _stream(gateway, tenant.key, _body(endpoint, "error_after_call"))
    assert b"event: response.output_item.added" in received and DELTA not in received
    row = _row(request_id)
    assert (row.status, row.prompt_tokens, row.completion_tokens) == (
        "upstream_error",
        responses_engine.USAGE["input_tokens"],
        0,
    )
    assert row.cost == Decimal(7 * 100) / 1_000_000
    assert UsageRecord.objects.filter(request_id=request_id).count() == 1
    assert _num_renders(engine) == 1


def test_a_stream_whose_client_leaves_after_its_first_delta_is_read_on_and_billed_the_engines_usage(
    gateway, tenant, engine
):
    # As before: the gateway reads on to `response.completed`, relaying nothing, and bills its usage.
    # NOTE: `paced` (2.5 s), not `slow` (15 s): the client leaves at its first delta, the rest is the reading on.
    endpoint = serve_endpoint(tenant.org, engine, **PRICES)
    with _open(gateway, tenant.key, _body(endpoint, "paced")) as response:
        request_id = response.headers["x-request-id"]
        for chunk in response.iter_bytes():
            if DELTA in chunk:
                break
    row = wait_until(
        lambda: UsageRecord.objects.filter(request_id=request_id).first(), 60, message="the usage row"
    )
    assert (row.status, row.prompt_tokens, row.completion_tokens) == (
        "client_aborted",
        responses_engine.USAGE["input_tokens"],
        responses_engine.USAGE["output_tokens"],
    )
    assert _num_renders(engine) == 0


def test_a_stream_still_running_at_the_drains_bound_is_billed_its_rendered_prompt_and_the_deltas_it_read(
    tenant, engine, tmp_path
):
    # Before: an `upstream_error` row of 0 prompt tokens (and, before that, an `ok` row of 0 tokens).
    endpoint = serve_endpoint(tenant.org, engine, **PRICES)
    child, gateway = start_web_server(
        tmp_path,
        name="gateway",
        server_args=("--timeout-graceful-shutdown", "1"),
        extra_env={"INFERPLANE_GATEWAY_DRAIN_S": "1"},
    )
    seen, got = threading.Event(), {"bytes": b""}

    def read() -> None:
        try:
            with _open(gateway, tenant.key, _body(endpoint, "slow")) as response:
                got["request_id"] = response.headers["x-request-id"]
                for chunk in response.iter_bytes():
                    got["bytes"] += chunk
                    if got["bytes"].count(DELTA) >= 40:
                        seen.set()
        except httpx.HTTPError:
            pass
        seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.wait(30)
        child.kill(signal.SIGTERM)
        reader.join(30)
        child.process.wait(30)
    finally:
        child.stop()
    received = got["bytes"].count(DELTA)
    assert 40 <= received < responses_engine.NUM_SLOW_DELTAS
    assert b"server_stopping" in got["bytes"]
    row = _row(got["request_id"])
    assert (row.status, row.prompt_tokens) == ("upstream_error", responses_engine.USAGE["input_tokens"])
    # What it relayed, and at most what it had read but not yet relayed when it was stopped.
    assert received <= row.completion_tokens < responses_engine.NUM_SLOW_DELTAS


def test_a_gateway_lost_mid_stream_has_the_deltas_it_relayed_billed_by_the_sweeper(tenant, engine, tmp_path,
                                                                                    web_zygote):
    # Before: its calls' progress had no tokens (a Responses stream's usage comes only in its last event), so the
    # sweeper released its hold and billed nothing. Its prompt is still free: no process is left to ask its count.
    endpoint = serve_endpoint(tenant.org, engine, **PRICES)
    child, gateway = start_web_server(
        tmp_path, name="gateway", extra_env={"INFERPLANE_RESERVATION_TTL_S": "3"}, zygote=web_zygote
    )
    received = b""
    try:
        with _open(gateway, tenant.key, _body(endpoint, "slow")) as response:
            request_id = response.headers["x-request-id"]
            for chunk in response.iter_bytes():
                received += chunk
                if received.count(DELTA) >= 100:  # ~5 s in: some five beats
                    child.kill()
                    break
    finally:
        child.stop()
    wait_until(lambda: sweep_expired_reservations() == 1, 15, interval_s=0.5, message="the lapsed hold swept")
    row = UsageRecord.objects.get()
    assert (row.request_id, row.status, row.prompt_tokens) == (request_id, "gateway_lost", 0)
    # Less what came after its last beat (a beat: 20 deltas; three allowed for a loaded machine).
    assert received.count(DELTA) - 60 <= row.completion_tokens <= received.count(DELTA) + 10
    assert row.cost > 0
