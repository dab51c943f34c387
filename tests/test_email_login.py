"""Accounts are known by their email: any staff account logs in to the console with it."""

import builtins
import getpass

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.urls import reverse
from django_otp.plugins.otp_totp.models import TOTPDevice

from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import Role, email_is_verified
from controlplane.accounts.services import Actor
from controlplane.accounts.signup import ResetSecured, secure_after_password_reset
from tests.factories import MembershipFactory, UserFactory, enrolment_code_for, totp_code

pytestmark = pytest.mark.django_db

PASSWORD = "a long passphrase"


class _Terminal:
    """A stdin that says it is a terminal, so `createsuperuser` prompts."""

    def isatty(self):
        return True


def _create_superuser(monkeypatch, **env):
    for name, value in env.items():
        monkeypatch.setenv(f"DJANGO_SUPERUSER_{name.upper()}", value)
    call_command("createsuperuser", interactive=False, verbosity=0)


def test_a_superuser_made_with_createsuperuser_logs_in_to_the_console_with_its_email_and_sees_the_fleet(client, monkeypatch):
    _create_superuser(monkeypatch, username="admin", email="ops@x.test", password=PASSWORD)
    response = client.post("/login/", {"username": "OPS@x.test", "password": PASSWORD})
    assert response.status_code == 302, response.content.decode()[:2000]
    # A new staff account sets up its authenticator before the fleet opens (tests/test_staff_second_factor.py).
    enrol = client.get(response["Location"], follow=True).redirect_chain[-1][0]
    assert enrol.startswith("/login/code/enrol/")
    # Its first enrolment takes an enrolment code besides the password, printed by an operator (never mailed).
    code = enrolment_code_for(get_user_model().objects.get(username="admin"))
    assert client.post(enrol, {"enrolment_code": code}).status_code == 302
    device = TOTPDevice.objects.get(user__username="admin", confirmed=False)
    assert client.post(enrol, {"code": totp_code(device)}).status_code == 200
    fleet = client.get("/console/fleet/")
    assert fleet.status_code == 200
    assert "Fleet" in fleet.content.decode()


def test_createsuperuser_without_a_username_uses_the_email(monkeypatch):
    _create_superuser(monkeypatch, email="Ops@X.test", password=PASSWORD)
    user = get_user_model().objects.get()
    assert (user.username, user.email, user.is_staff, user.is_superuser) == ("ops@x.test", "ops@x.test", True, True)


def test_a_superuser_made_with_createsuperuser_has_its_address_confirmed_by_an_operator(monkeypatch):
    """Before, it had no verification row at all (staff count as verified): made no longer staff, it was unverified,
    and its first reset revoked every key it had made as never confirmed by its owner."""
    _create_superuser(monkeypatch, email="ops@x.test", password=PASSWORD)
    user = get_user_model().objects.get()
    organization = MembershipFactory(user=user, role=Role.OWNER).organization
    made = create_api_key(Actor(user=user), organization, name="ops", scopes=["inference"])
    user.is_staff = user.is_superuser = False
    user.save()
    assert email_is_verified(user)
    assert secure_after_password_reset(user) == ResetSecured(num_keys_revoked=0, num_invitations_revoked=0, num_members_removed=0)
    made.api_key.refresh_from_db()
    assert made.api_key.revoked_at is None


def test_createsuperuser_asks_for_the_email_first_and_makes_it_the_username(monkeypatch):
    prompts = []

    def answer(prompt=""):
        prompts.append(prompt)
        return "ops@x.test" if "Email" in prompt else ""

    monkeypatch.setattr(builtins, "input", answer)
    monkeypatch.setattr(getpass, "getpass", lambda prompt="Password: ": PASSWORD)
    call_command("createsuperuser", interactive=True, stdin=_Terminal(), verbosity=0)
    assert prompts[0].startswith("Email")
    assert not any(p.startswith("Username") for p in prompts)
    assert get_user_model().objects.get().username == "ops@x.test"


def test_createsuperuser_refuses_an_email_another_account_has(monkeypatch):
    UserFactory(username="someone", email="ops@x.test")
    with pytest.raises(CommandError, match="already exists"):
        _create_superuser(monkeypatch, username="admin", email="OPS@x.test", password=PASSWORD)
    assert not get_user_model().objects.filter(username="admin").exists()


def test_an_email_two_old_accounts_share_logs_in_to_neither(client):
    for username in ("first", "second"):
        user = UserFactory(username=username, email="shared@x.test")
        user.set_password(PASSWORD)
        user.save()
    response = client.post("/login/", {"username": "shared@x.test", "password": PASSWORD})
    assert response.status_code == 200 and "_auth_user_id" not in client.session
    # Each still logs in by its exact username.
    assert client.post("/login/", {"username": "first", "password": PASSWORD}).status_code == 302


def test_sign_up_with_an_email_a_staff_account_has_makes_no_account(client, monkeypatch):
    _create_superuser(monkeypatch, username="admin", email="ops@x.test", password=PASSWORD)
    response = client.post("/signup/", {"email": "Ops@X.test", "password": PASSWORD, "organization_name": "Grab"})
    assert response.status_code == 302 and response.url == reverse("signup-done")  # as for a new address
    assert get_user_model().objects.count() == 1


def test_a_staff_sign_in_ends_within_hours_and_a_customers_lasts_as_before(client, settings):
    # A staff session (every tenant's plans, prices, keys and nodes) lasted Django's two weeks like anyone's.
    from datetime import timedelta

    from django.utils import timezone

    staff = UserFactory(email="ops@x.test", is_staff=True)
    staff.set_password(PASSWORD)
    staff.save()
    assert client.post("/login/", {"username": "ops@x.test", "password": PASSWORD}).status_code == 302
    assert client.session.get_expiry_date() <= timezone.now() + timedelta(hours=settings.STAFF_SESSION_HOURS)

    client.logout()
    customer = UserFactory(email="dev@x.test")
    customer.set_password(PASSWORD)
    customer.save()
    assert client.post("/login/", {"username": "dev@x.test", "password": PASSWORD}).status_code == 302
    assert client.session.get_expiry_date() > timezone.now() + timedelta(days=13)
