"""A key's cap bounds the keys it minted, those minted before the cap too: setting or lowering it caps every live key
minted from it, generation by generation, at most at the same, and the gateway sees it at once. Before, the cap was
copied only when a key was minted, so capping a leaked key at 0 ("stops a key as revoking does") left the keys
minted with it spending."""

from __future__ import annotations

import asyncio
import itertools
import threading
from decimal import Decimal

import pytest
from django.db import connection

from billing.models import ApiKeySpendCap
from billing.quota.counters import QuotaExceeded
from billing.services import set_key_spend_cap
from controlplane.accounts import keys
from controlplane.accounts.keys import create_api_key, revoke_api_key
from controlplane.accounts.members import NotPermitted
from controlplane.accounts.models import ApiKey, AuditEvent, Role, Scope
from controlplane.accounts.services import Actor
from tests.billing.test_quota import reserve
from tests.conftest import wait_until
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory
from tests.test_roles import _waiting_on_a_lock

_request_ids = itertools.count()


def _organisation():
    organization, owner, admin = OrganizationFactory(), UserFactory(), UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    MembershipFactory(organization=organization, user=admin, role=Role.ADMIN)
    return organization, owner, admin


def _mint(admin, organization, *, by: ApiKey | None, scopes=(Scope.MANAGE, Scope.INFERENCE)) -> ApiKey:
    return create_api_key(Actor(user=admin, api_key=by), organization, name="key", scopes=list(scopes)).api_key


def _spend(api_key: ApiKey, amount: str) -> None:
    asyncio.run(reserve(organization_id=api_key.organization_id, api_key_id=api_key.pk, amount=Decimal(amount),
                        request_id=f"minted-keys-{next(_request_ids)}"))


def _cap_of(api_key: ApiKey) -> Decimal | None:
    return ApiKeySpendCap.objects.filter(api_key=api_key).values_list("spend_cap", flat=True).first()


# NOTE: admission rebuilds counters in a worker thread, which sees only committed rows.
@pytest.mark.django_db(transaction=True)
def test_capping_a_key_at_zero_stops_the_keys_it_minted_before_at_the_gateway():
    organization, owner, admin = _organisation()
    parent = _mint(admin, organization, by=None)
    child = _mint(admin, organization, by=parent)
    grandchild = _mint(admin, organization, by=child, scopes=[Scope.INFERENCE])
    for api_key in (child, grandchild):
        _spend(api_key, "0.10")  # its counter is built, with no cap

    set_key_spend_cap(Actor(user=owner), parent, spend_cap=Decimal("0"))

    assert (_cap_of(child), _cap_of(grandchild)) == (Decimal("0"), Decimal("0"))
    for api_key in (parent, child, grandchild):
        with pytest.raises(QuotaExceeded) as refused:
            _spend(api_key, "0.01")
        assert refused.value.reason == "key_cap"
    audited = AuditEvent.objects.filter(action="billing.set_key_spend_cap", details__reason="minted by a capped key")
    assert sorted(audited.values_list("target_id", flat=True)) == sorted([str(child.pk), str(grandchild.pk)])


@pytest.mark.django_db
def test_a_lower_cap_of_its_own_stays_and_raising_or_removing_the_parents_cap_lifts_none():
    organization, owner, admin = _organisation()
    parent = _mint(admin, organization, by=None)
    lower, uncapped, revoked = (_mint(admin, organization, by=parent) for _ in range(3))
    set_key_spend_cap(Actor(user=owner), lower, spend_cap=Decimal("1.00"))
    revoke_api_key(Actor(user=owner), revoked)

    set_key_spend_cap(Actor(user=owner), parent, spend_cap=Decimal("3.00"))
    assert (_cap_of(lower), _cap_of(uncapped), _cap_of(revoked)) == (Decimal("1.00"), Decimal("3.00"), None)

    for raised in (Decimal("10.00"), None):
        set_key_spend_cap(Actor(user=owner), parent, spend_cap=raised)
        assert (_cap_of(lower), _cap_of(uncapped)) == (Decimal("1.00"), Decimal("3.00"))


@pytest.mark.django_db
def test_a_cap_an_owner_put_on_a_key_binds_its_minted_keys_as_the_owners():
    """The minted keys' caps are the owner's, as a cap copied at minting is: the admin who made them lowers them, and
    only an owner lifts them."""
    organization, owner, admin = _organisation()
    parent = _mint(admin, organization, by=None)
    child = _mint(admin, organization, by=parent)
    set_key_spend_cap(Actor(user=owner), parent, spend_cap=Decimal("5.00"))

    set_key_spend_cap(Actor(user=admin), child, spend_cap=Decimal("4.00"))
    with pytest.raises(NotPermitted, match="only owners may raise or remove"):
        set_key_spend_cap(Actor(user=admin), child, spend_cap=None)
    set_key_spend_cap(Actor(user=owner), child, spend_cap=None)
    assert _cap_of(child) is None


@pytest.mark.django_db(transaction=True)
def test_a_key_minted_while_its_parents_cap_is_lowered_gets_the_lower_cap(monkeypatch):
    """Before the lowering took the organisation's row first, as minting does, a key minted while it ran (after its
    walk of the minted keys, before its commit) copied the old cap: the child kept $5.00 under a parent capped at 0."""
    organization, owner, admin = _organisation()
    parent = _mint(admin, organization, by=None)
    set_key_spend_cap(Actor(user=owner), parent, spend_cap=Decimal("5.00"))
    walked, released = threading.Event(), threading.Event()
    generations = keys.minted_generations

    def walked_then_held(api_key):
        yield from generations(api_key)
        walked.set()
        released.wait(60)

    monkeypatch.setattr(keys, "minted_generations", walked_then_held)
    minted: list[ApiKey] = []

    def lower():
        try:
            set_key_spend_cap(Actor(user=owner), parent, spend_cap=Decimal("0"))
        finally:
            connection.close()

    def mint():
        try:
            minted.append(_mint(admin, organization, by=parent, scopes=[Scope.MANAGE]))
        finally:
            connection.close()

    lowering, minting = threading.Thread(target=lower), threading.Thread(target=mint)
    lowering.start()
    assert walked.wait(60)
    minting.start()
    wait_until(_waiting_on_a_lock, 60, message="the minting to wait on the lowering")
    released.set()
    for thread in (lowering, minting):
        thread.join(timeout=60)
    assert _cap_of(parent) == Decimal("0") and [_cap_of(child) for child in minted] == [Decimal("0")]
