"""A staff account's first authenticator (or its next, after an operator's reset) takes more than the password: an
enrolment code printed by the operator's command or issued in the admin by a staff member who passed their own
second factor, taken once, within 30 minutes (`controlplane.accounts.enrolment_codes`). None is ever mailed: the
password and the mailbox are what one phishing page takes together."""

from __future__ import annotations

import importlib
import re
from datetime import timedelta
from io import StringIO

import pytest
from django.apps import apps
from django.core import mail
from django.core.management import call_command
from django.test import Client
from django.utils import timezone
from django_otp.plugins.otp_totp.models import TOTPDevice

from controlplane import tokens
from controlplane.accounts import second_factor
from controlplane.accounts.models import AuditEvent, StaffEnrolmentCode
from controlplane.accounts.services import Actor
from tests.factories import (
    UserFactory,
    enrolment_code_for,
    sign_in_staff,
    signed_in_with_the_password,
    staff_member,
    totp_code,
)

pytestmark = pytest.mark.django_db

ENROL_PAGE = "/login/code/enrol/"
THE_OLD_MAIL_ADDRESS = "/login/code/enrol/email/"
FLEET = "/console/fleet/"
ADMIN_USERS = "/django-admin/auth/user/"
CODE_SHAPE = re.compile(r"^[a-z2-7]{4}(-[a-z2-7]{4}){3}$", re.MULTILINE)


@pytest.fixture
def staff():
    return staff_member()


def issued_in_the_admin(client, *users) -> Client:
    return client.post(
        ADMIN_USERS, {"action": "issue_enrolment_code", "_selected_action": [u.pk for u in users]}
    )


def a_mailed_code(user) -> str:
    """A code as the enrol page mailed them before mailing stopped (its row is what it left behind)."""
    plain = tokens.issue_typed_code()
    now = timezone.now()
    StaffEnrolmentCode.objects.create(
        user=user,
        digest=tokens.typed_code_digest(plain),
        channel="email",
        created_at=now,
        expires_at=now + timedelta(minutes=30),
    )
    return plain


def refusals(reason: str) -> int:
    return AuditEvent.objects.filter(
        action="staff.second_factor.enrolment_code.refuse", details__reason=reason
    ).count()


def test_a_staff_account_without_a_device_cannot_enrol_one_with_its_password_alone(staff):
    client = signed_in_with_the_password(staff)

    page = client.get(ENROL_PAGE).content.decode()
    for pending in TOTPDevice.objects.filter(user=staff):  # whatever device the password could have seen
        client.post(ENROL_PAGE, {"code": totp_code(pending)})

    assert "otpauth://" not in page and 'data-testid="enrolment-code"' in page
    assert not TOTPDevice.objects.filter(user=staff, confirmed=True).exists()
    assert client.get(FLEET).status_code == 404
    assert client.post(ENROL_PAGE, {"enrolment_code": "aaaa-bbbb-cccc-dddd"}).status_code == 400
    assert refusals("wrong") == 1


def test_a_staff_account_without_a_device_is_offered_no_mailed_code_and_none_is_mailed(staff):
    client = signed_in_with_the_password(staff)

    page = client.get(ENROL_PAGE).content.decode()
    asked = client.post(THE_OLD_MAIL_ADDRESS)

    assert "Email me a code" not in page and "enrol/email" not in page
    assert asked.status_code == 404
    assert mail.outbox == [] and not StaffEnrolmentCode.objects.exists()


def test_a_code_mailed_before_mailing_stopped_enrols_no_device(staff):
    code = a_mailed_code(staff)
    client = signed_in_with_the_password(staff)

    assert client.post(ENROL_PAGE, {"enrolment_code": code}).status_code == 400
    assert "otpauth://" not in client.get(ENROL_PAGE).content.decode()
    assert not TOTPDevice.objects.filter(user=staff).exists()
    assert refusals("mailed") == 1


