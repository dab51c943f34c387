"""Sign-up verifies the email: until the signed link is followed the console shows one page, and nothing can be joined."""

import queue
from datetime import timedelta

import pytest
from django.core import mail
from django.core.management import call_command
from django.urls import reverse

from controlplane.accounts import invitations, mail_sender, services, signup
from controlplane.accounts import members as members_api
from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import ApiKey, EmailVerification, Role, email_is_verified
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory, sign_in_staff

pytestmark = pytest.mark.django_db

SIGN_UP = {"email": "New@Example.test", "password": "a long passphrase", "organization_name": "Newco"}


def _emailed_link(message) -> str:
    return next(line.strip() for line in message.body.splitlines() if "/verify-email/" in line)


def _sign_up(client):
    """Signs up, then logs in: signing up signs nobody in (it answers the same for an address that has an account)."""
    response = client.post(reverse("signup"), SIGN_UP)
    assert response.status_code == 302 and response.url == reverse("signup-done")
    assert client.get(reverse("console:dashboard")).url.startswith(reverse("login"))
    assert client.login(username="new@example.test", password=SIGN_UP["password"])
    return signup.User.objects.get(email="new@example.test")


def test_a_new_account_sees_only_the_verify_email_page(client):
    _sign_up(client)
    for name in ("console:dashboard", "console:keys", "console:members", "console:endpoints"):
        response = client.get(reverse(name))
        assert response.status_code == 302 and response.url == reverse("verify-email"), name
    page = client.get(reverse("verify-email")).content.decode()
    assert "Verify your email" in page and "new@example.test" in page and "Send a new link" in page


def test_an_unverified_account_can_neither_create_keys_nor_use_the_api(client):
    _sign_up(client)
    client.post(reverse("console:keys"), {"name": "sneaky", "scopes": ["inference"]})
    response = client.post("/api/v1/keys/", {"name": "sneaky"}, content_type="application/json")
    assert response.status_code == 403 and "Verify your email" in response.json()["detail"]
    # Before, any Authorization header, even a meaningless one, took a signed-in session past the check.
    for path in (reverse("console:keys"), "/api/v1/keys/"):
        response = client.post(path, {"name": "sneaky", "scopes": ["inference", "manage"]}, HTTP_AUTHORIZATION="x")
        assert response.status_code in (302, 403), path
    assert client.get(reverse("console:dashboard"), HTTP_AUTHORIZATION="Bearer nonsense").url == reverse("verify-email")
    assert not ApiKey.objects.exists()


def test_the_emailed_link_verifies_the_account_and_opens_the_console(client):
    user = _sign_up(client)
    assert len(mail.outbox) == 1 and mail.outbox[0].to == ["new@example.test"]
    response = client.get(_emailed_link(mail.outbox[0]))
    assert response.status_code == 302 and response.url == reverse("console:dashboard")
    assert email_is_verified(user)
    assert client.get(reverse("console:dashboard")).status_code == 200


def test_the_link_followed_signed_out_verifies_nothing_until_the_account_logs_in(client):
    user = _sign_up(client)
    other_browser = client.__class__()
    link = _emailed_link(mail.outbox[0])
    response = other_browser.get(link, follow=True)
    login_url, _ = response.redirect_chain[-1]
    assert login_url.startswith(reverse("login")) and "Log in as new@example.test to verify" in response.content.decode()
    assert not email_is_verified(user)
    response = other_browser.post(login_url, {"username": "new@example.test", "password": SIGN_UP["password"]},
                                  follow=True)
    assert response.redirect_chain[-1][0] == reverse("console:dashboard") and email_is_verified(user)


def test_a_link_followed_in_another_accounts_session_is_refused(client):
    user = _sign_up(client)
    other = client.__class__()
    other.force_login(UserFactory(username="someone@example.test"))
    response = other.get(_emailed_link(mail.outbox[0]))
    assert response.status_code == 400 and "log in as new@example.test" in response.content.decode()
    assert not email_is_verified(user)


def test_the_link_in_the_accounts_own_session_confirms_a_verification_from_before(client):
    user = _sign_up(client)
    EmailVerification.objects.create(user=user, email=user.email, confirmed_by_owner=False)
    assert client.get(_emailed_link(mail.outbox[0])).url == reverse("console:dashboard")
    assert EmailVerification.objects.get(user=user).confirmed_by_owner


