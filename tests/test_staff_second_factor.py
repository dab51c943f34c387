"""Staff's second factor: a staff account's password alone opens no staff page, no admin and no pool API;
a code from its confirmed TOTP device, entered in this session, does (`controlplane.accounts.second_factor`)."""

from __future__ import annotations

import time
from base64 import b32encode
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.auth import login
from django.contrib.sessions.backends.db import SessionStore
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.utils import timezone
from django_otp import DEVICE_ID_SESSION_KEY
from django_otp.plugins.otp_totp.models import TOTPDevice

from controlplane import demo
from controlplane.accounts import staff_sessions
from controlplane.accounts.models import AuditEvent, Role
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

PASSWORD = "correct horse battery"  # UserFactory's
FLEET = "/console/fleet/"
ADMIN = "/django-admin/"
POOLS = "/api/v1/fleet/pools/"
CODE_PAGE = "/login/code/"
ENROL_PAGE = "/login/code/enrol/"


@pytest.fixture
def staff():
    return staff_member()


@pytest.fixture
def device(staff):
    return TOTPDevice.objects.create(user=staff, name="phone", confirmed=True)


def staff_powers(client) -> dict[str, int]:
    return {"fleet": client.get(FLEET).status_code, "admin": client.get(ADMIN).status_code,
            "pools": client.get(POOLS).status_code}


OPEN = {"fleet": 200, "admin": 200, "pools": 200}
SHUT = {"fleet": 404, "admin": 302, "pools": 404}  # what a signed-in tenant gets


def test_a_staff_member_signed_in_with_the_password_alone_gets_no_staff_page_no_admin_and_no_pool_api(staff, device):
    client = Client()
    assert client.post("/login/", {"username": staff.email, "password": PASSWORD}).status_code == 302

    assert staff_powers(client) == SHUT
    assert ">Fleet<" not in client.get("/console/").content.decode()


def test_the_password_leads_staff_to_the_code_page_and_a_right_code_opens_the_staff_powers(staff, device):
    client = Client()
    response = client.post("/login/", {"username": staff.email, "password": PASSWORD, "next": "/console/fleet/"})
    assert response["Location"] == f"{CODE_PAGE}?next=%2Fconsole%2Ffleet%2F"

    verified = client.post(CODE_PAGE, {"code": totp_code(device), "next": "/console/fleet/"})

    assert verified.status_code == 302 and verified["Location"] == "/console/fleet/"
    assert staff_powers(client) == OPEN
    assert AuditEvent.objects.filter(action="staff.second_factor.verify", actor=staff, target_id=str(staff.pk)).exists()


def test_a_session_key_copied_before_the_code_was_entered_is_no_staff_session(staff, device):
    client = Client()
    client.post("/login/", {"username": staff.email, "password": PASSWORD})
    copied = Client()
    copied.cookies["sessionid"] = client.cookies["sessionid"].value

    client.post(CODE_PAGE, {"code": totp_code(device)})

    assert staff_powers(client) == OPEN
    assert copied.get(FLEET)["Location"].startswith("/login/")  # signed out: its session key is gone
    assert copied.get(POOLS).status_code in (401, 403)


def test_the_code_page_sends_nobody_to_another_site(staff, device):
    client = Client()
    client.force_login(staff)

    response = client.post(CODE_PAGE, {"code": totp_code(device), "next": "https://evil.example/"})

    assert response.status_code == 302 and response["Location"] == "/console/"


@pytest.mark.parametrize("next_url", ["0", "welcome", "home"])
def test_a_next_without_a_slash_is_a_relative_address_never_a_500_nor_a_url_name(staff, device, next_url):
    """`/login/?next=welcome` (a link anyone can send) led staff, once their code was taken, to a 500: the code
    page redirected with Django's `redirect()`, which takes a text without "/" or "." for a URL's name and raised
    NoReverseMatch; `/login/code/?next=0` opened by any signed-in tenant was a 500 at once. A name that does resolve
    (`home`) was followed as one (to `/`). Now such a `next` is an address, relative to the page, as the log-in's
    own (Django's `LoginView` redirects to it as it is)."""
    client = Client()
    client.raise_request_exception = False
    signed_in = client.post("/login/", {"username": staff.email, "password": PASSWORD, "next": next_url})
    assert signed_in.status_code == 302 and signed_in["Location"].startswith(CODE_PAGE)

    verified = client.post(CODE_PAGE, {"code": totp_code(device), "next": next_url})

    assert verified.status_code == 302 and verified["Location"] == next_url
    assert staff_powers(client) == OPEN
    tenant = Client()
    tenant.raise_request_exception = False
    tenant.force_login(UserFactory())
    opened = tenant.get(CODE_PAGE, {"next": next_url})
    assert opened.status_code == 302 and opened["Location"] == next_url