def test_the_migration_voids_the_mailed_codes_never_taken_and_keeps_the_record_of_those_taken(staff):
    a_mailed_code(staff)
    taken = StaffEnrolmentCode.objects.get()
    a_mailed_code(staff)
    StaffEnrolmentCode.objects.filter(pk=taken.pk).update(used_at=timezone.now())
    operators = enrolment_code_for(staff_member("other@example.test"))

    migration = importlib.import_module("controlplane.accounts.migrations.0008_staff_enrolment_code_channels")
    migration.void_mailed_codes(apps, None)

    assert list(StaffEnrolmentCode.objects.filter(channel="email").values_list("pk", flat=True)) == [taken.pk]
    assert StaffEnrolmentCode.objects.filter(digest=tokens.typed_code_digest(operators)).exists()


def test_a_code_a_verified_staff_member_issues_in_the_admin_enrols_the_new_account_and_only_its_digest_is_kept(
    staff,
):
    lead = staff_member("lead@example.test")
    admin = Client()
    sign_in_staff(admin, lead)

    issued = issued_in_the_admin(admin, staff)

    assert issued.status_code == 200 and "no-store" in issued["Cache-Control"]
    code = re.search(r"<code>([a-z2-7-]+)</code>", issued.content.decode()).group(1)
    assert CODE_SHAPE.match(code)
    assert mail.outbox == []
    stored = StaffEnrolmentCode.objects.get(user=staff)
    assert stored.channel == "staff" and code.replace("-", "") not in stored.digest
    assert stored.expires_at - stored.created_at == timedelta(minutes=30)
    issue = AuditEvent.objects.get(action="staff.second_factor.enrolment_code.issue")
    assert (issue.actor, issue.target_id, issue.details) == (lead, str(staff.pk), {"channel": "staff"})
    assert not AuditEvent.objects.filter(details__icontains=code.replace("-", "")).exists()

    client = signed_in_with_the_password(staff)
    assert client.post(ENROL_PAGE, {"enrolment_code": code.upper().replace("-", " ")}).status_code == 302
    device = TOTPDevice.objects.get(user=staff, confirmed=False)
    assert client.post(ENROL_PAGE, {"code": totp_code(device)}).status_code == 200
    assert client.get(FLEET).status_code == 200
    accept = AuditEvent.objects.get(action="staff.second_factor.enrolment_code.accept")
    assert (accept.actor, accept.details) == (staff, {"channel": "staff"})


def test_the_admin_issues_no_code_for_a_tenant_or_an_account_that_has_a_device(staff):
    lead = staff_member("lead@example.test")
    admin = Client()
    sign_in_staff(admin, lead)
    tenant = UserFactory(username="tenant@example.test")

    refused = issued_in_the_admin(admin, lead, tenant)

    assert refused.status_code == 302
    warnings = [str(m) for m in admin.get(refused["Location"]).context["messages"]]
    assert any("already has an authenticator" in w for w in warnings)
    assert any("not an active staff account" in w for w in warnings)
    assert not StaffEnrolmentCode.objects.exists()
    assert not AuditEvent.objects.filter(action="staff.second_factor.enrolment_code.issue").exists()


def test_only_a_staff_member_past_their_own_second_factor_issues_a_code(staff):
    lead = staff_member("lead@example.test")
    TOTPDevice.objects.create(user=lead, name="phone", confirmed=True)
    unverified = signed_in_with_the_password(lead)

    assert issued_in_the_admin(unverified, staff).status_code == 302  # to the log-in
    with pytest.raises(second_factor.EnrolmentCodeRefused):
        second_factor.issue_staff_enrolment_code(Actor(user=lead), staff)
    with pytest.raises(second_factor.EnrolmentCodeRefused):
        second_factor.issue_staff_enrolment_code(Actor(), staff)
    assert not StaffEnrolmentCode.objects.exists()


def test_a_tenant_is_never_asked_for_an_enrolment_code():
    tenant = UserFactory(username="tenant@example.test")
    client = signed_in_with_the_password(tenant)

    assert client.get(ENROL_PAGE)["Location"] == "/console/"
    assert client.post(ENROL_PAGE, {"enrolment_code": "aaaa-bbbb-cccc-dddd"}).status_code == 302
    assert mail.outbox == [] and not StaffEnrolmentCode.objects.exists()
    assert not TOTPDevice.objects.filter(user=tenant).exists()


