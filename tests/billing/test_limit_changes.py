"""A change of an organisation's limits reaches the gateway even when the process that made it dies
between its commit and the write to Redis: the change is marked `limits_stale` in its own transaction,
and the payment-standing beat task writes it. Before, only a refresh that raised marked it, so a killed
worker left Redis with the old cap, billing mode or credit for the rest of the month."""

import asyncio
import itertools
from decimal import Decimal

import pytest

from billing import credits, services, stripe_sync, tasks
from billing.models import BillingAccount
from billing.quota.counters import QuotaExceeded
from controlplane.accounts.models import ApiKey
from controlplane.accounts.services import SYSTEM
from tests.billing.test_quota import reserve
from tests.factories import OrganizationFactory

# NOTE: admission rebuilds counters in a worker thread, which sees only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)

_request_ids = itertools.count()


class Killed(BaseException):
    """The process dying (SIGKILL, a hard time limit): nothing after it runs, no `except Exception` sees it."""


def _spend(organization, amount: str) -> None:
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal(amount),
                        request_id=f"limit-change-{next(_request_ids)}"))


def _refusal(organization, amount: str) -> str:
    with pytest.raises(QuotaExceeded) as refused:
        _spend(organization, amount)
    return refused.value.reason


def _killed_after_commit(monkeypatch, module, change) -> None:
    def killed(*args, **kwargs):
        raise Killed

    with monkeypatch.context() as patched:
        patched.setattr(module, "refresh_limits", killed)
        with pytest.raises(Killed):
            change()


def _cap(organization):
    _spend(organization, "0.10")  # the gateway's counter is built, with no cap
    return services, lambda: services.set_spend_cap(SYSTEM, organization, spend_cap=Decimal("0.50"))


def _cap_reached(organization):
    return _refusal(organization, "0.50") == "org_cap"


def _prepaid(organization):
    _spend(organization, "0.10")
    return services, lambda: services.set_billing_mode(SYSTEM, organization, mode="prepaid")


def _prepaid_without_credit(organization):
    return _refusal(organization, "0.01") == "credit"


def _credit(organization):
    services.set_billing_mode(SYSTEM, organization, mode="prepaid")
    credits.grant_credits(SYSTEM, organization, amount=Decimal("1.00"))
    _spend(organization, "0.50")  # Redis's credit figure is built: $0.50 left
    return credits, lambda: credits.grant_credits(SYSTEM, organization, amount=Decimal("2.00"))


def _credit_spendable(organization):
    _spend(organization, "1.50")
    return True


@pytest.mark.parametrize(("before", "after"), [
    (_cap, _cap_reached), (_prepaid, _prepaid_without_credit), (_credit, _credit_spendable),
], ids=["spend cap", "billing mode", "credit grant"])
def test_a_limit_change_whose_process_died_after_its_commit_reaches_the_gateway_at_the_next_review(
        monkeypatch, before, after):
    organization = OrganizationFactory()
    module, change = before(organization)

    _killed_after_commit(monkeypatch, module, change)

    assert BillingAccount.objects.get(organization=organization).limits_stale
    tasks.review_payment_standing()
    assert after(organization)
    assert not BillingAccount.objects.get(organization=organization).limits_stale


def test_invoicing_without_a_card_whose_process_died_after_its_commit_reaches_the_gateway_at_the_next_review(
        monkeypatch, fake_stripe, settings):
    settings.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD = Decimal("1.00")
    organization = OrganizationFactory()
    stripe_sync.ensure_customer(organization.pk)
    assert _refusal(organization, "2.00") == "payment_method"

    _killed_after_commit(monkeypatch, services,
                         lambda: services.set_invoiced_without_card(SYSTEM, organization, allowed=True))

    assert BillingAccount.objects.get(organization=organization).limits_stale
    tasks.review_payment_standing()
    _spend(organization, "2.00")


def test_a_key_cap_whose_process_died_after_its_commit_reaches_the_gateway_at_the_next_review(monkeypatch):
    # A key's cap was written to Redis after the commit with nothing marked: a worker killed between them
    # left the key spending past its new cap for the rest of the month.
    organization = OrganizationFactory()
    api_key = ApiKey.objects.create(organization=organization, name="capped", lookup="capped", digest="x")
    asyncio.run(reserve(organization_id=organization.pk, api_key_id=api_key.pk, amount=Decimal("0.10"),
                        request_id=f"limit-change-{next(_request_ids)}"))  # the key's counter is built, with no cap

    _killed_after_commit(monkeypatch, services,
                         lambda: services.set_key_spend_cap(SYSTEM, api_key, spend_cap=Decimal("0.50")))

    assert BillingAccount.objects.get(organization=organization).limits_stale
    tasks.review_payment_standing()
    with pytest.raises(QuotaExceeded) as refused:
        asyncio.run(reserve(organization_id=organization.pk, api_key_id=api_key.pk, amount=Decimal("0.50"),
                            request_id=f"limit-change-{next(_request_ids)}"))
    assert refused.value.reason == "key_cap"
