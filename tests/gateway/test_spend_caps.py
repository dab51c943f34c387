"""A spend cap set through the API turns calls into 402 insufficient_quota, concurrency never overshoots it,
and no request is billed past what it reserved."""

import asyncio
import json
import time
from decimal import Decimal

import httpx
import pytest
from django.db.models import Sum

from billing import stripe_sync
from billing.ledger import cost_of
from billing.models import BillingMode, UsageRecord
from billing.quota import reads
from billing.services import set_billing_mode
from controlplane.accounts.services import SYSTEM
from endpoints.gateway.estimate import worst_case
from endpoints.models import Replica
from endpoints.replicas import apply_replica_report
from gpu_agent.protocol import ChatTemplateTokens, ReplicaState, ReplicaStatus
from tests.conftest import start_web_server, wait_until
from tests.fakes.stripe_server import FakeStripe, sign_webhook
from tests.gateway.conftest import new_tenant, serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "Hello"}]
CAP = "0.05"
PRICE = Decimal("100")  # dollars per million tokens: a call costs about $0.0023 and reserves about $0.01


def test_concurrent_calls_never_spend_past_the_cap_and_the_rest_get_402(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(token_delay_ms=2), price_input_per_million=PRICE,
                              price_cached_input_per_million=PRICE, price_output_per_million=PRICE)
    headers = {"Authorization": f"Bearer {tenant.key}"}
    patched = httpx.patch(f"{gateway}/api/v1/billing/", json={"spend_cap": CAP}, headers=headers)
    assert patched.status_code == 200, patched.text
    assert Decimal(patched.json()["spend_cap"]) == Decimal(CAP)

    async def call(client):
        response = await client.post("/v1/chat/completions", json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 16})
        return response.status_code, response.json()

    async def burst():
        async with httpx.AsyncClient(base_url=gateway, headers=headers, timeout=60) as client:
            return await asyncio.gather(*(call(client) for _ in range(40)))

    results = asyncio.run(burst())
    statuses = [status for status, _ in results]
    refused = [body for status, body in results if status == 402]
    assert statuses.count(200) >= 1 and refused, statuses
    assert set(statuses) <= {200, 402}
    assert {body["error"]["code"] for body in refused} == {"insufficient_quota"}
    wait_until(lambda: UsageRecord.objects.count() == statuses.count(200), 15, message="one usage row per served call")
    spent = UsageRecord.objects.aggregate(total=Sum("cost"))["total"]
    assert spent <= Decimal(CAP)

    billing = httpx.get(f"{gateway}/api/v1/billing/", headers=headers).json()
    assert Decimal(billing["current_period"]["spend"]) == spent


# A replica that produces more than the gateway's worst case allows: the mock honours
# max_completion_tokens on /v1/completions, which vLLM ignores (it stops at max_tokens, 16 by default).
OVERLONG = {"prompt": "Hello", "max_completion_tokens": 200}


def _reserved(endpoint, payload: dict) -> Decimal:
    return worst_case(payload, "completion", endpoint.max_model_len).max_cost(endpoint)


@pytest.mark.parametrize("one_write", [False, True], ids=["event-by-event", "all-events-in-one-read"])
def test_a_stream_that_would_pass_its_reservation_is_cut_off_and_billed_no_more_than_reserved(gateway, tenant,
                                                                                              start_mock_upstream,
                                                                                              one_write):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(one_write=one_write), price_input_per_million=PRICE,
                              price_cached_input_per_million=PRICE, price_output_per_million=PRICE)
    headers = {"Authorization": f"Bearer {tenant.key}"}
    payload = {"model": endpoint.name, **OVERLONG, "stream": True}
    with httpx.stream("POST", f"{gateway}/v1/completions", json=payload, headers=headers, timeout=60) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert response.status_code == 200
    assert len(events) < 200 and '"reservation_spent"' in events[-1]

    row = wait_until(lambda: UsageRecord.objects.filter(organization=tenant.org).first(), 15, message="the usage row")
    reserved = _reserved(endpoint, payload)
    assert row.status == "cut_off"
    assert row.cost <= reserved
    assert reads.counted_spend(tenant.org.pk) <= reserved


