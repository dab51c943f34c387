"""Every change staff make in the Django admin is in the audit log, naming them: who may sign in and with what
powers (accounts, groups), keys revoked and accounts deactivated as the platform, the catalogue's patterns, an
operator's decisions on held rollups; and what only its owner module changes (a replica, staff's authenticators and
recovery codes) cannot be changed there."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.contrib.auth.models import Group, Permission
from django.urls import reverse
from django.utils import timezone
from django_otp.plugins.otp_static.models import StaticDevice
from django_otp.plugins.otp_totp.models import TOTPDevice

from billing import stripe_sync
from billing.models import MeterEventPush, UsageRollup
from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import ApiKey, AuditEvent, Role, Scope
from controlplane.accounts.services import Actor
from endpoints.models import AllowedSource, Replica
from gpu_agent.protocol import ReplicaState
from tests.factories import EndpointFactory, MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db


def _user_form(user, **changes) -> dict:
    """The user's change page as posted, its boxes ticked as `user` has them, with `changes`."""
    form = {"username": user.username, "email": user.email, "first_name": user.first_name,
            "last_name": user.last_name}
    form |= {flag: "on" for flag in ("is_active", "is_staff", "is_superuser") if getattr(user, flag)}
    return {key: value for key, value in (form | changes).items() if value is not None}


def test_an_account_made_staff_and_superuser_in_the_admin_is_audited_naming_who_did_it(staff_client):
    # Before, granting staff powers here left no audit event: only Django's own admin history said so.
    user = UserFactory()
    permission = Permission.objects.get(codename="change_plan")
    response = staff_client.post(reverse("admin:auth_user_change", args=[user.pk]), _user_form(
        user, is_staff="on", is_superuser="on", user_permissions=[permission.pk]))
    assert response.status_code == 302, response.content.decode()[:2000]

    event = AuditEvent.objects.get(action="user.update", target_id=str(user.pk))
    assert event.actor == staff_client.staff and event.organization is None
    assert event.details["changes"] == {
        "is_staff": {"from": False, "to": True}, "is_superuser": {"from": False, "to": True},
        "user_permissions": {"from": [], "to": [str(permission)]}}


def test_an_account_reactivated_in_the_admin_is_audited(staff_client):
    user = UserFactory(is_active=False)
    response = staff_client.post(reverse("admin:auth_user_change", args=[user.pk]), _user_form(user, is_active="on"))
    assert response.status_code == 302, response.content.decode()[:2000]

    event = AuditEvent.objects.get(action="user.update", target_id=str(user.pk))
    assert event.actor == staff_client.staff and event.details["changes"] == {"is_active": {"from": False, "to": True}}


def test_an_account_staff_add_and_a_password_staff_set_in_the_admin_are_audited(staff_client):
    added = staff_client.post(reverse("admin:auth_user_add"), {
        "username": "new@example.test", "usable_password": "true",
        "password1": "a long passphrase 1", "password2": "a long passphrase 1"})
    assert added.status_code == 302, added.content.decode()[:2000]
    user = UserFactory._meta.model.objects.get(username="new@example.test")
    assert AuditEvent.objects.get(action="user.create", target_id=str(user.pk)).actor == staff_client.staff

    changed = staff_client.post(reverse("admin:auth_user_password_change", args=[user.pk]), {
        "usable_password": "true", "password1": "another passphrase 2", "password2": "another passphrase 2"})
    assert changed.status_code == 302, changed.content.decode()[:2000]
    event = AuditEvent.objects.get(action="user.set_password", target_id=str(user.pk))
    assert event.actor == staff_client.staff and event.details == {"usable": True}


def test_a_key_staff_revoke_in_the_admin_is_audited_naming_them(staff_client):
    # Before, staff revoked as the platform and the event named nobody.
    owner = MembershipFactory(role=Role.OWNER)
    key = create_api_key(Actor(user=owner.user), owner.organization, name="k", scopes=[Scope.INFERENCE]).api_key
    response = staff_client.post(reverse("admin:controlplane_apikey_changelist"), {
        "action": "revoke", "_selected_action": [key.pk]})
    assert response.status_code == 302

    assert ApiKey.objects.get(pk=key.pk).revoked_at is not None
    event = AuditEvent.objects.get(action="api_key.revoke", target_id=str(key.pk))
    assert event.actor == staff_client.staff and event.organization_id == owner.organization_id


def test_keys_revoked_with_an_account_staff_deactivate_are_audited_naming_them(staff_client):
    member = MembershipFactory(role=Role.MEMBER)
    key = create_api_key(Actor(user=member.user), member.organization, name="k", scopes=[Scope.INFERENCE]).api_key
    response = staff_client.post(reverse("admin:auth_user_change", args=[member.user.pk]),
                                 _user_form(member.user, is_active=None))
    assert response.status_code == 302, response.content.decode()[:2000]

    event = AuditEvent.objects.get(action="api_key.revoke", target_id=str(key.pk))
    assert event.actor == staff_client.staff and event.details == {"reason": "user.deactivate"}


def _held_rollup(endpoint, *, push_error: str, hours_ago: int = 2) -> UsageRollup:
    hour = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=hours_ago)
    return UsageRollup.objects.create(
        organization=endpoint.organization, endpoint_id=endpoint.pk, hour_start=hour, cost=Decimal("1.5"),
        num_requests=3, prompt_tokens=100, completion_tokens=20, closed_at=timezone.now(),
        push_held_at=timezone.now(), push_error=push_error)