def test_a_tenant_signs_in_with_the_password_alone_and_is_never_asked_for_a_code():
    tenant = UserFactory()
    MembershipFactory(organization=OrganizationFactory(), user=tenant, role=Role.OWNER)
    client = Client()

    response = client.post("/login/", {"username": tenant.email, "password": PASSWORD})

    assert response["Location"] == "/console/"
    assert client.get(CODE_PAGE)["Location"] == "/console/"
    assert staff_powers(client) == SHUT


def test_the_django_admins_log_in_leads_staff_on_to_the_code_page(staff, device):
    client = Client()
    response = client.post("/django-admin/login/?next=/django-admin/", {"username": staff.email, "password": PASSWORD,
                                                                       "next": "/django-admin/"}, follow=True)

    assert response.redirect_chain[-1][0] == f"{CODE_PAGE}?next=%2Fdjango-admin%2F"
    assert client.get(ADMIN).status_code == 302


def wrong_code(device) -> str:
    """A code the device takes at no step of its tolerance."""
    taken = {totp_code(device, steps_ahead=step) for step in (-1, 0, 1)}
    return next(code for code in (f"{n:06d}" for n in range(1_000_000)) if code not in taken)


def test_a_wrong_code_is_refused_audited_and_slows_the_device_down(staff, device, monkeypatch):
    frozen = timezone.now()  # django-otp's 1 s backoff must not lapse between the two posts on a loaded machine
    monkeypatch.setattr(timezone, "now", lambda: frozen)
    client = Client()
    client.force_login(staff)
    wrong = wrong_code(device)

    refused = client.post(CODE_PAGE, {"code": wrong})
    right_too_soon = client.post(CODE_PAGE, {"code": totp_code(device)})

    assert refused.status_code == 400 and "wrong" in refused.content.decode()
    assert right_too_soon.status_code == 429 and int(right_too_soon["Retry-After"]) >= 1
    assert staff_powers(client) == SHUT
    reasons = list(AuditEvent.objects.filter(action="staff.second_factor.refuse").values_list("details__reason", flat=True))
    assert sorted(reasons) == ["throttled", "wrong"]


def test_posting_codes_is_limited_per_user_whatever_the_device_says(staff, device):
    client = Client()
    client.force_login(staff)
    statuses = [client.post(CODE_PAGE, {"code": "000000"}).status_code for _ in range(11)]

    assert statuses[-1] == 429
    assert client.post(CODE_PAGE, {"code": totp_code(device)}).status_code == 429


def test_a_code_is_taken_once_a_second_session_cannot_use_it_again(staff, device):
    code = totp_code(device)
    first, second = Client(), Client()
    first.force_login(staff)
    second.force_login(staff)

    assert first.post(CODE_PAGE, {"code": code}).status_code == 302
    assert second.post(CODE_PAGE, {"code": code}).status_code == 400
    assert staff_powers(first) == OPEN and staff_powers(second) == SHUT


def test_the_code_verifies_this_session_only_a_new_sign_in_with_the_password_has_no_staff_powers(staff, device):
    verified = Client()
    sign_in_staff(verified, staff)
    other = Client()
    other.post("/login/", {"username": staff.email, "password": PASSWORD})

    assert staff_powers(verified) == OPEN
    assert staff_powers(other) == SHUT


def test_enrolment_shows_the_secret_and_the_device_counts_only_once_a_code_from_it_is_confirmed(staff):
    client = Client()
    client.post("/login/", {"username": staff.email, "password": PASSWORD})
    assert client.get(CODE_PAGE)["Location"].startswith(ENROL_PAGE)
    # The password alone shows no secret: an enrolment code comes first (tests/test_staff_enrolment_codes.py).
    assert client.post(ENROL_PAGE, {"enrolment_code": enrolment_code_for(staff)}).status_code == 302

    page = client.get(ENROL_PAGE).content.decode()
    pending = TOTPDevice.objects.get(user=staff)
    assert not pending.confirmed
    assert "otpauth://totp/Inferplane%3Aops%40example.test?secret=" in page
    assert b32encode(pending.bin_key).decode() in page
    assert staff_powers(client) == SHUT

    wrong = client.post(ENROL_PAGE, {"code": wrong_code(pending)})
    assert wrong.status_code == 400 and not TOTPDevice.objects.get(pk=pending.pk).confirmed
    TOTPDevice.objects.filter(pk=pending.pk).update(throttling_failure_count=0, throttling_failure_timestamp=None)

    confirmed = client.post(ENROL_PAGE, {"code": totp_code(pending)})
    assert confirmed.status_code == 200 and 'data-testid="recovery-codes"' in confirmed.content.decode()
    assert TOTPDevice.objects.get(pk=pending.pk).confirmed
    assert staff_powers(client) == OPEN
    assert AuditEvent.objects.filter(action="staff.second_factor.enrol", actor=staff).exists()