def test_a_stranger_who_signs_up_with_an_address_never_gets_a_verified_session(client):
    """A review's finding: the owner of the mailbox, signed out, followed the link mailed to them, and the stranger's
    sign-up session became a verified owner's, which made a manage + inference key that outlived the owner's reset."""
    stranger = client
    _sign_up(stranger)
    owner = client.__class__()
    owner.get(_emailed_link(mail.outbox[-1]))
    response = stranger.post(reverse("console:keys"), {"name": "default", "scopes": ["manage", "inference"]})
    assert response.status_code == 302 and response.url == reverse("verify-email")
    assert not ApiKey.objects.exists()
    # The owner takes the account back by resetting its password: the stranger's session ends with it.
    owner.post(reverse("password_reset"), {"email": "new@example.test"})
    response = owner.get(_reset_link(mail.outbox[-1]), follow=True)
    owner.post(response.redirect_chain[-1][0], {"new_password1": "the owner's own one", "new_password2": "the owner's own one"})
    assert stranger.get(reverse("console:dashboard")).url.startswith(reverse("login"))
    assert owner.login(username="new@example.test", password="the owner's own one")
    # The reset's link went to the address, which proves it.
    assert owner.get(reverse("console:dashboard")).status_code == 200


def _reset_link(message) -> str:
    return next(line.strip() for line in message.body.splitlines() if "/reset/" in line).split("testserver", 1)[-1]


def _reset_password(client, email: str, password: str = "a brand new passphrase"):
    client.post(reverse("password_reset"), {"email": email})
    form = client.get(_reset_link(mail.outbox[-1]), follow=True)
    return client.post(form.redirect_chain[-1][0], {"new_password1": password, "new_password2": password}, follow=True)


def test_a_reset_revokes_the_keys_of_an_account_its_owner_never_confirmed(client):
    """Rows from before a link counted only in the account's own session (`confirmed_by_owner` False) may be a
    stranger's sign-up verified by the owner's click: the stranger's keys end with the owner's reset, audited."""
    user = UserFactory(username="legacy@example.test")
    EmailVerification.objects.filter(user=user).update(confirmed_by_owner=False)
    organization = MembershipFactory(user=user, role=Role.OWNER).organization
    made = create_api_key(services.Actor(user=user), organization, name="default", scopes=["manage", "inference"])
    minted = create_api_key(services.Actor(user=user, api_key=made.api_key), organization, name="child", scopes=["inference"])
    page = _reset_password(client, user.email).content.decode()
    assert "2 API key(s) of this account were revoked" in page
    assert set(ApiKey.objects.filter(revoked_at__isnull=False).values_list("pk", flat=True)) == {made.api_key.pk,
                                                                                               minted.api_key.pk}
    assert organization.audit_events.filter(action="api_key.revoke", details__reason="password.reset").count() == 2
    user.email_verification.refresh_from_db()
    assert user.email_verification.confirmed_by_owner
    # Confirmed now: the next reset keeps the keys made since.
    create_api_key(services.Actor(user=user), organization, name="new", scopes=["inference"])
    assert "revoked" not in _reset_password(client, user.email, "another new passphrase").content.decode()
    assert ApiKey.objects.filter(name="new", revoked_at__isnull=True).exists()


def test_a_reset_revokes_the_pending_invitations_an_account_its_owner_never_confirmed_sent(client):
    """The stranger's session, verified by the owner's click, invited a second address of the stranger's: the reset
    that ended the session left the invitation pending, and the second address joined the owner's organisation."""
    user = UserFactory(username="legacy@example.test")
    EmailVerification.objects.filter(user=user).update(confirmed_by_owner=False)
    organization = MembershipFactory(user=user, role=Role.OWNER).organization
    colleague = MembershipFactory(organization=organization, role=Role.ADMIN).user
    sent = invitations.invite_member(services.Actor(user=user), organization, email="second@evil.test",
                                     role=Role.ADMIN)
    kept = invitations.invite_member(services.Actor(user=colleague), organization, email="friend@example.test",
                                     role=Role.MEMBER)
    page = _reset_password(client, user.email).content.decode()
    assert "1 pending invitation(s) it sent were revoked" in page
    second = UserFactory(username="second@evil.test")
    with pytest.raises(invitations.InvitationRefused, match="revoked"):
        invitations.accept_invitation(services.Actor(user=second), sent)
    assert invitations.find_invitation(invitations.invitation_token(kept)).status == "pending"
    event = organization.audit_events.get(action="invitation.revoke")
    assert (event.target_id, event.details) == (str(sent.pk), {"email": "second@evil.test", "reason": "password.reset"})


