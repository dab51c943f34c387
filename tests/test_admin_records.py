"""The Django admin changes nothing behind the services' backs: prices staff set are audited and told to the tenant,
a user staff deactivate or delete loses their keys, and the records the platform keeps (hourly rollups, spend
alerts, replicas, the endpoint's log) are staff's to read, never to add, edit or delete."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from billing.models import SpendAlert, UsageRollup
from controlplane.accounts.invitations import InvitationRefused, accept_invitation, invite_member
from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import ApiKey, AuditEvent, Invitation, Role, Scope
from controlplane.accounts.services import Actor
from endpoints.models import EndpointEvent, EventKind, Replica
from tests.factories import EndpointFactory, MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db


def test_prices_staff_set_on_an_endpoint_are_audited_and_told_to_its_owner(staff_client):
    # Before, the admin saved the prices as a plain form: no audit event, and nothing on the endpoint's log, so a
    # customer's price could change with no record of who changed it or when.
    endpoint = EndpointFactory(price_input_per_million=Decimal("0.6"), price_output_per_million=Decimal("1.8"))
    saved = staff_client.post(f"/django-admin/endpoints/endpoint/{endpoint.pk}/change/", {
        "price_input_per_million": "0.6", "price_cached_input_per_million": str(endpoint.price_cached_input_per_million),
        "price_output_per_million": "2.4", "batch_price_fraction": str(endpoint.batch_price_fraction)})
    assert saved.status_code == 302, saved.content.decode()[:500]

    audit = AuditEvent.objects.get(action="endpoint.prices")
    assert audit.organization_id == endpoint.organization_id and audit.target_id == str(endpoint.pk)
    assert audit.details["changes"] == {"price_output_per_million": {"from": "1.800000", "to": "2.400000"}}
    event = EndpointEvent.objects.get(endpoint=endpoint, kind=EventKind.CONFIG, message__startswith="Prices changed")
    assert "price_output_per_million" in event.message and "2.4" in event.message
    # Saved with nothing changed: nothing recorded.
    staff_client.post(f"/django-admin/endpoints/endpoint/{endpoint.pk}/change/", {
        "price_input_per_million": "0.6", "price_cached_input_per_million": str(endpoint.price_cached_input_per_million),
        "price_output_per_million": "2.4", "batch_price_fraction": str(endpoint.batch_price_fraction)})
    assert AuditEvent.objects.filter(action="endpoint.prices").count() == 1


def test_the_platforms_records_are_read_only_in_the_admin(staff_client):
    # Before, staff could add a made-up rollup (pushed to Stripe and billed), delete one, edit or delete a spend alert
    # (an alert suppressed or sent twice), and delete a replica (its GPU-seconds gone from the cost record) or an
    # event from a customer's endpoint log, none of it audited.
    endpoint = EndpointFactory()
    now = timezone.now().replace(minute=0, second=0, microsecond=0)
    rollup = UsageRollup.objects.create(organization=endpoint.organization, endpoint_id=endpoint.pk,
                                        hour_start=now - timedelta(hours=2), cost=Decimal("1.5"), num_requests=3)
    alert = SpendAlert.objects.create(organization=endpoint.organization, period_start=now.replace(day=1),
                                      threshold_percent=50, spend=Decimal("5"), spend_cap=Decimal("10"))
    replica = Replica.objects.create(endpoint=endpoint)
    event = EndpointEvent.objects.create(endpoint=endpoint, kind=EventKind.SCALE, message="Scale up 0 → 1")

    answers = {
        "rollup add": staff_client.post("/django-admin/billing/usagerollup/add/", {}).status_code,
        "rollup delete": staff_client.post(f"/django-admin/billing/usagerollup/{rollup.pk}/delete/", {"post": "yes"}).status_code,
        "alert add": staff_client.post("/django-admin/billing/spendalert/add/", {}).status_code,
        "alert change": staff_client.post(f"/django-admin/billing/spendalert/{alert.pk}/change/", {
            "organization": endpoint.organization_id, "period_start_0": "", "period_start_1": "",
            "threshold_percent": 80, "spend": "5", "spend_cap": "10"}).status_code,
        "alert delete": staff_client.post(f"/django-admin/billing/spendalert/{alert.pk}/delete/", {"post": "yes"}).status_code,
        "replica delete": staff_client.post(f"/django-admin/endpoints/replica/{replica.pk}/delete/", {"post": "yes"}).status_code,
        "event add": staff_client.post("/django-admin/endpoints/endpointevent/add/", {}).status_code,
        "event delete": staff_client.post(f"/django-admin/endpoints/endpointevent/{event.pk}/delete/", {"post": "yes"}).status_code,
    }

    assert answers == dict.fromkeys(answers, 403)
    assert UsageRollup.objects.filter(pk=rollup.pk).exists() and UsageRollup.objects.count() == 1
    assert SpendAlert.objects.get(pk=alert.pk).threshold_percent == 50
    assert Replica.objects.filter(pk=replica.pk).exists() and EndpointEvent.objects.filter(pk=event.pk).exists()
    for page in ("billing/usagerollup", "billing/spendalert", "endpoints/replica", "endpoints/endpointevent"):
        assert staff_client.get(f"/django-admin/{page}/").status_code == 200  # still staff's to read


def _keys_in_two_organisations(user) -> list[ApiKey]:
    made = []
    for membership in (MembershipFactory(user=user, role=Role.OWNER), MembershipFactory(user=user, role=Role.MEMBER)):
        made.append(create_api_key(Actor(user=user), membership.organization, name="k", scopes=[Scope.INFERENCE]).api_key)
    return made


def test_a_user_staff_deactivate_loses_every_key_they_made_audited_and_reactivating_brings_none_back(staff_client):
    """Before, an inactive creator's keys were only refused: reactivated, the account had every key back."""
    user = UserFactory()
    made = _keys_in_two_organisations(user)
    joined = user.date_joined
    response = staff_client.post(reverse("admin:auth_user_change", args=[user.pk]), {
        "username": user.username, "email": user.email, "first_name": "", "last_name": "",
        "date_joined_0": joined.strftime("%Y-%m-%d"), "date_joined_1": joined.strftime("%H:%M:%S"),
    })  # is_active left out: unticked
    assert response.status_code == 302, response.content.decode()[:2000]
    user.refresh_from_db()
    assert not user.is_active
    assert all(ApiKey.objects.get(pk=key.pk).revoked_at is not None for key in made)
    events = AuditEvent.objects.filter(action="api_key.revoke")
    assert sorted((event.organization_id, event.details["reason"]) for event in events) == sorted(
        (key.organization_id, "user.deactivate") for key in made)


