"""A real vLLM engine whose tokenizer decomposes (NFD) and replaces (Llama's `Prepend("▁")`, `Replace(" ", "▁")`)
is reserved, and so billed, for every prompt token it counts.

The engine serves a copy of the tiny model with that normalizer put into its tokenizer.json (one engine for both,
forked by the test process's engine node, `tests.engines`, once for the module). Its agent's report of the model
(`model_info.read_model`, through `record_model_facts` as a heartbeat carries it) tells the gateway what the tokenizer
does; before, the bound counted Hangul already in NFC as its bytes and a space as one, and the bill stopped at it.
"""

from __future__ import annotations

from decimal import Decimal

import httpx
import pytest

from billing.ledger import cost_of
from billing.models import UsageRecord
from endpoints.fleet.services import record_model_facts
from endpoints.gateway.estimate import worst_case
from endpoints.gateway.normalizers import prompt_normalizer
from gpu_agent import protocol
from gpu_agent.runtime.model_info import read_model
from tests.conftest import wait_until
from tests.engines import serve_small_engine, tiny_model_copy
from tests.gateway.conftest import serve_endpoint

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

NAME = "tiny-nfd"
ENGINE_KEY = "key-of-the-normalizing-engine"
CONTEXT = 2048
NORMALIZER = {
    "type": "Sequence",
    "normalizers": [
        {"type": "NFD"},
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
    ],
}
# Composed Hangul (NFC already: 3 bytes a syllable, 6 as jamo) and spaces (1 byte, "▁" 3).
TEXTS = {"Hangul": "가나다라마바사아자차카타파하" * 10, "spaces": "a " * 300}
PRICES = {
    "price_input_per_million": Decimal("100"),
    "price_cached_input_per_million": Decimal("100"),
    "price_output_per_million": Decimal("300"),
}


@pytest.fixture(scope="module")
def normalizing_model_dir(tiny_model_dir, tmp_path_factory):
    return tiny_model_copy(tiny_model_dir, tmp_path_factory.mktemp("normalizing-model"),
                           {"tokenizer.json": {"normalizer": NORMALIZER}})


@pytest.fixture(scope="module")
def normalizing_engine(engine_node, normalizing_model_dir) -> str:
    with serve_small_engine(engine_node, NAME, normalizing_model_dir, ENGINE_KEY, CONTEXT) as address:
        yield address


def _engine_count(address: str, payload: dict) -> int:
    response = httpx.post(
        f"{address}/tokenize",
        headers={"Authorization": f"Bearer {ENGINE_KEY}"},
        json={"model": NAME, "messages": payload["messages"], "add_generation_prompt": True},
        timeout=60,
    )
    response.raise_for_status()
    return response.json()["count"]


@pytest.mark.parametrize("text", TEXTS)
def test_the_engines_own_count_is_within_the_bound_its_agents_report_gives(
    normalizing_engine, normalizing_model_dir, text
):
    payload = {"model": NAME, "max_tokens": 1, "messages": [{"role": "user", "content": TEXTS[text]}]}
    described = read_model(normalizing_model_dir).info.tokenizer_normalizer

    counted = _engine_count(normalizing_engine, payload)

    assert worst_case(payload, "chat", CONTEXT).num_prompt_tokens < counted  # the bound for every model
    bound = worst_case(payload, "chat", CONTEXT, normalizer=prompt_normalizer(described.to_dict()))
    assert counted <= bound.num_prompt_tokens < CONTEXT


@pytest.mark.parametrize("text", TEXTS)
def test_a_prompt_the_tokenizer_lengthens_is_billed_for_every_token_the_engine_counted(
    normalizing_engine, normalizing_model_dir, gateway, tenant, text
):
    # 140 Hangul syllables: ~840 prompt tokens against a bound of ~500, the rest free; 300 spaces: ~1,200 against ~690.
    endpoint = serve_endpoint(tenant.org, normalizing_engine, name=NAME, engine_key=ENGINE_KEY, **PRICES)
    node = endpoint.replicas.get().node
    info = read_model(normalizing_model_dir).info  # what the agent running it reports with its heartbeat
    record_model_facts(
        node,
        [
            protocol.WeightsStatus(
                source=endpoint.model_source,
                cache_key="normalizing",
                size_bytes=1_000_000,
                downloaded_bytes=1_000_000,
                complete=True,
                model_info=info,
                scope=endpoint.weights_scope,
            )
        ],
    )
    payload = {"model": NAME, "max_tokens": 1, "messages": [{"role": "user", "content": TEXTS[text]}]}

    response = httpx.post(
        f"{gateway}/v1/chat/completions",
        headers={"Authorization": f"Bearer {tenant.key}"},
        json=payload,
        timeout=300,
    )

    assert response.status_code == 200, response.text[:300]
    row = wait_until(
        lambda: UsageRecord.objects.filter(request_id=response.headers["x-request-id"]).first(),
        30,
        message="the usage row",
    )
    assert row.status == "ok"
    assert row.prompt_tokens > worst_case(payload, "chat", CONTEXT).num_prompt_tokens
    assert row.cost == cost_of(endpoint, row.prompt_tokens, row.cached_tokens, row.completion_tokens)