def test_a_reset_removes_the_members_who_joined_through_invitations_an_unconfirmed_account_sent(client):
    """The stranger's session invited a second address of the stranger's as owner, and it accepted before the owner's
    reset: revoking pending invitations left that seat, and the seat's own invitee, in the organisation the owner
    took back (a review's finding). A colleague someone else invited, and a member the stranger invited whom an
    admin invited too, stay."""
    user = UserFactory(username="legacy@example.test")
    EmailVerification.objects.filter(user=user).update(confirmed_by_owner=False)
    organization = MembershipFactory(user=user, role=Role.OWNER).organization
    colleague = MembershipFactory(organization=organization, role=Role.ADMIN).user

    def joins(inviter, email, role):
        invitation = invitations.invite_member(services.Actor(user=inviter), organization, email=email, role=role)
        invitee = signup.User.objects.filter(email=email).first() or UserFactory(username=email)
        invitations.accept_invitation(services.Actor(user=invitee), invitation)
        return invitee

    seat = joins(user, "second@evil.test", Role.OWNER)
    seat_key = create_api_key(services.Actor(user=seat), organization, name="theirs", scopes=["inference"])
    joins(seat, "third@evil.test", Role.MEMBER)
    friend = joins(colleague, "friend@example.test", Role.MEMBER)
    both = joins(user, "both@example.test", Role.MEMBER)
    # An admin removed them and invited them again: vouched for by someone else since.
    members_api.remove_member(services.Actor(user=colleague), organization.memberships.get(user=both))
    joins(colleague, "both@example.test", Role.MEMBER)
    page = _reset_password(client, user.email).content.decode()
    assert "2 member(s) who joined through invitations this account sent were removed" in page
    members = set(organization.memberships.values_list("user__email", flat=True))
    assert members == {user.email, colleague.email, friend.email, both.email}
    assert ApiKey.objects.get(pk=seat_key.api_key.pk).revoked_at is not None
    removed = organization.audit_events.filter(action="member.remove", details__reason="password.reset")
    assert sorted(removed.values_list("details__email", flat=True)) == ["second@evil.test", "third@evil.test"]
    # The used links bring nobody back.
    seat_invitation = organization.invitations.get(email="second@evil.test")
    with pytest.raises(invitations.InvitationRefused, match="removed"):
        invitations.accept_invitation(services.Actor(user=seat), seat_invitation)


def test_a_reset_removes_nobody_where_the_account_no_longer_invites(client):
    """An ex-admin who never confirmed their address resets its password: the owner they invited long ago, and that
    owner's team, stay in the organisation that removed (or demoted) the ex-admin since (found by this stop's
    review: the reset removed the organisation's whole team but its founder)."""
    founder = UserFactory(username="founder@example.test")
    organization = MembershipFactory(user=founder, role=Role.OWNER).organization
    others = MembershipFactory(user=founder, role=Role.OWNER).organization
    leaver = UserFactory(username="leaver@example.test")
    EmailVerification.objects.filter(user=leaver).update(confirmed_by_owner=False)
    for place, role in ((organization, Role.ADMIN), (others, Role.ADMIN)):
        MembershipFactory(organization=place, user=leaver, role=role)
        invitation = invitations.invite_member(services.Actor(user=leaver), place, email=f"cto@{place.slug}.test",
                                               role=Role.MEMBER)
        invitations.accept_invitation(services.Actor(user=UserFactory(username=f"cto@{place.slug}.test")), invitation)
    members_api.remove_member(services.Actor(user=founder), organization.memberships.get(user=leaver))
    members_api.change_member_role(services.Actor(user=founder), others.memberships.get(user=leaver), role=Role.MEMBER)
    page = _reset_password(client, leaver.email).content.decode()
    assert "removed" not in page
    assert organization.memberships.filter(user__email=f"cto@{organization.slug}.test").exists()
    assert others.memberships.filter(user__email=f"cto@{others.slug}.test").exists()


def test_a_reset_keeps_the_keys_of_an_account_its_owner_confirmed(client):
    user = _sign_up(client)
    client.get(_emailed_link(mail.outbox[-1]))
    client.post(reverse("console:keys"), {"name": "mine", "scopes": ["inference"]})
    assert ApiKey.objects.filter(name="mine").exists()
    page = _reset_password(client.__class__(), user.email).content.decode()
    assert "revoked" not in page and ApiKey.objects.get(name="mine").revoked_at is None