def test_a_staff_member_with_a_device_cannot_enrol_another_with_the_password_alone(staff, device):
    client = Client()
    client.force_login(staff)

    assert client.get(ENROL_PAGE)["Location"].startswith(CODE_PAGE)
    assert client.post(ENROL_PAGE, {"code": "123456"})["Location"].startswith(CODE_PAGE)
    assert list(TOTPDevice.objects.filter(user=staff)) == [device]


def test_the_reset_command_removes_the_devices_ends_verified_sessions_staff_powers_and_is_audited(staff, device):
    verified = Client()
    sign_in_staff(verified, staff)
    assert staff_powers(verified) == OPEN

    call_command("reset_staff_second_factor", "OPS@example.test", stdout=StringIO())

    assert not TOTPDevice.objects.filter(user=staff).exists()
    assert staff_powers(verified) == SHUT
    assert verified.get(CODE_PAGE)["Location"].startswith(ENROL_PAGE)
    event = AuditEvent.objects.get(action="staff.second_factor.reset")
    assert event.target_id == str(staff.pk) and event.details["num_devices"] == 1


def test_the_reset_command_refuses_an_address_no_single_account_has():
    with pytest.raises(CommandError, match="No single account"):
        call_command("reset_staff_second_factor", "nobody@example.test")


def test_a_verified_staff_session_logged_out_and_signed_in_again_needs_a_new_code(staff, device):
    client = Client()
    sign_in_staff(client, staff)
    client.post("/logout/")
    client.post("/login/", {"username": staff.email, "password": PASSWORD})

    assert staff_powers(client) == SHUT


def test_a_verified_staff_session_that_posts_the_password_again_at_the_admins_log_in_needs_a_new_code(staff, device):
    # Django's `login()` keeps a same-user, same-password session as it is: django-otp's proof stayed in it while its
    # sign-in time and end moved to now, so the password alone renewed staff powers for ever, under the same key.
    client = Client()
    sign_in_staff(client, staff)
    signed_in_at = client.session[staff_sessions.SIGNED_IN_AT_KEY]
    copied = Client()
    copied.cookies["sessionid"] = client.cookies["sessionid"].value

    response = client.post(f"{ADMIN}login/", {"username": staff.email, "password": PASSWORD, "next": ADMIN})

    assert response.status_code == 302
    assert staff_powers(client) == SHUT  # was OPEN
    assert client.cookies["sessionid"].value != copied.cookies["sessionid"].value
    assert client.get(FLEET).status_code == 404  # signed in still, as an ordinary user
    assert copied.get(FLEET)["Location"].startswith("/login/")  # the key from before signs nobody in
    assert client.session[staff_sessions.SIGNED_IN_AT_KEY] >= signed_in_at
    sign_in_staff(client, staff)  # a new code makes it staff again
    assert staff_powers(client) == OPEN


def test_a_verified_staff_session_that_posts_the_password_at_the_consoles_log_in_renews_nothing(staff, device):
    # The console's log-in sends a signed-in session on (`redirect_authenticated_user`) before any `login()`: the
    # session, its sign-in time and its end stay as they were.
    client = Client()
    sign_in_staff(client, staff)
    key, signed_in_at, end = (client.cookies["sessionid"].value, client.session[staff_sessions.SIGNED_IN_AT_KEY],
                              client.session.get_expiry_date())

    response = client.post("/login/", {"username": staff.email, "password": PASSWORD})

    assert response.status_code == 302 and response["Location"] == "/console/"
    assert client.cookies["sessionid"].value == key
    assert client.session[staff_sessions.SIGNED_IN_AT_KEY] == signed_in_at
    assert client.session.get_expiry_date() == end


def test_a_sign_in_with_a_user_that_carries_a_verified_device_still_needs_a_new_code(staff, device, rf):
    # django-otp's own `user_logged_in` receiver (run after the project's) puts a user's `otp_device` in the session:
    # an OTP-aware log-in form, or `login(request, request.user)` in a verified request, would verify the sign-in.
    request = rf.post("/login/")
    request.session = SessionStore()
    request.session[DEVICE_ID_SESSION_KEY] = device.persistent_id
    request.session.save()
    key_before = request.session.session_key
    request.user = staff
    staff.otp_device = device

    login(request, staff)

    assert DEVICE_ID_SESSION_KEY not in request.session
    assert staff.otp_device is None
    assert request.session.session_key != key_before


