"""The reservation is the true worst case, checked against a real vLLM engine on the tiny model.

The package's shared engine (`vllm_engine`, slow to start on CPU) serves the module. For random request
shapes through the gateway the real cost of the tokens the engine reports never exceeds what the
gateway reserved; and the `n: 16` call that once took a $0.05 cap to $0.51 is refused, for a hard cap
and for prepaid credit.

The shared engine has the tiny model's whole context (2048). Each random request is padded by a fixed
prompt of CONTEXT − ROOM tokens, so it has only ROOM tokens left, as on a small-context engine: shapes
whose prompt and output pass the context are refused by the engine, and a chat without a limit
generates ROOM tokens at most, not 2048 per sequence (minutes on CPU).
"""

from __future__ import annotations

from decimal import Decimal

import httpx
import pytest
from django.db.models import Sum
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from billing.credits import grant_credits
from billing.ledger import cost_of, period_spend
from billing.models import BillingMode, UsageRecord
from billing.periods import period_containing
from billing.quota.rebuild import credit_available
from billing.services import set_billing_mode, set_spend_cap
from controlplane.accounts.services import SYSTEM
from endpoints.gateway.estimate import worst_case
from endpoints.models import Endpoint
from tests.conftest import wait_until
from tests.gateway.conftest import ENGINE_CONTEXT, ENGINE_KEY, ENGINE_NAME, serve_endpoint

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

CONTEXT = ENGINE_CONTEXT
NAME = ENGINE_NAME
# Input and output priced apart, so that the longest prompt is not always the dearest request.
PRICES = {"price_input_per_million": Decimal("100"), "price_cached_input_per_million": Decimal("100"),
          "price_output_per_million": Decimal("300")}


@pytest.fixture
def engine(vllm_engine) -> str:
    return vllm_engine


def _endpoint(organization, address: str) -> Endpoint:
    endpoint = serve_endpoint(organization, address, name=NAME, engine_key=ENGINE_KEY, **PRICES)
    Endpoint.objects.filter(pk=endpoint.pk).update(max_model_len=CONTEXT)
    endpoint.refresh_from_db()
    return endpoint


def _call(gateway: str, key: str, kind: str, payload: dict) -> httpx.Response:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {key}"}, timeout=300) as client:
        if payload.get("stream"):
            with client.stream("POST", path, json=payload) as response:
                response.read()
            return response
        return client.post(path, json=payload)


# --- random request shapes ------------------------------------------------------------------------

text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)
token_ids = st.lists(st.integers(min_value=5, max_value=200), min_size=1, max_size=30)
prompts = st.one_of(text.filter(bool), st.lists(text.filter(bool), min_size=1, max_size=3), token_ids,
                    st.lists(token_ids, min_size=1, max_size=3))
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": text}),
                    min_size=1, max_size=3)
tools = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({
    "name": st.from_regex(r"[a-z]{1,12}", fullmatch=True), "description": text,
    "parameters": st.just({"type": "object", "properties": {"city": {"type": "string"}}})})}), min_size=1, max_size=2)
limits = st.none() | st.integers(min_value=1, max_value=64)


@st.composite
def requests(draw) -> tuple[str, dict]:
    kind = draw(st.sampled_from(["chat", "completion"]))
    payload = {"model": NAME, "n": draw(st.integers(min_value=1, max_value=4)), "ignore_eos": draw(st.booleans()),
               "stream": draw(st.booleans()), "temperature": 1.0}
    for name in ("max_tokens", "max_completion_tokens"):
        if (value := draw(limits)) is not None:
            payload[name] = value
    if kind == "chat":
        payload["messages"] = draw(messages)
        if draw(st.booleans()):
            payload |= {"tools": draw(tools), "tool_choice": "none"}
    else:
        payload["prompt"] = draw(prompts)
    return kind, payload


# The room each random request has left of the context once padded (a small engine's whole context).
ROOM = 256
# "%" is one byte and one token to the tiny tokenizer (no merge holds it): the padding's bound, in bytes,
# is its real length, so it moves the reservation and the real cost alike. Token-id prompts take ids.
PADDING = "%" * (CONTEXT - ROOM)
PADDING_IDS = [7] * (CONTEXT - ROOM)


def _padded(kind: str, payload: dict) -> dict:
    """`payload` with the padding before its prompt(s): a first system message, or a prefix of each prompt."""
    if kind == "chat":
        return payload | {"messages": [{"role": "system", "content": PADDING}, *payload["messages"]]}

    def pad(prompt):
        if isinstance(prompt, str):
            return PADDING + prompt
        if all(isinstance(item, int) for item in prompt):
            return PADDING_IDS + prompt
        return [pad(item) for item in prompt]

    return payload | {"prompt": pad(payload["prompt"])}


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(request=requests())
def test_a_request_never_costs_more_than_its_reservation(engine, gateway, tenant, request):
    kind, payload = request[0], _padded(*request)
    endpoint = Endpoint.objects.filter(organization=tenant.org, name=NAME).first() or _endpoint(tenant.org, engine)
    response = _call(gateway, tenant.key, kind, payload)
    note(f"{response.status_code} {response.text[:300]}")
    event(f"{kind}, HTTP {response.status_code}")
    if response.status_code != 200:
        assert response.status_code == 400  # the engine refused the shape (say, prompt plus output past the context)
        return
    request_id = response.headers["x-request-id"]
    row = wait_until(lambda: UsageRecord.objects.filter(request_id=request_id).first(), 30, message="the usage row")
    reserved = worst_case(payload, kind, CONTEXT).max_cost(endpoint)
    actual = cost_of(endpoint, row.prompt_tokens, row.cached_tokens, row.completion_tokens)
    note(f"prompt={row.prompt_tokens} completion={row.completion_tokens} actual={actual} reserved={reserved}")
    assert row.status == "ok"  # never cut off: the engine stayed inside the worst case
    assert row.completion_tokens > 0
    assert actual <= reserved