def test_an_answer_costing_more_than_its_reservation_is_billed_the_reservation(gateway, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(), price_input_per_million=PRICE,
                              price_cached_input_per_million=PRICE, price_output_per_million=PRICE)
    payload = {"model": endpoint.name, **OVERLONG}
    answer = httpx.post(f"{gateway}/v1/completions", json=payload, headers={"Authorization": f"Bearer {tenant.key}"}, timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 200

    row = wait_until(lambda: UsageRecord.objects.filter(organization=tenant.org).first(), 15, message="the usage row")
    reserved = _reserved(endpoint, payload)
    assert row.completion_tokens == 200  # what happened stays on the row; the bill stops at the reservation
    assert row.cost == reserved
    wait_until(lambda: reads.counted_spend(tenant.org.pk) == reserved, 15, message="the settled spend")


def test_a_chat_template_with_a_long_default_system_prompt_is_reserved_and_billed_for_it_once_an_engine_measured_it(
        gateway, tenant, start_mock_upstream):
    # The engine counts 400 prompt tokens for "Hello": its model's template adds a long default system prompt.
    # The estimate's fixed allowance (64 + 16 per message) reserved far less, and the call was billed the
    # reservation: every short call to such a model under-billed. A READY engine's count of the template
    # (reported with its replica, kept in ModelFacts) now sets the allowance.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(prompt_tokens=400), price_input_per_million=PRICE,
                              price_cached_input_per_million=PRICE, price_output_per_million=PRICE)
    replica = endpoint.replicas.get()
    Replica.objects.filter(pk=replica.pk).update(state=ReplicaState.STARTING)
    apply_replica_report(replica.node, ReplicaStatus(
        replica_id=str(replica.pk), state=ReplicaState.READY, address=replica.address,
        chat_template_tokens=ChatTemplateTokens(per_conversation=395, per_message=5, model_source=endpoint.model_source,
                                                weights_scope=endpoint.weights_scope)))
    assert endpoint.chat_template_tokens == (395, 5)

    answer = httpx.post(f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {tenant.key}"}, timeout=60,
                        json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 5})
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == 400

    row = wait_until(lambda: UsageRecord.objects.filter(organization=tenant.org).first(), 15, message="the usage row")
    assert (row.prompt_tokens, row.completion_tokens) == (400, 5)
    assert row.cost == cost_of(endpoint, 400, 0, 5)  # the whole of it, not a reservation that stopped short


