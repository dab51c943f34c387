"""A real vLLM engine whose chat template repeats each message's text (a tenant's own template, which the empty-message
probe cannot see) is billed its reservation for the first prompt past the bound, and in full from then on: the endpoint
learned a prompt factor from the loss (`endpoints.models.PromptFactor`).

The engine serves a copy of the tiny model whose template renders each message's content eight times: 240 bytes of "%"
(one token each) are ~1,942 prompt tokens against a bound of ~320 (the reviewer's case). Before, every identical
request was billed at the bound, the rest free, for as long as the tenant sent it.
"""

from __future__ import annotations

import time
from decimal import Decimal

import httpx
import pytest

from billing.ledger import cost_of
from billing.models import UsageRecord
from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import Scope
from controlplane.accounts.services import Actor
from endpoints.gateway.estimate import worst_case
from endpoints.models import PromptFactor
from gpu_agent.runtime.tiny_model import CHAT_TEMPLATE
from tests.conftest import start_web_server, wait_until
from tests.engines import serve_small_engine, tiny_model_copy
from tests.gateway.conftest import serve_endpoint

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

NAME = "tiny-repeating"
ENGINE_KEY = "key-of-the-repeating-engine"
CONTEXT = 2048
CONTENT = "{% if message['content'] %}{{ message['content'] }}{% endif %}"
REPEATING_TEMPLATE = CHAT_TEMPLATE.replace(
    CONTENT,
    "{% if message['content'] %}{% for _ in range(8) %}{{ message['content'] }}{% endfor %}{% endif %}",
)
PAYLOAD = {"model": NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "%" * 240}]}
PRICES = {
    "price_input_per_million": Decimal("100"),
    "price_cached_input_per_million": Decimal("100"),
    "price_output_per_million": Decimal("300"),
}


@pytest.fixture(scope="module")
def repeating_model_dir(tiny_model_dir, tmp_path_factory):
    assert CONTENT in CHAT_TEMPLATE
    return tiny_model_copy(tiny_model_dir, tmp_path_factory.mktemp("repeating-model"),
                           {"tokenizer_config.json": {"chat_template": REPEATING_TEMPLATE}})


@pytest.fixture(scope="module")
def repeating_engine(engine_node, repeating_model_dir) -> str:
    with serve_small_engine(engine_node, NAME, repeating_model_dir, ENGINE_KEY, CONTEXT) as address:
        yield address


def _call(gateway: str, key: str, payload: dict = PAYLOAD) -> tuple[httpx.Response, UsageRecord]:
    response = httpx.post(
        f"{gateway}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json=payload,
        timeout=300,
    )
    assert response.status_code == 200, response.text[:300]
    return response, wait_until(
        lambda: UsageRecord.objects.filter(request_id=response.headers["x-request-id"]).first(),
        30,
        message="the usage row",
    )


def _billed(gateway: str, key: str, payload: dict = PAYLOAD) -> UsageRecord:
    return _call(gateway, key, payload)[1]


def _in_full(endpoint, row: UsageRecord) -> Decimal:
    return cost_of(endpoint, row.prompt_tokens, row.cached_tokens, row.completion_tokens)


def test_a_template_that_repeats_message_text_is_billed_in_full_from_the_second_identical_request(
    repeating_engine, gateway, tenant
):
    endpoint = serve_endpoint(tenant.org, repeating_engine, name=NAME, engine_key=ENGINE_KEY, **PRICES)
    reserved = worst_case(PAYLOAD, "chat", CONTEXT).max_cost(endpoint)  # before any factor

    first = _billed(gateway, tenant.key)
    assert first.prompt_tokens > 1900  # 240 bytes rendered eight times
    assert first.cost == reserved < _in_full(endpoint, first)  # billed its reservation: the rest was free
    factor = wait_until(lambda: PromptFactor.of(endpoint), 30, message="the learned prompt factor")
    assert factor >= Decimal(first.prompt_tokens) / worst_case(PAYLOAD, "chat", CONTEXT).num_prompt_tokens

    second = _billed(gateway, tenant.key)

    assert second.prompt_tokens == first.prompt_tokens
    assert second.cost == _in_full(endpoint, second) > reserved


def test_another_gateway_process_reserves_for_the_factor_once_it_reloads_the_endpoint(
    repeating_engine, gateway, tenant, tmp_path, web_zygote
):
    # The other process never sees a prompt past its bound (a short one is within it, template and all): what it
    # reserves, read from its `x-ratelimit-remaining-tokens` (the minute's tokens used, less this call's worst case),
    # changes only when it reads the factor the first process wrote. Its own key: no other call's tokens in its minute.
    endpoint = serve_endpoint(tenant.org, repeating_engine, name=NAME, engine_key=ENGINE_KEY, **PRICES)
    key = create_api_key(Actor(user=tenant.owner), tenant.org, name="other", scopes=[Scope.INFERENCE]).plain
    other, other_url = start_web_server(tmp_path, name="gateway-other", zygote=web_zygote)
    short = PAYLOAD | {"messages": [{"role": "user", "content": "%"}]}
    used = []

    def reserved_by_the_other() -> int:
        # NOTE: a minute that turned between calls makes this smaller, never larger: it cannot pass for the factor
        response, row = _call(other_url, key, short)
        headers = response.headers
        reserved = (
            int(headers["x-ratelimit-limit-tokens"])
            - int(headers["x-ratelimit-remaining-tokens"])
            - sum(used)
        )
        used.append(row.prompt_tokens + row.completion_tokens)
        return reserved

    try:
        before = reserved_by_the_other()  # it loads the endpoint
        assert 0 < before < CONTEXT // 8
        _billed(gateway, tenant.key)
        wait_until(lambda: PromptFactor.of(endpoint), 30, message="the learned prompt factor")
        learned_at = time.monotonic()
        wait_until(
            lambda: reserved_by_the_other() > 2 * before,
            60,
            interval_s=0.2,
            message="the other gateway to reserve for the factor",
        )
        # NOTE: a measure, not a bound: the other process reads it with its next load of the endpoint (stale for up to
        # `directory.ENDPOINT_CACHE_S`, then reloaded by the call that finds it stale).
        print(
            f"\nthe factor reached the other gateway {time.monotonic() - learned_at:.2f} s after its row, "
            f"at its {len(used) - 1}th call since"
        )
    finally:
        other.stop()
