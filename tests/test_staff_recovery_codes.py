"""Staff's recovery codes: given at enrolment, shown once, kept hashed; each passes the code page once in place of a
code from the authenticator, and the staff member replaces them all when they like
(`controlplane.accounts.recovery_codes`)."""

from __future__ import annotations

import re
from io import StringIO

import pytest
from django.core.management import call_command
from django.test import Client
from django.utils import timezone
from django_otp.plugins.otp_static.models import StaticDevice, StaticToken
from django_otp.plugins.otp_totp.models import TOTPDevice

from controlplane.accounts.models import AuditEvent
from tests.factories import (
    MembershipFactory,
    OrganizationFactory,
    UserFactory,
    enrolment_code_for,
    sign_in_staff,
    signed_in_with_the_password,
    staff_member,
    totp_code,
)

pytestmark = pytest.mark.django_db

CODE_PAGE = "/login/code/"
RECOVERY_PAGE = "/login/code/recovery/"
FLEET = "/console/fleet/"
SHOWN_CODE = re.compile(r"<code>([a-z2-7]{4}(?:-[a-z2-7]{4}){3})</code>")


@pytest.fixture
def staff():
    return staff_member()


def new_recovery_codes(user) -> list[str]:
    """The codes the recovery page makes for `user`, in a session past the second factor."""
    client = Client()
    sign_in_staff(client, user)
    response = client.post(RECOVERY_PAGE)
    assert response.status_code == 200, response
    return SHOWN_CODE.findall(response.content.decode())


def test_a_recovery_code_signs_in_once_and_says_how_many_are_left(staff):
    codes = new_recovery_codes(staff)
    first, second = signed_in_with_the_password(staff), signed_in_with_the_password(staff)

    used = first.post(CODE_PAGE, {"code": codes[3].upper().replace("-", " "), "next": FLEET}, follow=True)
    reused = second.post(CODE_PAGE, {"code": codes[3]})

    assert len(codes) == len(set(codes)) == 10
    assert used.redirect_chain[0][0] == FLEET and used.status_code == 200
    assert "You signed in with a recovery code, which no longer works; 9 left." in used.content.decode()
    assert reused.status_code == 400 and second.get(FLEET).status_code == 404
    event = AuditEvent.objects.get(action="staff.second_factor.recovery_code.use")
    assert event.actor == staff and event.details == {"num_left": 9}


def test_recovery_codes_are_kept_only_as_digests(staff):
    codes = new_recovery_codes(staff)
    stored = set(StaticToken.objects.filter(device__user=staff).values_list("token", flat=True))

    assert len(stored) == 10
    assert not stored & ({code for code in codes} | {code.replace("-", "") for code in codes})


def test_new_recovery_codes_void_the_old_ones(staff):
    old = new_recovery_codes(staff)
    new = new_recovery_codes(staff)

    assert signed_in_with_the_password(staff).post(CODE_PAGE, {"code": old[0]}).status_code == 400
    StaticDevice.objects.filter(user=staff).update(
        throttling_failure_count=0, throttling_failure_timestamp=None
    )
    assert signed_in_with_the_password(staff).post(CODE_PAGE, {"code": new[0]}).status_code == 302
    assert AuditEvent.objects.filter(action="staff.second_factor.recovery_codes.replace").count() == 2


def test_the_recovery_page_says_how_many_are_left_to_a_staff_session_past_the_second_factor_only(staff):
    codes = new_recovery_codes(staff)
    signed_in_with_the_password(staff).post(CODE_PAGE, {"code": codes[0]})
    verified = Client()
    sign_in_staff(verified, staff)
    password_only = signed_in_with_the_password(staff)
    tenant = UserFactory()
    MembershipFactory(organization=OrganizationFactory(), user=tenant)
    tenant_client = Client()
    tenant_client.force_login(tenant)

    page = verified.get(RECOVERY_PAGE).content.decode()
    assert re.search(r"<strong>9</strong> unused recovery codes", page)
    assert password_only.post(RECOVERY_PAGE)["Location"].startswith(CODE_PAGE)
    assert tenant_client.get(RECOVERY_PAGE).status_code == 404
    assert signed_in_with_the_password(staff).post(CODE_PAGE, {"code": codes[1]}).status_code == 302


def test_wrong_recovery_codes_are_refused_audited_and_slow_down_the_right_ones(staff, monkeypatch):
    codes = new_recovery_codes(staff)
    frozen = timezone.now()  # django-otp's 1 s backoff must not lapse between the two posts on a loaded machine
    monkeypatch.setattr(timezone, "now", lambda: frozen)
    client = signed_in_with_the_password(staff)

    wrong = client.post(CODE_PAGE, {"code": "aaaa-bbbb-cccc-dddd"})
    right_too_soon = client.post(CODE_PAGE, {"code": codes[0]})

    assert wrong.status_code == 400
    assert right_too_soon.status_code == 429 and int(right_too_soon["Retry-After"]) >= 1
    assert client.get(FLEET).status_code == 404
    refused = AuditEvent.objects.filter(action="staff.second_factor.refuse", details__recovery_code=True)
    assert sorted(refused.values_list("details__reason", flat=True)) == ["throttled", "wrong"]


def test_posting_recovery_codes_is_limited_per_user(staff):
    codes = new_recovery_codes(staff)
    client = signed_in_with_the_password(staff)
    for _ in range(10):
        client.post(CODE_PAGE, {"code": "aaaa-bbbb-cccc-dddd"})

    assert client.post(CODE_PAGE, {"code": codes[0]}).status_code == 429


def test_a_confirmed_enrolment_shows_ten_recovery_codes_once_and_they_work(staff):
    client = signed_in_with_the_password(staff)
    client.post("/login/code/enrol/", {"enrolment_code": enrolment_code_for(staff)})
    device = TOTPDevice.objects.get(user=staff, confirmed=False)

    enrolled = client.post("/login/code/enrol/", {"code": totp_code(device)}).content.decode()
    codes = SHOWN_CODE.findall(enrolled)

    assert len(set(codes)) == 10 and "only time they are shown" in enrolled
    assert not SHOWN_CODE.search(client.get(RECOVERY_PAGE).content.decode())
    assert signed_in_with_the_password(staff).post(CODE_PAGE, {"code": codes[9]}).status_code == 302


def test_the_operators_reset_voids_the_recovery_codes_and_the_sessions_they_verified(staff):
    codes = new_recovery_codes(staff)
    client = signed_in_with_the_password(staff)
    assert client.post(CODE_PAGE, {"code": codes[0]}).status_code == 302
    assert client.get(FLEET).status_code == 200

    call_command("reset_staff_second_factor", staff.email, stdout=StringIO())

    assert client.get(FLEET).status_code == 404
    assert (
        signed_in_with_the_password(staff)
        .post(CODE_PAGE, {"code": codes[1]})["Location"]
        .startswith("/login/code/enrol/")
    )
    assert AuditEvent.objects.get(action="staff.second_factor.reset").details["num_recovery_codes"] == 9
