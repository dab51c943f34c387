"""Promotional credit a close forfeits (`billing.credits.forfeit_promotional_credit`) pays for no call the gateway
admits after it: Redis's credit figure, which the gateway admits a prepaid organisation's calls against, is dropped
with the close, and rebuilt from the grants left (none) when next needed.

Before: the figure stayed as it was before the close, the forfeited amount in it, so a call admitted after the close (a
key or session the gateway still had cached, a batch's lines) spent it, and the draw found no grant to pay it
(`credit_unpaid`): free compute."""

from __future__ import annotations

import asyncio
from decimal import Decimal

import pytest

from billing import credits
from billing.models import BillingMode, CreditKind
from billing.quota.counters import QuotaExceeded
from billing.services import set_billing_mode
from controlplane.accounts.models import Role
from controlplane.accounts.services import SYSTEM, Actor
from controlplane.redis_client import get_redis
from controlplane.redis_keys import credit_key
from endpoints import closing
from tests.billing.test_quota import reserve, settle
from tests.factories import OrganizationFactory
from tests.test_closing import _member

# NOTE: the close's refresh of the limits runs once its transaction commits
pytestmark = pytest.mark.django_db(transaction=True)


def test_forfeited_promotional_credit_admits_no_call_after_the_close():
    organization = OrganizationFactory(name="Acme")
    owner = _member(organization, Role.OWNER)
    set_billing_mode(SYSTEM, organization, mode=BillingMode.PREPAID)
    credits.grant_credits(SYSTEM, organization, amount=Decimal("25.00"), kind=CreditKind.PROMOTIONAL)
    admitted = asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("1.00"),
                                   request_id="before-the-close"))
    asyncio.run(settle(admitted, Decimal("1.00"), fresh_id=True))
    assert get_redis().get(credit_key(organization.pk)) is not None  # the gateway's figure, the promotional credit in it

    closing.close_organization(Actor(user=owner), organization, confirm_name="Acme", forfeit_promotional_credit=True)

    with pytest.raises(QuotaExceeded) as refused:
        asyncio.run(reserve(organization_id=organization.pk, api_key_id=None, amount=Decimal("1.00"),
                            request_id="after-the-close"))
    assert refused.value.code == "insufficient_quota"
