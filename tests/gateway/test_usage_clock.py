"""A gateway stamps its calls' times (a usage row's start, first token and finish) by Redis's clock
(`controlplane.clock.redis_datetime`), which the credit draw can compare with a grant's start, stamped by PostgreSQL's
(`billing.models.credit_shares`, a minute's slack).

Before: the gateway stamped them by its own clock. One 10 minutes behind (a VM resumed, NTP broken) had a call made
under a grant judged begun before it, drawn from nothing; one 10 minutes ahead had it paid by a promotion granted after
the call."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta
from decimal import Decimal

import httpx
import pytest

from billing.credits import draw_credits, grant_credits
from billing.models import BillingAccount, BillingMode, CreditGrant, UsageRecord
from billing.services import set_billing_mode
from controlplane import clock
from controlplane.accounts.services import SYSTEM
from controlplane.asgi import application
from controlplane.redis_client import get_async_redis
from endpoints.gateway import app as gateway_app
from endpoints.gateway import call as gateway_call
from endpoints.gateway import presence
from tests.conftest import wait_until
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "Hello"}]
PRICE = Decimal("100")  # dollars per million tokens: a call costs a few tenths of a cent


def _gateway_clock_off(monkeypatch, by_s: float) -> None:
    """This process, as a gateway whose machine's clock is `by_s` seconds off the database's and Redis's."""
    real_time, real_datetime = time.time, datetime

    class _Skewed(datetime):
        @classmethod
        def now(cls, tz=None):
            return real_datetime.now(tz) + timedelta(seconds=by_s)

    monkeypatch.setattr(time, "time", lambda: real_time() + by_s)
    for module in (gateway_app, gateway_call):
        monkeypatch.setattr(module, "datetime", _Skewed, raising=False)
    monkeypatch.setattr(clock, "_offset", clock._Offset())  # its offset to Redis's clock, read by its next beat


def _one_call_through(endpoint, key: str) -> None:
    async def run() -> int:
        await presence.beat()
        transport = httpx.ASGITransport(app=application, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as http:
            response = await http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                       json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 5})
        return response.status_code

    assert asyncio.run(asyncio.wait_for(run(), 60)) == 200


@pytest.mark.parametrize("off_by_s", [-600, 600], ids=["gateway-10-min-behind", "gateway-10-min-ahead"])
def test_a_call_through_a_gateway_whose_clock_is_off_is_paid_by_the_grant_it_was_made_under(
        tenant, start_mock_upstream, gateway_alone, monkeypatch, off_by_s):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(), price_input_per_million=PRICE,
                              price_cached_input_per_million=PRICE, price_output_per_million=PRICE)
    set_billing_mode(SYSTEM, tenant.org, mode=BillingMode.PREPAID)
    bought = grant_credits(SYSTEM, tenant.org, amount=Decimal("5.00"), note="bought")

    with monkeypatch.context() as gateway:
        _gateway_clock_off(gateway, off_by_s)
        _one_call_through(endpoint, tenant.key)
    wait_until(lambda: UsageRecord.objects.filter(organization=tenant.org).exists(), 15, message="the call's row")
    row = UsageRecord.objects.get(organization=tenant.org)
    # A promotion granted two minutes after the call, expiring first; the draw a minute after that.
    now = clock.database_now()
    promotion = grant_credits(SYSTEM, tenant.org, amount=Decimal("5.00"), note="promotion",
                              granted_at=now + timedelta(minutes=2), expires_at=now + timedelta(days=1))

    assert draw_credits(tenant.org.pk, now=now + timedelta(minutes=3)) == row.cost > 0
    assert CreditGrant.objects.get(pk=bought.pk).consumed == row.cost
    assert CreditGrant.objects.get(pk=promotion.pk).consumed == 0
    assert BillingAccount.objects.get(organization=tenant.org).credit_unpaid == 0


def test_a_call_during_which_the_gateways_clock_stepped_forward_keeps_its_usage_row(
        tenant, start_mock_upstream, gateway_alone, monkeypatch):
    # The gateway's clock 10 minutes behind, its offset read by a beat; NTP steps it forward, a call starts before the
    # next beat (stamped by the old offset: 10 minutes ahead) and ends after it (by the new one): its finish came out
    # 10 minutes before its start. The ledger refuses such a report (`UsageReport`: a ValueError out of the call's end)
    # and the call's usage row was lost, unbilled.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(), price_input_per_million=PRICE,
                              price_cached_input_per_million=PRICE, price_output_per_million=PRICE)
    real_time = time.time
    behind = {"s": -600.0}
    monkeypatch.setattr(time, "time", lambda: real_time() + behind["s"])
    monkeypatch.setattr(clock, "_offset", clock._Offset())
    real_admit = gateway_call.admission.admit

    async def admit_after_a_beat(**kwargs):
        await clock.read_offset(get_async_redis())  # the next beat, mid-call, reads the offset again
        return await real_admit(**kwargs)

    async def run() -> int:
        await presence.beat()  # the offset: +600 s
        behind["s"] = 0.0  # NTP steps the machine's clock forward
        monkeypatch.setattr(gateway_call.admission, "admit", admit_after_a_beat)
        transport = httpx.ASGITransport(app=application, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as http:
            response = await http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {tenant.key}"},
                                       json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 5})
        return response.status_code

    assert asyncio.run(asyncio.wait_for(run(), 60)) == 200

    wait_until(lambda: UsageRecord.objects.filter(organization=tenant.org).exists(), 15, message="the call's row")
    row = UsageRecord.objects.get(organization=tenant.org)
    assert row.cost > 0
    assert row.started_at <= row.finished_at < row.started_at + timedelta(seconds=30)


def test_a_call_started_between_a_step_of_the_gateways_clock_and_its_next_beat_is_stamped_by_redis_clock(
        tenant, start_mock_upstream, gateway_alone, monkeypatch):
    # Before: the offset read by the last beat was added to the gateway's wall clock: the clock 10 minutes behind, NTP
    # steps it forward, and a call started before the next beat was stamped 10 minutes ahead (its billing hour, month
    # and paying grant with it), as were its reservation's month and its hold's deadline.
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(), price_input_per_million=PRICE,
                              price_cached_input_per_million=PRICE, price_output_per_million=PRICE)
    real_time = time.time
    behind = {"s": -600.0}
    monkeypatch.setattr(time, "time", lambda: real_time() + behind["s"])
    monkeypatch.setattr(clock, "_offset", clock._Offset())

    async def run() -> int:
        await presence.beat()  # the offset: +600 s
        behind["s"] = 0.0  # NTP steps the machine's clock forward; no beat before the call
        monkeypatch.setattr(presence, "beat", lambda *args, **kwargs: asyncio.sleep(0))
        transport = httpx.ASGITransport(app=application, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as http:
            response = await http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {tenant.key}"},
                                       json={"model": endpoint.name, "messages": MESSAGES, "max_tokens": 5})
        return response.status_code

    assert asyncio.run(asyncio.wait_for(run(), 60)) == 200

    wait_until(lambda: UsageRecord.objects.filter(organization=tenant.org).exists(), 15, message="the call's row")
    row = UsageRecord.objects.get(organization=tenant.org)
    now = clock.database_now()
    assert now - timedelta(seconds=30) < row.started_at <= row.finished_at <= now + timedelta(seconds=1)
