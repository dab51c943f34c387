"""Home, sign-up, log-in, organisation switcher and the members page."""

import pytest
from django.urls import reverse

from controlplane.accounts.models import Membership, Role
from controlplane.accounts.tenancy import SESSION_KEY
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory

pytestmark = pytest.mark.django_db


def test_home_invites_visitors_to_sign_up_or_log_in(client):
    page = client.get(reverse("home")).content.decode()
    assert reverse("signup") in page and reverse("login") in page


def test_sign_up_creates_an_owned_organisation_and_asks_to_verify_the_email(client):
    response = client.post(reverse("signup"), {"email": "Ada@Example.test", "password": "a long passphrase", "organization_name": "Analytical"})
    assert response.status_code == 302 and response.url == reverse("signup-done")
    membership = Membership.objects.get(user__email="ada@example.test")
    assert membership.role == Role.OWNER and membership.organization.name == "Analytical"
    assert "Check your email" in client.get(response.url).content.decode()
    assert client.login(username="ada@example.test", password="a long passphrase")
    assert "We sent a link to <strong>ada@example.test</strong>" in client.get(reverse("verify-email")).content.decode()


def test_sign_up_errors_show_next_to_their_fields(client):
    UserFactory(username="taken@example.test")
    page = client.post(reverse("signup"), {"email": "taken@example.test", "password": "123", "organization_name": ""}).content.decode()
    assert "An account with this email exists" not in page  # said before: it told strangers who has an account
    assert "This field is required." in page
    assert page.count('class="error"') >= 3
    assert '<label for="id_organization_name">' in page


def test_log_in_page_has_labelled_fields_and_a_reset_link(client):
    page = client.get(reverse("login")).content.decode()
    assert '<label for="id_username">' in page and '<label for="id_password">' in page
    assert reverse("password_reset") in page and "csrfmiddlewaretoken" in page


def test_switcher_changes_the_organisation_the_console_shows(owner):
    second = OrganizationFactory(name="Second Org")
    MembershipFactory(organization=second, user=owner.user, role=Role.VIEWER)
    page = owner.get(reverse("console:dashboard")).content.decode()
    assert 'id="org-switch"' in page and "Second Org" in page
    owner.post(reverse("switch-organization"), {"organization": second.pk})
    assert owner.session[SESSION_KEY] == second.pk


def test_switcher_ignores_an_organisation_the_user_is_not_in(owner):
    stranger = OrganizationFactory()
    owner.post(reverse("switch-organization"), {"organization": stranger.pk})
    assert owner.session[SESSION_KEY] == owner.organization.pk


def test_members_page_lists_members_and_roles(owner, console_client_factory):
    viewer = console_client_factory(owner.organization, Role.VIEWER)
    page = owner.get(reverse("console:members")).content.decode()
    assert owner.user.email in page and viewer.user.email in page
    assert "Invite a member" in page


def test_inviting_an_existing_member_is_an_inline_error(owner, console_client_factory):
    member = console_client_factory(owner.organization, Role.MEMBER)
    response = owner.post(reverse("console:members"), {"email": member.user.email.upper(), "role": Role.MEMBER})
    assert response.status_code == 400
    assert "already a member" in response.content.decode()


def test_role_change_and_removal(owner, console_client_factory):
    other = console_client_factory(owner.organization, Role.MEMBER)
    membership = Membership.objects.get(organization=owner.organization, user=other.user)
    owner.post(reverse("console:member-role", args=[membership.pk]), {"role": Role.ADMIN})
    membership.refresh_from_db()
    assert membership.role == Role.ADMIN
    owner.post(reverse("console:member-remove", args=[membership.pk]))
    assert not Membership.objects.filter(pk=membership.pk).exists()


def test_the_last_owner_cannot_leave(owner):
    membership = Membership.objects.get(organization=owner.organization, user=owner.user)
    response = owner.post(reverse("console:member-role", args=[membership.pk]), {"role": Role.MEMBER}, follow=True)
    assert "at least one owner" in response.content.decode()
    membership.refresh_from_db()
    assert membership.role == Role.OWNER


def test_admins_cannot_invite_owners(console_client_factory, org):
    admin = console_client_factory(org, Role.ADMIN)
    response = admin.post(reverse("console:members"), {"email": "boss@example.test", "role": Role.OWNER})
    assert response.status_code == 400 and "Only owners may grant" in response.content.decode()
    assert not org.invitations.exists()


@pytest.mark.parametrize("role", [Role.VIEWER, Role.MEMBER])
def test_only_admins_manage_members(console_client_factory, org, role):
    client = console_client_factory(org, role)
    target = UserFactory()
    assert client.post(reverse("console:members"), {"email": target.email, "role": Role.MEMBER}).status_code == 403
    membership = Membership.objects.get(organization=org, user=client.user)
    assert client.post(reverse("console:member-role", args=[membership.pk]), {"role": Role.OWNER}).status_code == 403
    assert client.post(reverse("console:member-remove", args=[membership.pk])).status_code == 403
    page = client.get(reverse("console:members")).content.decode()
    assert "Only owners and admins can invite members" in page


def test_another_organisations_membership_is_a_404(owner):
    stranger = MembershipFactory(organization=OrganizationFactory())
    assert owner.post(reverse("console:member-role", args=[stranger.pk]), {"role": Role.VIEWER}).status_code == 404
    assert owner.post(reverse("console:member-remove", args=[stranger.pk])).status_code == 404
    assert Membership.objects.filter(pk=stranger.pk).exists()


def test_password_reset_emails_a_working_link(client):
    from django.core import mail

    UserFactory(username="forgetful@example.test")
    response = client.post(reverse("password_reset"), {"email": "forgetful@example.test"}, follow=True)
    assert "Check your email" in response.content.decode()
    link = next(line for line in mail.outbox[0].body.splitlines() if "/reset/" in line).strip()
    page = client.get(link, follow=True).content.decode()
    assert "Choose a new password" in page and '<label for="id_new_password1">' in page


def test_a_user_without_an_organisation_is_told_what_to_do(client):
    user = UserFactory()
    client.force_login(user)
    response = client.get(reverse("console:dashboard"))
    assert response.status_code == 403 and "not a member of any organisation" in response.content.decode()


def test_pending_invitations_are_shown_to_admins_only_as_the_api_shows_them(owner, console_client_factory):
    # The API's invitations need an admin; the members page listed every invitee's and inviter's email to viewers.
    owner.post(reverse("console:members"), {"email": "new.hire@example.test", "role": Role.MEMBER})
    organization = owner.organization

    assert "new.hire@example.test" in owner.get(reverse("console:members")).content.decode()
    for role in (Role.VIEWER, Role.MEMBER):
        page = console_client_factory(organization, role).get(reverse("console:members")).content.decode()
        assert "new.hire@example.test" not in page