def test_a_message_of_many_text_parts_never_costs_more_than_its_reservation(engine, gateway, tenant):
    # vLLM joins text parts with "\n": 600 one-letter parts prompted ~1,200 tokens against a bound of ~700, and the
    # bill stops at the reservation: almost half the prompt was free.
    endpoint = Endpoint.objects.filter(organization=tenant.org, name=NAME).first() or _endpoint(tenant.org, engine)
    payload = {"model": NAME, "max_tokens": 1,
               "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 600}]}

    response = _call(gateway, tenant.key, "chat", payload)

    assert response.status_code == 200, response.text[:300]
    row = wait_until(lambda: UsageRecord.objects.filter(request_id=response.headers["x-request-id"]).first(), 30,
                     message="the usage row")
    assert row.prompt_tokens > 1_000 and row.status == "ok"
    assert cost_of(endpoint, row.prompt_tokens, row.cached_tokens, row.completion_tokens) <= \
        worst_case(payload, "chat", CONTEXT).max_cost(endpoint)


def test_a_special_token_given_in_template_kwargs_is_billed_for_every_message_it_renders_in(engine, gateway, tenant):
    # The template renders `eos_token` after every message, and vLLM lets `chat_template_kwargs` replace it: 90 bytes
    # of it with 20 empty messages prompted ~1,990 tokens against a reservation of ~580, and the bill stopped there.
    endpoint = Endpoint.objects.filter(organization=tenant.org, name=NAME).first() or _endpoint(tenant.org, engine)
    payload = {"model": NAME, "max_tokens": 1, "messages": [{"role": "user", "content": ""}] * 20,
               "chat_template_kwargs": {"eos_token": "%" * 90}}

    response = _call(gateway, tenant.key, "chat", payload)

    assert response.status_code == 200, response.text[:300]
    row = wait_until(lambda: UsageRecord.objects.filter(request_id=response.headers["x-request-id"]).first(), 30,
                     message="the usage row")
    assert row.prompt_tokens > 1_500 and row.status == "ok"
    assert row.cost == cost_of(endpoint, row.prompt_tokens, row.cached_tokens, row.completion_tokens)
    assert row.cost <= worst_case(payload, "chat", CONTEXT).max_cost(endpoint)


# --- the n: 16 attack --------------------------------------------------------------------------------

# One sequence of 40 tokens costs about $0.012: inside $0.05. Sixteen cost about $0.20.
ATTACK = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 40, "n": 16, "ignore_eos": True}
LIMIT = Decimal("0.05")


def _spent(organization) -> Decimal:
    return UsageRecord.objects.filter(organization=organization).aggregate(total=Sum("cost"))["total"] or Decimal(0)


@pytest.mark.parametrize("stream", [False, True])
def test_sixteen_completions_in_one_call_cannot_pass_a_hard_cap(engine, gateway, tenant, stream):
    _endpoint(tenant.org, engine)
    set_spend_cap(SYSTEM, tenant.org, spend_cap=LIMIT)

    refused = _call(gateway, tenant.key, "completion", ATTACK | {"stream": stream})
    single = _call(gateway, tenant.key, "completion", ATTACK | {"n": 1, "stream": stream})

    assert refused.status_code == 402 and refused.json()["error"]["code"] == "insufficient_quota"
    assert single.status_code == 200
    wait_until(lambda: UsageRecord.objects.filter(organization=tenant.org).count() == 1, 30, message="one usage row")
    assert 0 < _spent(tenant.org) <= LIMIT
    assert period_spend(tenant.org.pk, period_containing()) <= LIMIT


def test_sixteen_completions_in_one_call_cannot_overdraw_prepaid_credit(engine, gateway, tenant):
    _endpoint(tenant.org, engine)
    set_billing_mode(SYSTEM, tenant.org, mode=BillingMode.PREPAID)
    grant_credits(SYSTEM, tenant.org, amount=LIMIT)

    refused = _call(gateway, tenant.key, "completion", ATTACK)
    single = _call(gateway, tenant.key, "completion", ATTACK | {"n": 1})

    assert refused.status_code == 402 and refused.json()["error"]["code"] == "insufficient_quota"
    assert single.status_code == 200
    wait_until(lambda: UsageRecord.objects.filter(organization=tenant.org).count() == 1, 30, message="one usage row")
    assert 0 < _spent(tenant.org) <= LIMIT
    assert credit_available(tenant.org.pk)[0] >= 0