def test_without_a_card_calls_stop_at_the_limit_and_an_unpaid_invoice_stops_them_at_once(
        tmp_path, settings, tenant, start_mock_upstream):
    """Payment standing (`billing.standing`) through a gateway that bills through Stripe (the fake), with
    Stripe's webhooks posted to it as Stripe would."""
    fake = FakeStripe().start()
    env = {"STRIPE_SECRET_KEY": "sk_test_inferplane", "STRIPE_API_BASE": fake.base_url,
           "STRIPE_WEBHOOK_SECRET": "whsec_test_secret", "INFERPLANE_SPEND_LIMIT_WITHOUT_CARD": CAP}
    settings.STRIPE_SECRET_KEY, settings.STRIPE_API_BASE = env["STRIPE_SECRET_KEY"], fake.base_url
    settings.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD = Decimal(CAP)
    child, gateway = start_web_server(tmp_path, name="billed-gateway", extra_env=env)
    try:
        endpoint = serve_endpoint(tenant.org, start_mock_upstream(), price_input_per_million=PRICE,
                                  price_cached_input_per_million=PRICE, price_output_per_million=PRICE)
        customer = stripe_sync.ensure_customer(tenant.org.pk)
        headers = {"Authorization": f"Bearer {tenant.key}"}
        body = {"model": endpoint.name, "messages": MESSAGES, "max_tokens": 16}

        def call() -> httpx.Response:
            return httpx.post(f"{gateway}/v1/chat/completions", json=body, headers=headers, timeout=30)

        def webhook(kind: str, data: dict) -> None:
            event = json.dumps({"id": f"evt_{time.time_ns()}", "object": "event", "type": kind,
                                "created": int(time.time()), "data": {"object": data}}).encode()
            response = httpx.post(f"{gateway}/api/v1/billing/stripe/webhook", content=event, headers={
                "Content-Type": "application/json", "Stripe-Signature": sign_webhook(event, env["STRIPE_WEBHOOK_SECRET"])})
            assert response.status_code == 200, response.text

        statuses = []
        while not statuses or statuses[-1].status_code == 200:
            statuses.append(call())
            assert len(statuses) < 40, "never stopped: no limit without a payment method"
        refused = statuses[-1]
        assert refused.status_code == 402 and refused.json()["error"]["code"] == "insufficient_quota"
        assert "payment method" in refused.json()["error"]["message"]
        wait_until(lambda: UsageRecord.objects.count() == len(statuses) - 1, 15, message="one usage row per served call")
        assert UsageRecord.objects.aggregate(total=Sum("cost"))["total"] <= Decimal(CAP)

        webhook("customer.updated", fake.set_default_payment_method(customer, "pm_card_visa"))
        assert call().status_code == 200

        invoice = {"id": "in_unpaid", "object": "invoice", "customer": customer, "status": "uncollectible",
                   "currency": "usd", "amount_due": 900, "amount_paid": 0, "lines": {"object": "list", "data": []}}
        webhook("invoice.marked_uncollectible", invoice)
        held = call()
        assert held.status_code == 402 and "unpaid invoice" in held.json()["error"]["message"]

        webhook("invoice.paid", invoice | {"status": "paid", "amount_paid": 900})
        assert call().status_code == 200
    finally:
        child.stop()
        fake.stop()


def _post_webhook(gateway: str, kind: str, data: dict) -> None:
    """A Stripe webhook posted to the gateway's server as Stripe would (signed)."""
    event = json.dumps({"id": f"evt_{time.time_ns()}", "object": "event", "type": kind, "created": int(time.time()),
                        "data": {"object": data}}).encode()
    response = httpx.post(f"{gateway}/api/v1/billing/stripe/webhook", content=event, headers={
        "Content-Type": "application/json", "Stripe-Signature": sign_webhook(event, "whsec_test_secret")})
    assert response.status_code == 200, response.text