def test_a_user_staff_delete_has_their_keys_revoked_first(staff_client):
    user = UserFactory()
    made = _keys_in_two_organisations(user)
    response = staff_client.post(reverse("admin:auth_user_delete", args=[user.pk]), {"post": "yes"})
    assert response.status_code == 302
    assert all(ApiKey.objects.get(pk=key.pk).revoked_at is not None for key in made)


@pytest.mark.parametrize("change", ["deactivate", "delete"])
def test_a_user_staff_deactivate_or_delete_has_their_pending_invitations_revoked(staff_client, change):
    """Before, a deleted user's pending invitations lost their sender (`invited_by` set to null) and were taken for
    the platform's own, granting their role to whoever held the address, owner included; a deactivated one's were
    refused only until the account came back."""
    user = UserFactory()
    membership = MembershipFactory(user=user, role=Role.OWNER)
    organization = membership.organization
    # NOTE: another owner keeps the organisation open once the user goes: the invitations are revoked as theirs
    MembershipFactory(organization=organization, role=Role.OWNER)
    invitation = invite_member(Actor(user=user), organization, email="second@rogue.example", role=Role.OWNER)
    if change == "delete":
        response = staff_client.post(reverse("admin:auth_user_delete", args=[user.pk]), {"post": "yes"})
    else:
        joined = user.date_joined
        response = staff_client.post(reverse("admin:auth_user_change", args=[user.pk]), {
            "username": user.username, "email": user.email, "first_name": "", "last_name": "",
            "date_joined_0": joined.strftime("%Y-%m-%d"), "date_joined_1": joined.strftime("%H:%M:%S"),
        })  # is_active left out: unticked
    assert response.status_code == 302

    second = UserFactory(username="second@rogue.example")
    with pytest.raises(InvitationRefused, match="revoked"):
        accept_invitation(Actor(user=second), Invitation.objects.get(pk=invitation.pk))
    assert not organization.memberships.filter(user=second).exists()
    event = AuditEvent.objects.get(action="invitation.revoke", target_id=str(invitation.pk))
    assert event.details == {"email": "second@rogue.example", "reason": f"user.{change}"}