def test_the_operators_reset_prints_a_code_that_enrols_once_and_never_twice(staff):
    TOTPDevice.objects.create(user=staff, name="lost phone", confirmed=True)
    code = enrolment_code_for(staff)
    first, second = signed_in_with_the_password(staff), signed_in_with_the_password(staff)

    assert first.post(ENROL_PAGE, {"enrolment_code": code}).status_code == 302
    reused = second.post(ENROL_PAGE, {"enrolment_code": code})

    assert reused.status_code == 400 and "already used" in reused.content.decode()
    assert "otpauth://" not in second.get(ENROL_PAGE).content.decode()
    assert refusals("used") == 1
    device = TOTPDevice.objects.get(user=staff, confirmed=False)
    assert first.post(ENROL_PAGE, {"code": totp_code(device)}).status_code == 200
    assert first.get(FLEET).status_code == 200 and second.get(FLEET).status_code == 404
    accept = AuditEvent.objects.get(action="staff.second_factor.enrolment_code.accept")
    assert accept.details == {"channel": "operator"}


def test_an_enrolment_code_is_refused_thirty_minutes_after_it_was_issued(staff, monkeypatch):
    code = enrolment_code_for(staff)
    client = signed_in_with_the_password(staff)
    issued_at = timezone.now()
    monkeypatch.setattr(timezone, "now", lambda: issued_at + timedelta(minutes=30, seconds=1))

    assert client.post(ENROL_PAGE, {"enrolment_code": code}).status_code == 400
    assert "otpauth://" not in client.get(ENROL_PAGE).content.decode()
    assert refusals("expired") == 1


def test_a_taken_code_lets_its_session_enrol_for_thirty_minutes_only(staff, monkeypatch):
    client = signed_in_with_the_password(staff)
    assert client.post(ENROL_PAGE, {"enrolment_code": enrolment_code_for(staff)}).status_code == 302
    device = TOTPDevice.objects.get(user=staff, confirmed=False)
    taken_at = timezone.now()
    monkeypatch.setattr(timezone, "now", lambda: taken_at + timedelta(minutes=30, seconds=1))

    assert "otpauth://" not in client.get(ENROL_PAGE).content.decode()
    assert client.post(ENROL_PAGE, {"code": totp_code(device)}).status_code == 400
    assert not TOTPDevice.objects.filter(user=staff, confirmed=True).exists()


def test_a_secret_shown_before_the_code_was_taken_is_never_the_one_enrolled(staff):
    seen = TOTPDevice.objects.create(user=staff, name="authenticator", confirmed=False)
    client = signed_in_with_the_password(staff)

    client.post(ENROL_PAGE, {"enrolment_code": enrolment_code_for(staff)})

    enrolling = TOTPDevice.objects.get(user=staff, confirmed=False)
    assert enrolling.pk != seen.pk and enrolling.key != seen.key
    assert client.post(ENROL_PAGE, {"code": totp_code(seen)}).status_code == 400


def test_taking_enrolment_codes_is_limited_per_user(staff):
    code = enrolment_code_for(staff)
    client = signed_in_with_the_password(staff)

    statuses = [
        client.post(ENROL_PAGE, {"enrolment_code": "aaaa-bbbb-cccc-dddd"}).status_code for _ in range(11)
    ]

    assert statuses[:10] == [400] * 10 and statuses[-1] == 429
    assert client.post(ENROL_PAGE, {"enrolment_code": code}).status_code == 429
    assert refusals("wrong") == 10


def test_the_reset_command_prints_the_code_and_says_for_how_long(staff):
    printed = StringIO()
    call_command("reset_staff_second_factor", staff.email, stdout=printed)

    assert CODE_SHAPE.search(printed.getvalue()) and "30 minutes" in printed.getvalue()
    event = AuditEvent.objects.get(action="staff.second_factor.enrolment_code.issue")
    # the operating-system account that ran the command is named too (`tests/test_shell_audit.py`)
    assert event.details == {"channel": "operator", "operator": event.details["operator"]}
    assert event.target_id == str(staff.pk)