def _customer_made_staff_while_signed_in():
    """A customer signed in with the password (a two-week session), then made staff in the admin."""
    customer = UserFactory(username="later-staff@example.test")
    MembershipFactory(organization=OrganizationFactory(), user=customer, role=Role.OWNER)
    client = signed_in_with_the_password(customer)
    customer.is_staff = customer.is_superuser = True
    customer.save(update_fields=["is_staff", "is_superuser"])
    return client, customer


def test_a_customer_made_staff_while_signed_in_has_staff_powers_that_end_hours_after_its_sign_in(settings):
    # The fixed end was set only at a staff account's sign-in: the code, entered in the customer's session, made a
    # staff session that lasted two weeks from its last request (the tenancy review).
    signed_in_before = timezone.now()
    client, customer = _customer_made_staff_while_signed_in()
    signed_in_after = timezone.now()
    device = TOTPDevice.objects.create(user=customer, name="phone", confirmed=True)

    assert client.post(CODE_PAGE, {"code": totp_code(device)}).status_code == 302
    assert staff_powers(client) == OPEN
    hours = timedelta(hours=settings.STAFF_SESSION_HOURS)
    assert signed_in_before + hours <= client.session.get_expiry_date() <= signed_in_after + hours


def test_a_session_signed_in_longer_ago_than_a_staff_session_lasts_signs_in_again_before_its_code(settings):
    settings.STAFF_SESSION_HOURS = 1 / 3600  # one second
    client, customer = _customer_made_staff_while_signed_in()
    device = TOTPDevice.objects.create(user=customer, name="phone", confirmed=True)
    time.sleep(1.1)

    assert client.post(CODE_PAGE, {"code": totp_code(device)})["Location"].startswith("/login/?next=")
    assert TOTPDevice.objects.get(pk=device.pk).last_t == device.last_t  # the code was not taken
    assert client.get(FLEET)["Location"].startswith("/login/")  # signed out: it signs in again
    assert staff_powers(client) != OPEN


def test_a_session_signed_in_longer_ago_than_a_staff_session_lasts_signs_in_again_before_it_enrols(settings):
    hours, settings.STAFF_SESSION_HOURS = settings.STAFF_SESSION_HOURS, 1 / 3600  # one second
    client, customer = _customer_made_staff_while_signed_in()
    time.sleep(1.1)

    code = enrolment_code_for(customer)
    assert client.post(ENROL_PAGE, {"enrolment_code": code})["Location"].startswith("/login/?next=")
    assert client.get(FLEET)["Location"].startswith("/login/")
    # Signed in again, the same enrolment code still works: the old session took none.
    settings.STAFF_SESSION_HOURS = hours
    client = signed_in_with_the_password(customer)
    assert client.post(ENROL_PAGE, {"enrolment_code": code}).status_code == 302
    assert TOTPDevice.objects.filter(user=customer, confirmed=False).exists()


def test_a_session_that_holds_no_sign_in_time_signs_in_again_before_its_code():
    """A session signed in before sign-in times were kept: how old it is, nobody knows."""
    client, customer = _customer_made_staff_while_signed_in()
    device = TOTPDevice.objects.create(user=customer, name="phone", confirmed=True)
    session = client.session
    del session[staff_sessions.SIGNED_IN_AT_KEY]
    session.save()

    assert client.post(CODE_PAGE, {"code": totp_code(device)})["Location"].startswith("/login/?next=")
    assert staff_powers(client) != OPEN


def test_the_demo_admin_signs_in_with_the_password_and_the_code_demo_code_prints_and_keeps_it_across_runs(
        client, tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "build_tiny_model", lambda models_dir: models_dir / "tiny-llama")
    monkeypatch.setenv("INFERPLANE_DATA_DIR", str(tmp_path))
    seeded = demo.seed_demo(tmp_path)
    printed = StringIO()
    call_command("demo_code", stdout=printed, stderr=StringIO())

    assert client.post("/login/", {"username": demo.DEMO_EMAIL, "password": seeded.password})["Location"].startswith(CODE_PAGE)
    assert client.post(CODE_PAGE, {"code": printed.getvalue().strip()}).status_code == 302
    assert staff_powers(client) == OPEN
    assert demo.seed_demo(tmp_path).totp_key == seeded.totp_key  # a second `make run` prints codes that still work


def test_the_admin_never_shows_another_staff_members_authenticator_secret(staff, device):
    """Before, any staff member with the admin saw every staff member's TOTP key and QR code (and could sign in as
    them with their password)."""
    colleague = UserFactory(is_staff=True, is_superuser=True)
    sign_in_staff(client := Client(), colleague)
    page = client.get(f"{ADMIN}otp_totp/totpdevice/{device.pk}/change/")
    assert page.status_code == 200
    assert device.key not in page.content.decode() and b32encode(device.bin_key).decode() not in page.content.decode()
    assert client.get(f"{ADMIN}otp_totp/totpdevice/{device.pk}/config/").status_code in (403, 404)