def test_a_tampered_link_is_refused(client):
    user = _sign_up(client)
    link = _emailed_link(mail.outbox[0])
    response = client.get(link[:-3] + ("aaa" if not link.endswith("aaa/") else "bbb") + "/")
    assert response.status_code in (400, 404)
    assert not email_is_verified(user)


def test_an_expired_link_is_refused(client, monkeypatch):
    user = _sign_up(client)
    monkeypatch.setattr(signup, "VERIFY_EMAIL_MAX_AGE", timedelta(seconds=-1))
    response = client.get(_emailed_link(mail.outbox[0]))
    assert response.status_code == 400 and "invalid or has expired" in response.content.decode()
    assert not email_is_verified(user)


def test_a_link_for_an_address_the_user_no_longer_has_is_refused(client):
    user = _sign_up(client)
    user.email = "changed@example.test"
    user.save()
    response = client.get(_emailed_link(mail.outbox[0]))
    assert response.status_code == 400 and "no longer yours" in response.content.decode()
    assert not email_is_verified(user)


def test_verification_proves_one_address_only(client):
    user = UserFactory(username="proved@example.test")
    assert email_is_verified(user)
    user.email = "other@example.test"
    user.save()
    assert not email_is_verified(user)


def test_resend_mails_a_new_link(client):
    _sign_up(client)
    response = client.post(reverse("verify-email-resend"), follow=True)
    assert "We sent a new link to new@example.test" in response.content.decode()
    assert len(mail.outbox) == 2


def test_a_resend_whose_link_the_full_backlog_dropped_says_no_link_was_sent(client, settings, monkeypatch):
    """`mail_sender.send_later` drops a mail past `MAX_BACKLOG` (the relay slow, a flood of resets): the page said "We
    sent a new link" for a link nobody would ever get, and the user waited for it."""
    _sign_up(client)
    settings.SEND_MAIL_IN_REQUEST = False
    full = queue.Queue(maxsize=1)
    full.put_nowait(None)
    monkeypatch.setattr(mail_sender, "_senders", lambda: full)

    page = client.post(reverse("verify-email-resend"), follow=True).content.decode()

    assert "We sent a new link" not in page
    assert "could not send a link to new@example.test just now" in page
    assert len(mail.outbox) == 1  # the sign-up's, sent before the backlog filled


def test_an_unverified_account_cannot_join_an_organisation(client):
    user = _sign_up(client)
    other = OrganizationFactory()
    invitation = invitations.invite_member(services.SYSTEM, other, email="new@example.test", role=Role.MEMBER)
    response = client.post(reverse("invitation", args=[invitations.invitation_token(invitation)]))
    assert response.status_code == 302 and response.url == reverse("verify-email")
    with pytest.raises(invitations.InvitationRefused, match="Verify your email"):
        invitations.accept_invitation(services.Actor(user=user), invitation)
    assert not other.memberships.filter(user=user).exists()


def test_owners_made_by_operators_are_verified_and_can_log_in(client):
    call_command("create_org", "acme", "--owner", "ops@acme.test", "--password", "a long passphrase", "--json")
    user = signup.User.objects.get(email="ops@acme.test")
    assert email_is_verified(user)
    assert client.login(username="ops@acme.test", password="a long passphrase")
    assert client.get(reverse("console:dashboard")).status_code == 200


def test_users_staff_create_in_the_django_admin_are_verified(client):
    staff = UserFactory(username="root@example.test", is_staff=True, is_superuser=True)
    MembershipFactory(user=staff, role=Role.OWNER)
    sign_in_staff(client, staff)
    response = client.post("/django-admin/auth/user/add/", {
        "username": "colleague", "password1": "a long passphrase", "password2": "a long passphrase",
        "usable_password": "true",
    })
    assert response.status_code == 302, response.content.decode()[:2000]
    colleague = signup.User.objects.get(username="colleague")
    assert not email_is_verified(colleague)  # no address yet: nothing to vouch for
    change = client.get(f"/django-admin/auth/user/{colleague.pk}/change/")
    assert change.status_code == 200
    form = change.context["adminform"].form
    data = {name: value for name, value in form.initial.items() if value is not None and not isinstance(value, (list, tuple))}
    data.update({"username": "colleague", "email": "colleague@example.test", "date_joined_0": "2026-01-01",
                 "date_joined_1": "00:00:00", "is_active": "on"})
    data.pop("password", None)
    data.pop("last_login", None)
    data.pop("date_joined", None)
    assert client.post(f"/django-admin/auth/user/{colleague.pk}/change/", data).status_code == 302
    colleague.refresh_from_db()
    assert colleague.email == "colleague@example.test" and email_is_verified(colleague)