@pytest.mark.parametrize(("action", "audited"), [("release_held", "billing.held_usage_released"),
                                                 ("confirm_held", "billing.held_usage_confirmed"),
                                                 ("send_held_as_new", "billing.held_usage_sent_as_new")])
def test_an_operators_decision_on_a_held_rollup_is_audited_naming_them(staff_client, action, audited):
    # Before, releasing, confirming or sending again a held rollup decided what the customer is billed (confirmed:
    # recorded as in Stripe, and billed by nothing else) with no audit event.
    endpoint = EndpointFactory()
    rollup = _held_rollup(endpoint, push_error=f"held: {stripe_sync._DUPLICATE_HOLD}")
    response = staff_client.post(reverse("admin:billing_usagerollup_changelist"), {
        "action": action, "_selected_action": [rollup.pk]})
    assert response.status_code == 302

    rollup.refresh_from_db()
    assert rollup.push_held_at is None
    event = AuditEvent.objects.get(action=audited)
    assert event.actor == staff_client.staff and event.organization_id == endpoint.organization_id
    assert event.details == {"rollups": [rollup.pk]}
    if action == "confirm_held":
        assert MeterEventPush.objects.filter(rollup=rollup).exists()


def test_a_held_rollup_another_run_released_first_is_audited_once(staff_client):
    endpoint = EndpointFactory()
    rollup = _held_rollup(endpoint, push_error="held: is it in Stripe?")
    assert stripe_sync.release_held(UsageRollup.objects.filter(pk=rollup.pk)) == 1
    assert stripe_sync.release_held(UsageRollup.objects.filter(pk=rollup.pk)) == 0
    assert AuditEvent.objects.filter(action="billing.held_usage_released").count() == 1


def test_a_catalogue_pattern_changed_in_the_admin_is_audited_with_what_it_was(staff_client):
    # Before, its event named only the new pattern: a widened one hid what it had allowed before.
    source = AllowedSource.objects.create(pattern="hf:public-org/", description="public")
    response = staff_client.post(reverse("admin:endpoints_allowedsource_change", args=[source.pk]), {
        "pattern": "hf:meta-llama/", "description": "public"})
    assert response.status_code == 302, response.content.decode()[:2000]

    event = AuditEvent.objects.get(action="catalogue.update")
    assert event.actor == staff_client.staff
    assert event.details == {"changes": {"pattern": {"from": "hf:public-org/", "to": "hf:meta-llama/"}}}


def test_a_replicas_page_in_the_admin_cannot_be_saved_over_its_state(staff_client):
    # Before, every field was read-only and yet saving the page wrote the whole row back, past `endpoints.replicas`.
    replica = Replica.objects.create(endpoint=EndpointFactory(), state=ReplicaState.READY)
    url = reverse("admin:endpoints_replica_change", args=[replica.pk])

    assert staff_client.get(url).status_code == 200  # still staff's to read
    assert staff_client.post(url, {}).status_code == 403


def test_staff_cannot_give_an_account_an_authenticator_of_their_choosing_in_the_admin(staff_client):
    # Before, django-otp's own admin added a confirmed device with a key staff chose to any account (another staff
    # member's, one about to be made staff), past the enrolment codes and with no audit event.
    colleague = UserFactory(is_staff=True, is_superuser=True)
    response = staff_client.post(reverse("admin:otp_totp_totpdevice_add"), {
        "user": colleague.pk, "name": "mine now", "confirmed": "on", "key": "3132333435363738393031323334353637383930",
        "step": 30, "t0": 0, "digits": 6, "tolerance": 1, "drift": 0, "throttling_failure_count": 0})

    assert response.status_code == 403
    assert not TOTPDevice.objects.filter(user=colleague).exists()


def test_staff_cannot_move_or_delete_an_authenticator_or_recovery_codes_in_the_admin(staff_client):
    colleague = UserFactory(is_staff=True, is_superuser=True)
    device = TOTPDevice.objects.create(user=colleague, name="phone", confirmed=True)
    codes = StaticDevice.objects.create(user=colleague, name="recovery", confirmed=True)
    answers = {
        "move": staff_client.post(reverse("admin:otp_totp_totpdevice_change", args=[device.pk]), {
            "user": staff_client.staff.pk, "name": "phone", "confirmed": "on", "step": 30, "t0": 0, "digits": 6,
            "tolerance": 1, "drift": 0, "throttling_failure_count": 0}).status_code,
        "delete": staff_client.post(reverse("admin:otp_totp_totpdevice_delete", args=[device.pk]),
                                    {"post": "yes"}).status_code,
        "delete codes": staff_client.post(reverse("admin:otp_static_staticdevice_delete", args=[codes.pk]),
                                          {"post": "yes"}).status_code,
    }

    assert answers == dict.fromkeys(answers, 403)
    assert TOTPDevice.objects.get(pk=device.pk).user == colleague and StaticDevice.objects.filter(pk=codes.pk).exists()
    assert staff_client.get(reverse("admin:otp_totp_totpdevice_change", args=[device.pk])).status_code == 200


def test_a_permission_given_to_a_group_in_the_admin_is_audited(staff_client):
    # A group's members hold its permissions in the admin: before, a permission added to one left no audit event.
    group = Group.objects.create(name="support")
    permission = Permission.objects.get(codename="change_billingaccount")
    response = staff_client.post(reverse("admin:auth_group_change", args=[group.pk]), {
        "name": "support", "permissions": [permission.pk]})
    assert response.status_code == 302, response.content.decode()[:2000]

    event = AuditEvent.objects.get(action="group.update", target_id=str(group.pk))
    assert event.actor == staff_client.staff
    assert event.details == {"permissions": {"from": [], "to": [str(permission)]}}