def test_a_new_organisation_with_a_card_and_no_cap_stops_at_its_spending_ceiling_which_paid_invoices_raise(
        tmp_path, settings, tenant, start_mock_upstream):
    """The default `INFERPLANE_SPEND_CEILINGS` (`billing.standing.spend_ceiling`) through a gateway that bills through
    Stripe (the fake). Before, a postpaid organisation with a card and no cap had no limit at all: a stolen card
    added ran our GPUs for a month and the grace period (this loop never stopped)."""
    fake = FakeStripe().start()
    env = {"STRIPE_SECRET_KEY": "sk_test_inferplane", "STRIPE_API_BASE": fake.base_url,
           "STRIPE_WEBHOOK_SECRET": "whsec_test_secret"}
    settings.STRIPE_SECRET_KEY, settings.STRIPE_API_BASE = env["STRIPE_SECRET_KEY"], fake.base_url
    child, gateway = start_web_server(tmp_path, name="billed-gateway", extra_env=env)
    try:
        # ~$4.60 a call, ~$20 reserved: the default's $100 a month for an organisation that has paid nothing
        price = Decimal(200_000)
        endpoint = serve_endpoint(tenant.org, start_mock_upstream(), price_input_per_million=price,
                                  price_cached_input_per_million=price, price_output_per_million=price)
        customer = stripe_sync.ensure_customer(tenant.org.pk)
        card = fake.add_card(fingerprint="fp_one_card")
        _post_webhook(gateway, "customer.updated", fake.set_default_payment_method(customer, card))
        headers = {"Authorization": f"Bearer {tenant.key}"}
        assert httpx.get(f"{gateway}/api/v1/billing/", headers=headers).json()["spend_cap"] is None  # no cap of its own
        body = {"model": endpoint.name, "messages": MESSAGES, "max_tokens": 16}

        def call() -> httpx.Response:
            return httpx.post(f"{gateway}/v1/chat/completions", json=body, headers=headers, timeout=30)

        statuses = []
        while not statuses or statuses[-1].status_code == 200:
            statuses.append(call())
            assert len(statuses) < 60, "never stopped: no ceiling for an organisation with a card"
        refused = statuses[-1].json()["error"]
        assert statuses[-1].status_code == 402 and refused["code"] == "insufficient_quota"
        assert "spending ceiling for its payment history" in refused["message"]
        assert "contact support" in refused["message"]
        wait_until(lambda: UsageRecord.objects.count() == len(statuses) - 1, 15, message="one usage row per served call")
        assert Decimal(80) < UsageRecord.objects.aggregate(total=Sum("cost"))["total"] <= Decimal(100)

        invoice = {"id": "in_first", "object": "invoice", "customer": customer, "status": "paid", "currency": "usd",
                   "amount_due": 5000, "amount_paid": 5000, "lines": {"object": "list", "data": []}}
        _post_webhook(gateway, "invoice.paid", invoice)  # $50 paid: $500 a month, at once
        assert call().status_code == 200
        wait_until(lambda: UsageRecord.objects.count() == len(statuses), 15, message="its usage row")
        shown = httpx.get(f"{gateway}/api/v1/billing/", headers=headers).json()["standing"]
        assert shown["spend_ceiling"] == {"amount": "500.00", "source": "paid_history", "net_paid": "50.00",
                                          "next_paid": "500.00", "next_amount": "5000.00",
                                          "shared_with_other_organizations": False}
        assert shown["limit_reason"] == "spend_ceiling"

        _post_webhook(gateway, "charge.refunded", {"id": "ch_first", "object": "charge", "customer": customer,
                                                   "currency": "usd", "amount": 5000, "amount_refunded": 5000})
        lowered = call()  # the money came back: $100 again, already spent
        assert lowered.status_code == 402 and "spending ceiling" in lowered.json()["error"]["message"]

        # A second sign-up with the same card: the card's $100, which the first spent, is the second's ceiling too
        # (before, it had $100 of its own).
        second = new_tenant()
        other = serve_endpoint(second.org, start_mock_upstream(), price_input_per_million=price,
                               price_cached_input_per_million=price, price_output_per_million=price)
        second_customer = stripe_sync.ensure_customer(second.org.pk)
        _post_webhook(gateway, "customer.updated", fake.set_default_payment_method(
            second_customer, fake.add_card(fingerprint="fp_one_card")))
        second_headers = {"Authorization": f"Bearer {second.key}"}
        shared = httpx.post(f"{gateway}/v1/chat/completions", json={**body, "model": other.name},
                            headers=second_headers, timeout=30)
        assert shared.status_code == 402 and shared.json()["error"]["code"] == "insufficient_quota"
        assert "other organisations have the same card on file" in shared.json()["error"]["message"]
        shown = httpx.get(f"{gateway}/api/v1/billing/", headers=second_headers).json()["standing"]
        assert shown["spend_ceiling"]["shared_with_other_organizations"] is True
        assert shown["effective_spend_cap"] == "100.00"  # its ceiling, not the room the first's spend left it
    finally:
        child.stop()
        fake.stop()


