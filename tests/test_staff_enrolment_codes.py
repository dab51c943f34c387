"""A staff account's first authenticator (or its next, after an operator's reset) takes more than the password: an
enrolment code mailed to the account or printed by the operator's command, taken once, within 30 minutes
(`controlplane.accounts.enrolment_codes`)."""

from __future__ import annotations

import re
from datetime import timedelta
from io import StringIO

import pytest
from django.core import mail
from django.core.management import call_command
from django.utils import timezone
from django_otp.plugins.otp_totp.models import TOTPDevice

from controlplane.accounts.models import AuditEvent, StaffEnrolmentCode
from tests.factories import enrolment_code_for, signed_in_with_the_password, staff_member, totp_code

pytestmark = pytest.mark.django_db

ENROL_PAGE = "/login/code/enrol/"
EMAIL_A_CODE = "/login/code/enrol/email/"
FLEET = "/console/fleet/"
CODE_SHAPE = re.compile(r"^[a-z2-7]{4}(-[a-z2-7]{4}){3}$", re.MULTILINE)


@pytest.fixture
def staff():
    return staff_member()


def mailed_code() -> str:
    return CODE_SHAPE.search(mail.outbox[-1].body).group()


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


def test_a_code_mailed_to_the_staff_member_lets_them_enrol_and_only_its_digest_is_kept(staff):
    client = signed_in_with_the_password(staff)

    assert client.post(EMAIL_A_CODE)["Location"].startswith(ENROL_PAGE)
    assert len(mail.outbox) == 1 and mail.outbox[0].to == ["ops@example.test"]
    code = mailed_code()
    assert not AuditEvent.objects.filter(details__icontains=code.replace("-", "")).exists()
    stored = StaffEnrolmentCode.objects.get(user=staff)
    assert code not in stored.digest and code.replace("-", "") not in stored.digest
    assert stored.expires_at - stored.created_at == timedelta(minutes=30)

    assert client.post(ENROL_PAGE, {"enrolment_code": code.upper().replace("-", " ")}).status_code == 302
    device = TOTPDevice.objects.get(user=staff, confirmed=False)
    assert "otpauth://" in client.get(ENROL_PAGE).content.decode()
    assert client.post(ENROL_PAGE, {"code": totp_code(device)}).status_code == 200

    assert client.get(FLEET).status_code == 200
    actions = set(AuditEvent.objects.filter(actor=staff).values_list("action", flat=True))
    assert {"staff.second_factor.enrolment_code.accept", "staff.second_factor.enrol"} <= actions
    assert AuditEvent.objects.get(action="staff.second_factor.enrolment_code.issue").details == {
        "channel": "email"
    }


def test_the_operators_reset_prints_a_code_that_enrols_once_and_never_twice(staff):
    TOTPDevice.objects.create(user=staff, name="lost phone", confirmed=True)
    assert signed_in_with_the_password(staff).post(EMAIL_A_CODE).status_code == 302
    assert mail.outbox == []  # an account with a device is mailed no code
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


def test_mailing_enrolment_codes_is_limited_per_user_so_a_leaked_password_cannot_flood_the_mailbox(staff):
    client = signed_in_with_the_password(staff)

    statuses = [client.post(EMAIL_A_CODE).status_code for _ in range(4)]

    assert statuses == [302, 302, 302, 429] and len(mail.outbox) == 3


def test_the_reset_command_prints_the_code_and_says_for_how_long(staff):
    printed = StringIO()
    call_command("reset_staff_second_factor", staff.email, stdout=printed)

    assert CODE_SHAPE.search(printed.getvalue()) and "30 minutes" in printed.getvalue()
    event = AuditEvent.objects.get(action="staff.second_factor.enrolment_code.issue")
    assert event.details == {"channel": "operator"} and event.target_id == str(staff.pk)
