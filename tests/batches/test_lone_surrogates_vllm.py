"""A lone surrogate (`"\\ud800"`, an escape JSON allows that is not text) anywhere in a `/v1` body is a 400 `invalid_value`
naming where it is, before a byte reaches the engine, interactive calls and batch lines alike (the package's real vLLM
CPU engine, the shared tiny chat model).

Before, the gateway passed it on: for one in a Responses call's `metadata` or `user`, vLLM generated the whole answer,
then failed to write the response that echoes them and answered 400 (not served: billed nothing, the tokens free); for
one in `stop` it answered 500 before generating, the gateway took its healthy replica for failed and a batch line was
tried again every second until the batch expired."""

from __future__ import annotations

import io
import json
from decimal import Decimal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from billing.models import UsageRecord
from controlplane import lone_surrogates
from endpoints.batches import services
from endpoints.batches.models import Batch, BatchStatus
from tests.conftest import wait_until
from tests.gateway.conftest import ENGINE_KEY, ENGINE_NAME, serve_endpoint

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

RESPONSES = "/v1/responses"
ASKED = {
    "model": ENGINE_NAME,
    "input": "Say hello.",
    "max_output_tokens": 16,
    "ignore_eos": True,
    "temperature": 0,
}


@pytest.fixture
def endpoint(tenant, vllm_engine):
    return serve_endpoint(
        tenant.org,
        vllm_engine,
        name=ENGINE_NAME,
        engine_key=ENGINE_KEY,
        target_concurrency=2,
        price_input_per_million=Decimal("100"),
        price_output_per_million=Decimal("300"),
    )


def _generated(engine: str) -> float:
    text = httpx.get(f"{engine}/metrics", headers={"Authorization": f"Bearer {ENGINE_KEY}"}, timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:generation_tokens_total"
    )


def _generated_since(engine: str, before: float, num_tokens: int) -> float:
    """What the engine generated since `before`, read once it has counted `num_tokens` at least (its counter is written
    as it steps, a moment after an answer)."""
    wait_until(
        lambda: _generated(engine) - before >= num_tokens,
        30,
        message=f"the engine to count {num_tokens} tokens",
    )
    return _generated(engine) - before


def _post(gateway: str, key: str, path: str, body: dict) -> httpx.Response:
    # NOTE: json.dumps writes a lone surrogate as its escape, as a client's JSON library does
    return httpx.post(
        f"{gateway}{path}",
        content=json.dumps(body),
        timeout=120,
        headers={"Authorization": f"Bearer {key}", "content-type": "application/json"},
    )


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (RESPONSES, ASKED | {"metadata": {"job": "\ud800"}}, "metadata.job"),
        (RESPONSES, ASKED | {"user": "a\udfffb"}, "user"),
        (RESPONSES, ASKED | {"stop": ["\ud800"]}, "stop[0]"),
        (
            "/v1/chat/completions",
            {
                "model": ENGINE_NAME,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 16,
                "stop": ["\ud800"],
            },
            "stop[0]",
        ),
    ],
    ids=["responses-metadata", "responses-user", "responses-stop", "chat-stop"],
)
def test_a_call_with_a_lone_surrogate_is_refused_naming_it_and_the_engine_generates_nothing(
    endpoint, vllm_engine, gateway, tenant, path, body, param
):
    generated_before = _generated(vllm_engine)

    response = _post(gateway, tenant.key, path, body)

    assert response.status_code == 400, response.text
    assert response.json() == {
        "error": {
            "message": response.json()["error"]["message"],
            "type": "invalid_request_error",
            "param": param,
            "code": "invalid_value",
        }
    }
    assert "lone surrogate" in response.json()["error"]["message"]
    # the same call without it is served and billed (the engine and its replica are fine), and is all it generated
    served = _post(
        gateway,
        tenant.key,
        path,
        {name: value for name, value in body.items() if name not in ("metadata", "user", "stop")}
        | {"ignore_eos": True},
    )
    assert served.status_code == 200, served.text
    assert _generated_since(vllm_engine, generated_before, 16) == 16
    row = wait_until(lambda: UsageRecord.objects.first(), 30, message="the usage row")
    assert row.request_id == served.headers["x-request-id"] and row.completion_tokens == 16
    assert UsageRecord.objects.count() == 1


def _rows(*bodies: dict) -> bytes:
    return b"".join(
        json.dumps({"custom_id": f"line-{index}", "method": "POST", "url": RESPONSES, "body": body}).encode()
        + b"\n"
        for index, body in enumerate(bodies)
    )


def _batch(client, data: bytes):
    input_file = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(input_file_id=input_file.id, endpoint=RESPONSES, completion_window="24h")


def test_a_batch_with_a_lone_surrogate_in_a_line_fails_its_check_naming_each_and_nothing_runs(
    endpoint, vllm_engine, gateway, tenant
):
    client = tenant.client(gateway, timeout=120)
    batch = _batch(
        client, _rows(ASKED, ASKED | {"metadata": {"job": "\udfff"}}, ASKED | {"user": "a\ud800b"})
    )
    generated_before = _generated(vllm_engine)

    services.run_batch(batch.id)

    batch = Batch.objects.get(pk=batch.id)
    assert batch.status == BatchStatus.FAILED, (batch.status, batch.num_completed, batch.num_failed)
    assert [(error["line"], error["code"], error["param"]) for error in batch.errors] == [
        (2, "invalid_value", "body.metadata.job"),
        (3, "invalid_value", "body.user"),
    ]
    assert _generated(vllm_engine) == generated_before
    assert not UsageRecord.objects.exists()


def test_a_line_checked_before_lone_surrogates_were_refused_fails_as_it_runs_and_only_the_others_are_generated(
    endpoint, vllm_engine, gateway, tenant, monkeypatch
):
    client = tenant.client(gateway, timeout=120)
    batch = _batch(client, _rows(ASKED, ASKED | {"metadata": {"job": "\ud800"}}))
    with monkeypatch.context() as before:  # a batch checked by a gateway that let lone surrogates through
        before.setattr(lone_surrogates, "lone_surrogate_at", lambda payload: None)
        services.validate_batch(Batch.objects.select_related("input_file").get(pk=batch.id))
    assert Batch.objects.get(pk=batch.id).status == BatchStatus.IN_PROGRESS
    generated_before = _generated(vllm_engine)

    services.run_batch(batch.id)

    batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (
        1,
        1,
    )
    [error_row] = map(json.loads, client.files.content(batch.error_file_id).read().splitlines())
    assert error_row["custom_id"] == "line-1" and error_row["response"]["status_code"] == 400
    assert error_row["response"]["body"]["error"]["param"] == "metadata.job"
    assert error_row["response"]["body"]["error"]["code"] == "invalid_value"
    # the good line's 16 tokens alone: the engine never saw the other
    assert _generated_since(vllm_engine, generated_before, 16) == 16
    [row] = UsageRecord.objects.filter(batch_id=batch.id)
    assert row.request_id == f"{batch.id}-0" and row.completion_tokens == ASKED["max_output_tokens"]