def _metrics_after_a_call_past_its_reservation(tenant, endpoint, tmp_path, *, stream: bool) -> str:
    """One overlong completion through a gateway of its own (its log and metrics this call's alone): its metrics once
    the loss's warning is logged."""
    child, gateway = start_web_server(tmp_path, name="gateway", server_args=("--log-level", "warning"))
    try:
        body = {"model": endpoint.name, **OVERLONG} | ({"stream": True} if stream else {})
        with httpx.stream("POST", f"{gateway}/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {tenant.key}"}, timeout=60) as response:
            response.read()
        assert response.status_code == 200
        wait_until(lambda: "past the" in child.log_text(), 15, message="the warning")
        return httpx.get(f"{gateway}/metrics", timeout=10).text
    finally:
        child.stop()


def test_usage_past_the_reservation_is_logged_and_counted_so_the_loss_is_seen(tenant, start_mock_upstream, tmp_path):
    # A model's own chat template can render more prompt than the estimate allows; the customer is billed the
    # reservation and the rest is the platform's, which nothing showed.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(), price_input_per_million=PRICE,
                              price_cached_input_per_million=PRICE, price_output_per_million=PRICE)
    metrics = _metrics_after_a_call_past_its_reservation(tenant, endpoint, tmp_path, stream=False)
    assert f'inferplane_usage_past_reservation_total{{endpoint_id="{endpoint.pk}"' in metrics


def test_a_stream_whose_prompt_alone_passes_its_reservation_is_counted_as_a_loss_too(tenant, start_mock_upstream,
                                                                                    tmp_path):
    # A prompt past the estimate (a template or tokenizer rendering more) passes the reservation on a stream's first
    # event: the stream was cut off there as if its last chunk had, and the loss was counted for no stream.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(prompt_tokens=100_000), price_input_per_million=PRICE,
                              price_cached_input_per_million=PRICE, price_output_per_million=PRICE)
    metrics = _metrics_after_a_call_past_its_reservation(tenant, endpoint, tmp_path, stream=True)
    assert f'inferplane_usage_past_reservation_total{{endpoint_id="{endpoint.pk}"' in metrics
    row = wait_until(lambda: UsageRecord.objects.filter(organization=tenant.org).first(), 15, message="the usage row")
    assert row.status == "cut_off" and row.prompt_tokens == 100_000


def test_a_stream_whose_prompt_passes_its_estimate_is_counted_as_a_loss_when_cut_off(tenant, start_mock_upstream,
                                                                                     tmp_path):
    # "Hello" is bounded at 13 prompt tokens and the reservation holds 16 of output: a 20-token prompt is past the
    # estimate but not past the reservation, and took output the reservation held, so the stream was cut off at its
    # tenth token, the loss counted for nothing (only a prompt past the whole reservation was).
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(prompt_tokens=20), price_input_per_million=PRICE,
                              price_cached_input_per_million=PRICE, price_output_per_million=PRICE)
    metrics = _metrics_after_a_call_past_its_reservation(tenant, endpoint, tmp_path, stream=True)
    row = wait_until(lambda: UsageRecord.objects.filter(organization=tenant.org).first(), 15, message="the usage row")
    assert row.status == "cut_off" and row.prompt_tokens == 20
    assert f'inferplane_usage_past_reservation_total{{endpoint_id="{endpoint.pk}"' in metrics


def test_a_stream_admitted_postpaid_that_ends_after_a_switch_to_prepaid_is_billed_postpaid(gateway, tenant,
                                                                                            start_mock_upstream):
    """Its row took the mode of its end before: prepaid, never metered, and written off by the credit draw (no credit
    was bought yet). The admission's mode comes with the call to its row."""
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(token_delay_ms=50))
    body = {"model": endpoint.name, "messages": MESSAGES, "max_tokens": 40, "stream": True}
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {tenant.key}"}) as response:
        assert response.status_code == 200
        chunks = response.iter_bytes()
        next(chunks)  # admitted and streaming
        set_billing_mode(SYSTEM, tenant.org, mode=BillingMode.PREPAID)
        assert b"[DONE]" in b"".join(chunks)

    wait_until(lambda: UsageRecord.objects.exists(), 15, message="its usage row")
    assert UsageRecord.objects.get().billing_mode == BillingMode.POSTPAID