def test_an_address_staff_type_in_the_django_admin_is_stored_lower_cased_its_length_checked_so(client):
    # Lower-casing lengthens "\u0130" (two code points): 232 characters typed, 392 stored; the verification's insert
    # was a 500 (varchar(254)).
    staff = UserFactory(username="root@example.test", is_staff=True, is_superuser=True)
    MembershipFactory(user=staff, role=Role.OWNER)
    sign_in_staff(client, staff)
    colleague = UserFactory(username="colleague", email="")
    change = client.get(f"/django-admin/auth/user/{colleague.pk}/change/")
    form = change.context["adminform"].form
    data = {name: value for name, value in form.initial.items() if value is not None and not isinstance(value, (list, tuple))}
    data.update({"username": "colleague", "date_joined_0": "2026-01-01", "date_joined_1": "00:00:00", "is_active": "on"})
    for name in ("password", "last_login", "date_joined"):
        data.pop(name, None)
    client.raise_request_exception = False

    lengthening = client.post(f"/django-admin/auth/user/{colleague.pk}/change/",
                              data | {"email": "a" * 60 + "@" + ("\u0130" * 20 + ".") * 8 + "com"})
    assert lengthening.status_code == 200 and "once lower-cased" in str(lengthening.context["adminform"].form.errors)
    assert client.post(f"/django-admin/auth/user/{colleague.pk}/change/",
                       data | {"email": "Colleague@Example.test"}).status_code == 302
    colleague.refresh_from_db()
    assert colleague.email == "colleague@example.test" and email_is_verified(colleague)


def test_the_demo_login_that_make_run_prints_opens_the_console(client, tmp_path, monkeypatch):
    from controlplane import demo

    monkeypatch.setattr(demo, "build_tiny_model", lambda models_dir: models_dir / "tiny-llama")
    seeded = demo.seed_demo(tmp_path)
    assert client.login(username=demo.DEMO_EMAIL, password=seeded.password)
    assert client.get(reverse("console:dashboard")).status_code == 200


def test_accounts_from_before_verification_are_marked_verified_by_the_migration():
    import importlib

    from django.apps import apps

    from controlplane.accounts.models import EmailVerification

    old = UserFactory(username="old-timer@example.test")
    EmailVerification.objects.filter(user=old).delete()
    migration = importlib.import_module("controlplane.accounts.migrations.0002_accounts_invitations_email_verification")
    migration.verify_existing_users(apps, None)
    assert email_is_verified(old)


def test_the_migration_confirms_the_verifications_operators_made_and_not_those_a_link_made(client):
    """Migration 0011 left every existing row unconfirmed: an owner made by `create_org` (or the admin) lost their
    keys on their first reset. Rows whose address the account signed up with or verified by a link stay
    unconfirmed: whose session followed that link was never recorded."""
    import importlib

    from django.apps import apps

    call_command("create_org", "acme", "--owner", "ops@acme.test", "--password", "a long passphrase")
    operators = signup.User.objects.get(email="ops@acme.test")
    staffs = UserFactory(username="made-in-the-admin@example.test")
    linked = signup.sign_up_user(email="linked@example.test", password="a long passphrase", organization_name="L")
    signup.verify_email(signup.email_verification_token(linked), signed_in_as=linked)
    signed_up = signup.sign_up_user(email="Early@Example.test", password="a long passphrase", organization_name="E")
    signup.mark_email_verified(signed_up)  # as migration 0002 verified accounts from before verification
    EmailVerification.objects.update(confirmed_by_owner=False)  # as migration 0011 left every row

    migration = importlib.import_module("controlplane.accounts.migrations.0012_confirm_email_verifications_operators_made")
    migration.confirm_email_verifications_operators_made(apps, None)

    confirmed = dict(EmailVerification.objects.values_list("user__email", "confirmed_by_owner"))
    assert confirmed == {"ops@acme.test": True, staffs.email: True, "linked@example.test": False,
                         "early@example.test": False}
    # The operator's owner keeps their keys through a reset.
    assert "revoked" not in _reset_password(client, operators.email).content.decode()
    assert not ApiKey.objects.filter(created_by=operators, revoked_at__isnull=False).exists()
