"""Members join by invitation: a signed, expiring link that a verified user with the invited email accepts. Only a
signed-in admin invites, never an API key."""

import importlib
import threading
from datetime import timedelta

import pytest
from django.apps import apps
from django.core import mail
from django.db import connection, transaction
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.accounts import invitations, members, services
from controlplane.accounts.models import AuditEvent, Invitation, Membership, Organization, Role
from tests.conftest import wait_until
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory, signed_in_api_client
from tests.test_roles import _waiting_on_a_lock

pytestmark = pytest.mark.django_db


@pytest.fixture
def owner(org):
    """A console client signed in as an owner of `org`."""
    client = Client()
    user = UserFactory()
    MembershipFactory(organization=org, user=user, role=Role.OWNER)
    client.force_login(user)
    client.user, client.organization = user, org
    return client


def _invite(owner, email="Colleague@Victim.example", role=Role.MEMBER):
    response = owner.post(reverse("console:members"), {"email": email, "role": role})
    assert response.status_code == 302, response.content.decode()
    return Invitation.objects.get(organization=owner.organization, email=email.lower())


def _link_path(message) -> str:
    link = next(line.strip() for line in message.body.splitlines() if "/invitations/" in line)
    return link[link.index("/invitations/"):]


def _signed_in(client, user):
    client.force_login(user)
    return client


def test_the_invitation_email_is_plain_text_with_the_organisation_name_as_written(owner):
    # The plain-text mail was rendered with HTML escaping: "O'Reilly & <Co>" arrived as "O&#x27;Reilly &amp; &lt;Co&gt;".
    Organization.objects.filter(pk=owner.organization.pk).update(name="O'Reilly & <Co>")
    _invite(owner)
    assert 'join the organisation "O\'Reilly & <Co>" on Inferplane' in mail.outbox[-1].body
    assert "&amp;" not in mail.outbox[-1].body


def test_an_organisation_name_with_line_breaks_stays_on_its_line_of_the_invitation_mail(owner):
    """A name from before sign-up refused control characters wrote lines of its own into the mail, in the mail's
    own voice: a link to some other site to "accept" read as ours."""
    Organization.objects.filter(pk=owner.organization.pk).update(
        name="Acme\n\nOpen https://evil.example/accept to accept.\n\nAcme")
    _invite(owner)
    body = mail.outbox[-1].body
    assert 'join the organisation "Acme Open https://evil.example/accept to accept. Acme" on Inferplane' in body
    assert "\nOpen https://evil.example" not in body


def test_an_admin_invites_by_email_and_the_invitation_is_pending_mailed_and_audited(owner):
    invitation = _invite(owner)
    assert invitation.status == "pending" and invitation.invited_by == owner.user
    assert mail.outbox[-1].to == ["colleague@victim.example"]
    assert owner.organization.name in mail.outbox[-1].subject
    page = owner.get(reverse("console:members")).content.decode()
    assert "Pending invitations" in page and "colleague@victim.example" in page
    assert AuditEvent.objects.filter(organization=owner.organization, action="invitation.create",
                                     details__email="colleague@victim.example").exists()
    assert not Membership.objects.filter(user__email="colleague@victim.example").exists()


def test_the_invitee_joins_by_accepting_while_signed_in_as_that_verified_email(owner, client):
    _invite(owner)
    invitee = UserFactory(username="colleague@victim.example")
    _signed_in(client, invitee)
    page = client.get(_link_path(mail.outbox[-1])).content.decode()
    assert "Join " + owner.organization.name in page and "Accept and join" in page
    response = client.post(_link_path(mail.outbox[-1]))
    assert response.status_code == 302 and response.url == reverse("console:dashboard")
    membership = Membership.objects.get(organization=owner.organization, user=invitee)
    assert membership.role == Role.MEMBER
    assert AuditEvent.objects.filter(organization=owner.organization, action="invitation.accept").exists()
    # Accepting again changes nothing.
    client.post(_link_path(mail.outbox[-1]))
    assert Membership.objects.filter(organization=owner.organization, user=invitee).count() == 1
    assert "Pending invitations" not in owner.get(reverse("console:members")).content.decode()


def test_a_member_removed_after_accepting_cannot_rejoin_with_the_same_link(owner, client):
    """Before, posting the used link again looked for the membership the removal deleted: a 500."""
    _invite(owner)
    link = _link_path(mail.outbox[-1])
    invitee = UserFactory(username="colleague@victim.example")
    _signed_in(client, invitee)
    assert client.post(link).status_code == 302
    membership = Membership.objects.get(organization=owner.organization, user=invitee)
    assert owner.post(reverse("console:member-remove", args=[membership.pk])).status_code == 302
    assert "You were removed" in client.get(link).content.decode()
    response = client.post(link)
    assert response.status_code == 400 and "ask an admin of the organisation for a new invitation" in response.content.decode()
    assert not Membership.objects.filter(organization=owner.organization, user=invitee).exists()


def test_whoever_registers_the_invited_address_first_gains_nothing_without_the_mailbox(owner, client):
    _invite(owner)
    link = _link_path(mail.outbox[-1])  # say the attacker got hold of the link, too
    # The attacker signs up with the colleague's address before the colleague does.
    client.post(reverse("signup"), {"email": "colleague@victim.example", "password": "a long passphrase",
                                    "organization_name": "Squatter"})
    assert client.login(username="colleague@victim.example", password="a long passphrase")
    response = client.post(link)
    assert response.status_code == 302 and response.url == reverse("verify-email")
    assert not Membership.objects.filter(organization=owner.organization, user__email="colleague@victim.example").exists()


def test_another_user_cannot_accept_someone_elses_invitation(owner, client):
    _invite(owner)
    _signed_in(client, UserFactory(username="mallory@example.test"))
    assert "sent to another email address" in client.get(_link_path(mail.outbox[-1])).content.decode()
    response = client.post(_link_path(mail.outbox[-1]))
    assert response.status_code == 400 and "sent to another email address" in response.content.decode()
    assert not Membership.objects.filter(organization=owner.organization, user__email="mallory@example.test").exists()
    assert Invitation.objects.get().status == "pending"


def test_a_revoked_invitation_cannot_be_accepted(owner, client):
    invitation = _invite(owner)
    owner.post(reverse("console:invitation-revoke", args=[invitation.pk]))
    assert Invitation.objects.get().status == "revoked"
    assert AuditEvent.objects.filter(organization=owner.organization, action="invitation.revoke").exists()
    _signed_in(client, UserFactory(username="colleague@victim.example"))
    response = client.post(_link_path(mail.outbox[-1]))
    assert response.status_code == 400 and "was revoked" in response.content.decode()
    assert not Membership.objects.filter(organization=owner.organization, user__email="colleague@victim.example").exists()


def test_an_invitation_from_an_admin_since_demoted_grants_nothing(org, owner, client):
    """Before, a rogue admin's invitation to a second address of their own outlived their removal."""
    rogue = Client()
    rogue_user = UserFactory()
    membership = MembershipFactory(organization=org, user=rogue_user, role=Role.ADMIN)
    rogue.force_login(rogue_user)
    rogue.user, rogue.organization = rogue_user, org
    invitation = _invite(rogue, "second@rogue.example", role=Role.ADMIN)
    membership.role = Role.MEMBER  # the owner demotes the rogue admin
    membership.save(update_fields=["role"])

    _signed_in(client, UserFactory(username="second@rogue.example"))
    response = client.post(_link_path(mail.outbox[-1]))
    assert response.status_code == 400 and "may no longer invite" in response.content.decode()
    assert not Membership.objects.filter(organization=org, user__email="second@rogue.example").exists()
    assert Invitation.objects.get(pk=invitation.pk).accepted_at is None


@pytest.mark.parametrize("change", ["remove", "demote"])
def test_a_rogue_admins_pending_invitations_end_with_their_seat_and_stay_dead_when_it_comes_back(org, owner, client,
                                                                                                change):
    """Before, an invitation from an admin removed (or demoted) was refused only while they were away: listed as
    pending, and good again, to a second address of theirs as admin, once they were invited back or promoted again."""
    rogue = Client()
    rogue_user = UserFactory()
    MembershipFactory(organization=org, user=rogue_user, role=Role.ADMIN)
    rogue.force_login(rogue_user)
    rogue.user, rogue.organization = rogue_user, org
    invitation = _invite(rogue, "second@rogue.example", role=Role.ADMIN)
    kept = _invite(owner, "colleague@victim.example")
    link = _link_path(mail.outbox[-2])
    membership = Membership.objects.get(organization=org, user=rogue_user)

    if change == "remove":
        assert owner.post(reverse("console:member-remove", args=[membership.pk])).status_code == 302
        back = _invite(owner, rogue_user.email, role=Role.ADMIN)
        invitations.accept_invitation(services.Actor(user=rogue_user), back)
    else:
        for role in (Role.MEMBER, Role.ADMIN):
            assert owner.post(reverse("console:member-role", args=[membership.pk]), {"role": role}).status_code == 302
    assert Membership.objects.get(organization=org, user=rogue_user).role == Role.ADMIN

    _signed_in(client, UserFactory(username="second@rogue.example"))
    response = client.post(link)
    assert response.status_code == 400 and "was revoked" in response.content.decode()
    assert not Membership.objects.filter(organization=org, user__email="second@rogue.example").exists()
    assert Invitation.objects.get(pk=kept.pk).status == "pending"
    revoked = AuditEvent.objects.get(action="invitation.revoke", target_id=str(invitation.pk))
    assert revoked.details == {"email": "second@rogue.example", "reason": f"member.{'remove' if change == 'remove' else 'change_role'}"}


def test_an_invitation_sent_while_its_sender_is_being_removed_is_refused(org, owner, monkeypatch):
    """The sender's role was read before their removal committed and the invitation written after the removal had
    revoked their pending ones: a pending invitation of a non-member, good again once they were invited back."""
    rogue = UserFactory()
    seat = MembershipFactory(organization=org, user=rogue, role=Role.ADMIN)
    read_role = members.actor_role  # `members.ensure_admin`, which invitations ask

    def role_then_removed(actor, organization):
        role = read_role(actor, organization)
        if actor.user == rogue and Membership.objects.filter(pk=seat.pk).exists():
            members.remove_member(services.Actor(user=owner.user), Membership.objects.get(pk=seat.pk))
        return role

    monkeypatch.setattr(members, "actor_role", role_then_removed)
    with pytest.raises(members.NotPermitted):
        invitations.invite_member(services.Actor(user=rogue), org, email="second@rogue.example", role=Role.ADMIN)
    assert not Invitation.objects.filter(organization=org, invited_by=rogue).exists()


def test_an_expired_invitation_cannot_be_accepted(owner, client):
    invitation = _invite(owner)
    Invitation.objects.filter(pk=invitation.pk).update(expires_at=timezone.now())
    _signed_in(client, UserFactory(username="colleague@victim.example"))
    response = client.post(_link_path(mail.outbox[-1]))
    assert response.status_code == 400 and "has expired" in response.content.decode()
    assert not Membership.objects.filter(organization=owner.organization, user__email="colleague@victim.example").exists()


def test_a_forged_link_is_not_an_invitation(owner, client):
    invitation = _invite(owner)
    _signed_in(client, UserFactory(username="colleague@victim.example"))
    forged = reverse("invitation", args=[f"{invitation.pk}:forged:signature"])
    assert client.post(forged).status_code == 404
    assert not Membership.objects.filter(user__email="colleague@victim.example").exists()


def test_an_anonymous_visitor_is_asked_to_log_in_first(owner, client):
    _invite(owner)
    response = client.get(_link_path(mail.outbox[-1]))
    assert response.status_code == 302 and response.url.startswith(reverse("login"))


def test_one_pending_invitation_per_email(owner):
    _invite(owner)
    response = owner.post(reverse("console:members"), {"email": "COLLEAGUE@victim.example", "role": Role.ADMIN})
    assert response.status_code == 400 and "pending" in response.content.decode()


def test_invitations_are_throttled_per_address_and_per_organisation_revoked_ones_too(org, member_client_factory):
    """Before, invite and revoke in a loop mailed one address without end, and any number of addresses got
    mail naming an organisation the sender chose."""
    owner = signed_in_api_client(member_client_factory(org, Role.OWNER).user)

    def invite(email):
        return owner.post("/api/v1/invitations/", {"email": email, "role": "viewer"}, format="json")

    for _ in range(3):
        created = invite("target@example.test")
        assert created.status_code == 201
        assert owner.post(f"/api/v1/invitations/{created.json()['id']}/revoke/").status_code == 200
    refused = invite("target@example.test")
    assert refused.status_code == 429 and int(refused["Retry-After"]) > 0
    for n in range(17):  # 20 attempts an hour for the organisation; the refused one, which did nothing, not counted
        assert invite(f"person-{n}@example.test").status_code == 201
    assert invite("one-more@example.test").status_code == 429
    assert len(mail.outbox) == 20


def test_invitations_are_throttled_per_inviting_user_and_per_client_address_across_organisations():
    """Sign-up makes organisations freely: before, each new one had 20 invitations an hour of its own."""
    from controlplane.accounts import throttle

    def limit(per):
        return next(limit for limit in throttle.INVITATIONS if limit.per == per).num_attempts

    def own_organisations(user, number):
        return [MembershipFactory(user=user, role=Role.OWNER).organization for _ in range(number)]

    inviter = UserFactory()
    organisations = own_organisations(inviter, limit("user") // limit("organization") + 1)
    for n in range(limit("user")):
        invitations.invite_member(services.Actor(user=inviter, source_ip=f"10.9.{n // 200}.{n % 200 + 1}"),
                                  organisations[n // limit("organization")], email=f"p{n}@example.test", role=Role.VIEWER)
    with pytest.raises(invitations.TooManyInvitations):
        invitations.invite_member(services.Actor(user=inviter, source_ip="10.9.99.1"), organisations[-1],
                                  email="one-more@example.test", role=Role.VIEWER)
    for n in range(limit("ip")):
        someone = UserFactory()
        invitations.invite_member(services.Actor(user=someone, source_ip="10.8.0.1"), own_organisations(someone, 1)[0],
                                  email=f"q{n}@example.test", role=Role.VIEWER)
    someone = UserFactory()
    with pytest.raises(invitations.TooManyInvitations):
        invitations.invite_member(services.Actor(user=someone, source_ip="10.8.0.1"), own_organisations(someone, 1)[0],
                                  email="one-more@example.test", role=Role.VIEWER)
    assert len(mail.outbox) == limit("user") + limit("ip")


def test_members_are_no_longer_added_directly_by_email(owner_client):
    newcomer = UserFactory()
    response = owner_client.post("/api/v1/members/", {"email": newcomer.email, "role": "member"}, format="json")
    assert response.status_code == 405
    assert not Membership.objects.filter(user=newcomer).exists()


@pytest.mark.parametrize("email", ['"a\x1b]0;pwned\x07"@example.test', '"a\x1b[2Jb"@example.test', '"a\x0bb"@example.test'])
def test_an_address_holding_control_characters_is_refused_and_nobody_is_invited(org, member_client_factory, email):
    """A quoted local part passes Django's email check with an escape sequence in it: it reached the members page,
    the audit log and the mail log (an operator's terminal ran it: a window title, a cleared screen)."""
    owner = signed_in_api_client(member_client_factory(org, Role.OWNER).user)
    refused = owner.post("/api/v1/invitations/", {"email": email, "role": "viewer"}, format="json")
    assert refused.status_code == 400 and list(refused.json()) == ["email"]
    assert not Invitation.objects.exists() and mail.outbox == []


def test_the_api_creates_lists_and_revokes_invitations(org, member_client_factory):
    owner = signed_in_api_client(member_client_factory(org, Role.OWNER).user)
    member = signed_in_api_client(member_client_factory(org, Role.MEMBER).user)
    created = owner.post("/api/v1/invitations/", {"email": "New@Example.test", "role": "viewer"}, format="json")
    assert created.status_code == 201
    body = created.json()
    assert (body["email"], body["role"], body["status"]) == ("new@example.test", "viewer", "pending")
    assert len(mail.outbox) == 1 and mail.outbox[0].to == ["new@example.test"]
    assert [row["email"] for row in owner.get("/api/v1/invitations/").json()["results"]] == ["new@example.test"]
    duplicate = owner.post("/api/v1/invitations/", {"email": "new@example.test", "role": "viewer"}, format="json")
    assert duplicate.status_code == 400 and "email" in duplicate.json()
    assert member.post("/api/v1/invitations/", {"email": "x@example.test", "role": "viewer"}, format="json").status_code == 403
    assert member.get("/api/v1/invitations/").status_code == 403
    revoked = owner.post(f"/api/v1/invitations/{body['id']}/revoke/")
    assert revoked.status_code == 200 and revoked.json()["status"] == "revoked"
    assert owner.get("/api/v1/invitations/").json()["results"] == []
    assert owner.get("/api/v1/invitations/?status=all").json()["results"][0]["status"] == "revoked"


def test_the_api_refuses_bad_input_and_unknown_fields(owner_client):
    owner_client = signed_in_api_client(owner_client.user)
    assert owner_client.post("/api/v1/invitations/", {"email": "nope", "role": "viewer"}, format="json").status_code == 400
    assert owner_client.post("/api/v1/invitations/", {"email": "a@b.test", "role": "god"}, format="json").status_code == 400
    response = owner_client.post("/api/v1/invitations/", {"email": "a@b.test", "role": "viewer", "status": "accepted"},
                                 format="json")
    assert response.status_code == 400 and "status" in response.json()


def test_only_owners_invite_owners(org, member_client_factory):
    """A 403, as the schema says of a role that does not allow it (a 400 before: tests/test_roles.py)."""
    admin = signed_in_api_client(member_client_factory(org, Role.ADMIN).user)
    response = admin.post("/api/v1/invitations/", {"email": "boss@example.test", "role": "owner"}, format="json")
    assert response.status_code == 403 and "Only owners may grant" in response.json()["detail"]
    assert not org.invitations.exists()


def test_another_organisations_invitation_is_a_404(owner_client):
    foreign = invitations.invite_member(services.SYSTEM, OrganizationFactory(), email="x@example.test", role=Role.MEMBER)
    assert owner_client.get(f"/api/v1/invitations/{foreign.pk}/").status_code == 404
    assert owner_client.post(f"/api/v1/invitations/{foreign.pk}/revoke/").status_code == 404
    assert Invitation.objects.get(pk=foreign.pk).status == "pending"


def test_the_schema_documents_invitations(owner_client):
    paths = owner_client.get("/api/schema/?format=json").json()["paths"]
    assert {"get", "post"} <= set(paths["/api/v1/invitations/"])
    assert "change only when signed in" in paths["/api/v1/invitations/"]["post"]["responses"]["403"]["description"]
    assert "post" in paths["/api/v1/invitations/{id}/revoke/"]
    assert "post" not in paths["/api/v1/members/"]


@pytest.mark.django_db(transaction=True)
def test_two_accepts_at_once_make_one_membership():
    organization = OrganizationFactory()
    invitee = UserFactory(username="both@example.test")
    invitation = invitations.invite_member(services.SYSTEM, organization, email="both@example.test", role=Role.ADMIN)
    start, results = threading.Barrier(2), []

    def accept():
        try:
            start.wait(timeout=30)
            results.append(invitations.accept_invitation(services.Actor(user=invitee), invitation).pk)
        except Exception as exc:  # noqa: BLE001 - the assertion below shows it
            results.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=accept) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == 2 and results[0] == results[1], results
    assert Membership.objects.filter(organization=organization, user=invitee).count() == 1
    assert AuditEvent.objects.filter(organization=organization, action="invitation.accept").count() == 1


def test_an_invitation_does_not_change_an_existing_members_role(owner):
    colleague = UserFactory(username="colleague@victim.example")
    invitation = invitations.invite_member(services.SYSTEM, owner.organization, email=colleague.email, role=Role.ADMIN)
    MembershipFactory(organization=owner.organization, user=colleague, role=Role.VIEWER)
    membership = invitations.accept_invitation(services.Actor(user=colleague), invitation)
    assert membership.role == Role.VIEWER


def _key_client(secret: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client


@pytest.mark.parametrize("role", [Role.OWNER, Role.ADMIN])
def test_no_api_key_invites_anyone_only_a_signed_in_admin_does(org, member_client_factory, role):
    """Before, any `manage` key of an admin or owner invited, and the seat outlived the key (see the next test)."""
    with_key = member_client_factory(org, role)  # an unbounded key: no expiry, the platform's limits, no cap
    refused = with_key.post("/api/v1/invitations/", {"email": "new@example.test", "role": "member"}, format="json")
    assert refused.status_code == 403
    assert "never with an API key" in refused.json()["detail"] and "console" in refused.json()["detail"]
    assert not Invitation.objects.exists() and mail.outbox == []
    signed_in = signed_in_api_client(with_key.user)
    created = signed_in.post("/api/v1/invitations/", {"email": "new@example.test", "role": "member"}, format="json")
    assert created.status_code == 201 and Invitation.objects.get().invited_by == with_key.user


def test_a_leaked_key_that_expires_gives_its_holder_no_seat_that_outlives_it(owner_client):
    """The review's attack: a key bounded by an expiry, rate limits and a spend cap invited an address its holder
    controlled, as owner; once accepted, the stranger removed the real owner and held the organisation for good."""
    made = signed_in_api_client(owner_client.user).post("/api/v1/keys/", {
        "name": "ci", "scopes": ["manage"], "requests_per_minute": 5,
        "expires_at": (timezone.now() + timedelta(minutes=30)).isoformat()}, format="json")
    assert made.status_code == 201, made.json()
    leaked = _key_client(made.json()["secret"])
    for role in (Role.OWNER, Role.ADMIN, Role.VIEWER):
        invited = leaked.post("/api/v1/invitations/", {"email": "stranger@evil.test", "role": role}, format="json")
        assert invited.status_code == 403, invited.json()
    assert not Invitation.objects.filter(email="stranger@evil.test").exists()
    assert not AuditEvent.objects.filter(action="invitation.create").exists()


def test_the_migration_revokes_the_pending_invitations_keys_made_and_audits_each(org, member_client_factory):
    with_key = member_client_factory(org, Role.OWNER)
    made_with_key = invitations.invite_member(services.SYSTEM, org, email="by-key@example.test", role=Role.OWNER)
    accepted_with_key = invitations.invite_member(services.SYSTEM, org, email="joined@example.test", role=Role.MEMBER)
    made_in_session = invitations.invite_member(services.SYSTEM, org, email="by-hand@example.test", role=Role.MEMBER)
    # As invitations made with a key before this change were audited: the event names the key.
    made_with_keys = [str(made_with_key.pk), str(accepted_with_key.pk)]
    AuditEvent.objects.filter(action="invitation.create", target_id__in=made_with_keys).update(
        api_key=org.api_keys.get(created_by=with_key.user))
    Invitation.objects.filter(pk=accepted_with_key.pk).update(accepted_at=timezone.now())

    migration = importlib.import_module("controlplane.accounts.migrations.0010_revoke_invitations_made_with_keys")
    migration.revoke_invitations_made_with_keys(apps, None)

    assert Invitation.objects.get(pk=made_with_key.pk).status == "revoked"
    assert Invitation.objects.get(pk=accepted_with_key.pk).status == "accepted"
    assert Invitation.objects.get(pk=made_in_session.pk).status == "pending"
    event = AuditEvent.objects.get(action="invitation.revoke")
    assert (event.organization, event.target_id, event.details) == (
        org, str(made_with_key.pk), {"email": "by-key@example.test", "reason": "made with an API key"})


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("change", ["remove", "demote"])
def test_an_invitation_accepted_while_its_sender_is_removed_or_demoted_is_one_or_the_other(monkeypatch, change):
    """A guard (it held before): accepting locks the organisation's row, then the invitation's, so the sender's removal
    or demotion, which takes the organisation's row and then revokes their pending invitations, waits for the accept
    to commit and finds it accepted. Were the invitation's row locked alone, the two would wait on each other (the
    membership's foreign keys lock the organisation's row at commit) and PostgreSQL would fail one of them."""
    organization = OrganizationFactory()
    owner, sender, invitee = UserFactory(), UserFactory(), UserFactory(username="new@example.test")
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    seat = MembershipFactory(organization=organization, user=sender, role=Role.ADMIN)
    invitation = invitations.invite_member(services.Actor(user=sender), organization, email=invitee.email,
                                           role=Role.MEMBER)
    failures: list[BaseException] = []

    def change_then_close():
        try:
            membership, actor = Membership.objects.get(pk=seat.pk), services.Actor(user=owner)
            if change == "remove":
                members.remove_member(actor, membership)
            else:
                members.change_member_role(actor, membership, role=Role.MEMBER)
        except Exception as exc:  # noqa: BLE001 - the assertion below shows it
            failures.append(exc)
        finally:
            connection.close()

    changing = threading.Thread(target=change_then_close)
    record_audit = invitations.record_audit

    def record_audit_while_the_sender_changes(actor, organization, action, *args, **kwargs):
        if action == "invitation.accept":
            changing.start()
            wait_until(lambda: not changing.is_alive() or _waiting_on_a_lock(), 60, message="the change to wait or end")
        return record_audit(actor, organization, action, *args, **kwargs)

    monkeypatch.setattr(invitations, "record_audit", record_audit_while_the_sender_changes)
    invitations.accept_invitation(services.Actor(user=invitee), invitation)
    changing.join(timeout=60)

    assert failures == []
    assert Membership.objects.filter(organization=organization, user=invitee).exists()  # accepted first
    assert Invitation.objects.get(pk=invitation.pk).status == "accepted"


@pytest.mark.django_db(transaction=True)
def test_an_invitation_revoked_while_its_sender_is_removed_is_revoked_once_and_neither_fails(monkeypatch):
    """Revoking locked the invitation's row, and its audit event's foreign keys lock the organisation's row at commit;
    the sender's removal takes the organisation's row, then revokes their pending invitations: each waited on the
    other, and PostgreSQL failed one of them (a 500)."""
    organization = OrganizationFactory()
    owner, sender = UserFactory(), UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    seat = MembershipFactory(organization=organization, user=sender, role=Role.ADMIN)
    invitation = invitations.invite_member(services.Actor(user=sender), organization, email="new@example.test",
                                           role=Role.MEMBER)
    failures: list[BaseException] = []

    def remove_then_close():
        try:
            members.remove_member(services.Actor(user=owner), Membership.objects.get(pk=seat.pk))
        except Exception as exc:  # noqa: BLE001 - the assertion below shows it
            failures.append(exc)
        finally:
            connection.close()

    removing = threading.Thread(target=remove_then_close)
    record_audit = invitations.record_audit

    def record_audit_while_the_sender_is_removed(actor, organization, action, *args, **kwargs):
        removing.start()
        wait_until(lambda: not removing.is_alive() or _waiting_on_a_lock(), 60, message="the removal to wait or end")
        return record_audit(actor, organization, action, *args, **kwargs)

    monkeypatch.setattr(invitations, "record_audit", record_audit_while_the_sender_is_removed)
    invitations.revoke_invitation(services.Actor(user=owner), invitation)
    removing.join(timeout=60)

    assert failures == []
    assert not Membership.objects.filter(pk=seat.pk).exists()
    assert Invitation.objects.get(pk=invitation.pk).status == "revoked"
    assert AuditEvent.objects.filter(action="invitation.revoke", target_id=str(invitation.pk)).count() == 1


@pytest.mark.parametrize("role", [Role.OWNER, Role.ADMIN])
def test_a_sender_deleted_outside_the_admin_leaves_an_invitation_that_grants_nothing(role):
    """A null sender read as the platform: a sender deleted from the shell (or by a cascade) left pending invitations
    that granted their role, owner included, to whoever held the address (a review's finding)."""
    organization = OrganizationFactory()
    sender, invitee = UserFactory(), UserFactory(username="new@example.test")
    MembershipFactory(organization=organization, role=Role.OWNER)
    MembershipFactory(organization=organization, user=sender, role=Role.OWNER)
    invitation = invitations.invite_member(services.Actor(user=sender), organization, email=invitee.email, role=role)

    sender.delete()

    invitation = Invitation.objects.get(pk=invitation.pk)
    assert "may no longer invite" in (invitations.invitation_refusal(invitation, invitee) or "")
    with pytest.raises(invitations.InvitationRefused):
        invitations.accept_invitation(services.Actor(user=invitee), invitation)
    assert not Membership.objects.filter(organization=organization, user=invitee).exists()


def test_the_platforms_own_invitations_are_marked_and_still_accepted():
    organization = OrganizationFactory()
    invitee = UserFactory(username="new@example.test")
    invitation = invitations.invite_member(services.SYSTEM, organization, email=invitee.email, role=Role.OWNER)

    assert invitation.from_platform and invitation.invited_by_id is None
    assert invitations.accept_invitation(services.Actor(user=invitee), invitation).role == Role.OWNER


def test_an_invitation_written_by_a_web_pod_still_on_the_code_before_the_flag_is_not_the_platforms():
    # A rolling deploy: the migration runs while pods of the code before it still invite, with the columns they know.
    # Before: a NOT NULL column without a database default refused their INSERT (a 500 for every invite).
    organization, sender = OrganizationFactory(), UserFactory()
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO controlplane_invitation (organization_id, email, role, invited_by_id, created_at, expires_at)"
            " VALUES (%s, %s, %s, %s, now(), now() + interval '1 day') RETURNING id",
            [organization.pk, "old-pod@example.test", Role.MEMBER, sender.pk],
        )
        (invitation_id,) = cursor.fetchone()
    assert Invitation.objects.get(pk=invitation_id).from_platform is False


@pytest.mark.django_db(transaction=True)
def test_an_invitation_sent_while_the_admin_deletes_its_sender_grants_nothing():
    """The admin's delete revokes the user's pending invitations, then deletes the user: one sent in between (in an
    organisation whose row the revocation never locked) lost its sender and became the platform's, an owner's seat."""
    first, second = OrganizationFactory(), OrganizationFactory()
    sender, accomplice = UserFactory(), UserFactory(username="accomplice@example.test")
    MembershipFactory(organization=first, user=sender, role=Role.OWNER)
    MembershipFactory(organization=second, user=sender, role=Role.OWNER)
    MembershipFactory(organization=second, role=Role.OWNER)
    invitations.invite_member(services.Actor(user=sender), first, email="x@example.test", role=Role.MEMBER)
    sent = {}

    def invite_then_close():
        try:
            sent["invitation"] = invitations.invite_member(services.Actor(user=sender), second,
                                                           email=accomplice.email, role=Role.OWNER)
        finally:
            connection.close()

    with transaction.atomic():  # as the admin's `_revoke_what_they_made` and then its delete run
        actor = services.Actor(source_ip="127.0.0.1")
        members.revoke_invitations_sent_by(actor, sender, reason="user.delete")
        inviting = threading.Thread(target=invite_then_close)
        inviting.start()
        inviting.join(timeout=60)
        sender.delete()

    invitation = Invitation.objects.get(pk=sent["invitation"].pk)
    assert invitations.invitation_refusal(invitation, accomplice) is not None
    with pytest.raises(invitations.InvitationRefused):
        invitations.accept_invitation(services.Actor(user=accomplice), invitation)
    assert not Membership.objects.filter(organization=second, user=accomplice).exists()


def test_the_migration_revokes_pending_invitations_whose_sender_was_deleted_and_audits_each():
    organization = OrganizationFactory()
    sender = UserFactory()
    MembershipFactory(organization=organization, user=sender, role=Role.OWNER)
    orphaned = invitations.invite_member(services.Actor(user=sender), organization, email="a@example.test",
                                         role=Role.OWNER)
    accepted = invitations.invite_member(services.Actor(user=sender), organization, email="b@example.test",
                                         role=Role.MEMBER)
    platform = invitations.invite_member(services.SYSTEM, organization, email="c@example.test", role=Role.MEMBER)
    Invitation.objects.filter(pk=accepted.pk).update(accepted_at=timezone.now())
    # As a deletion before this change left them: the sender gone, nothing marked.
    Invitation.objects.filter(pk__in=[orphaned.pk, accepted.pk]).update(invited_by=None)

    migration = importlib.import_module("controlplane.accounts.migrations.0013_invitation_from_platform")
    migration.revoke_pending_invitations_of_deleted_senders(apps, None)

    assert Invitation.objects.get(pk=orphaned.pk).status == "revoked"
    assert Invitation.objects.get(pk=accepted.pk).status == "accepted"
    assert Invitation.objects.get(pk=platform.pk).status == "pending"
    event = AuditEvent.objects.get(action="invitation.revoke")
    assert (event.organization, event.target_id, event.details) == (
        organization, str(orphaned.pk), {"email": "a@example.test", "reason": "sender deleted"})


def _accept_in_a_thread(invitee, invitation, failures) -> threading.Thread:
    def accept_then_close():
        try:
            invitations.accept_invitation(services.Actor(user=invitee), Invitation.objects.get(pk=invitation.pk))
        except Exception as exc:  # noqa: BLE001 - the assertion shows it
            failures.append(exc)
        finally:
            connection.close()

    return threading.Thread(target=accept_then_close)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("change", ["remove", "demote"])
def test_an_invitation_accepted_once_its_senders_removal_or_demotion_holds_the_organisation_waits_and_is_refused(
    monkeypatch, change
):
    """Accepting locked the invitation's row, then the organisation's (one query locks in table order); a removal or
    demotion that already held the organisation's row then revoked the invitation: each waited on the other, and
    PostgreSQL failed one (a 500)."""
    organization = OrganizationFactory()
    owner, sender, invitee = UserFactory(), UserFactory(), UserFactory(username="new@example.test")
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    seat = MembershipFactory(organization=organization, user=sender, role=Role.ADMIN)
    invitation = invitations.invite_member(services.Actor(user=sender), organization, email=invitee.email,
                                           role=Role.MEMBER)
    failures: list[BaseException] = []
    accepting = _accept_in_a_thread(invitee, invitation, failures)
    record_audit = members.record_audit

    def record_audit_while_the_invitee_accepts(actor, organization, action, *args, **kwargs):
        if action in ("member.remove", "member.change_role") and accepting.ident is None:  # the row is held
            accepting.start()
            wait_until(lambda: not accepting.is_alive() or _waiting_on_a_lock(), 60, message="the accept to wait")
        return record_audit(actor, organization, action, *args, **kwargs)

    monkeypatch.setattr(members, "record_audit", record_audit_while_the_invitee_accepts)
    actor = services.Actor(user=owner)
    if change == "remove":
        members.remove_member(actor, Membership.objects.get(pk=seat.pk))
    else:
        members.change_member_role(actor, Membership.objects.get(pk=seat.pk), role=Role.MEMBER)
    accepting.join(timeout=60)

    assert [type(failure) for failure in failures] == [invitations.InvitationRefused]
    assert Invitation.objects.get(pk=invitation.pk).status == "revoked"
    assert not Membership.objects.filter(organization=organization, user=invitee).exists()


@pytest.mark.django_db(transaction=True)
def test_an_invitation_accepted_while_an_owner_revokes_it_is_revoked_and_neither_fails(monkeypatch):
    organization = OrganizationFactory()
    owner, invitee = UserFactory(), UserFactory(username="new@example.test")
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)
    invitation = invitations.invite_member(services.Actor(user=owner), organization, email=invitee.email,
                                           role=Role.MEMBER)
    failures: list[BaseException] = []
    accepting = _accept_in_a_thread(invitee, invitation, failures)
    revoke = Invitation.objects.filter

    def filter_once_the_organisation_is_held(*args, **kwargs):  # revoke_invitation's conditional update
        if accepting.ident is None:
            accepting.start()
            wait_until(lambda: not accepting.is_alive() or _waiting_on_a_lock(), 60, message="the accept to wait")
        return revoke(*args, **kwargs)

    monkeypatch.setattr(Invitation.objects, "filter", filter_once_the_organisation_is_held)
    invitations.revoke_invitation(services.Actor(user=owner), invitation)
    monkeypatch.undo()
    accepting.join(timeout=60)

    assert [type(failure) for failure in failures] == [invitations.InvitationRefused]
    assert Invitation.objects.get(pk=invitation.pk).status == "revoked"
    assert not Membership.objects.filter(organization=organization, user=invitee).exists()


def test_repeats_refused_as_pending_spend_no_part_of_the_addresss_budget_shared_by_every_organisation(
    org, member_client_factory
):
    """Before (the tenancy review): one invitation and two repeats refused as pending, from a throwaway organisation,
    spent the address's 3 a day, and every other organisation was refused inviting it until the next day."""
    hostile = signed_in_api_client(member_client_factory(OrganizationFactory(), Role.OWNER).user)
    for _ in range(3):
        hostile.post("/api/v1/invitations/", {"email": "wanted@example.test", "role": "viewer"}, format="json")
    owner = signed_in_api_client(member_client_factory(org, Role.OWNER).user)
    answer = owner.post("/api/v1/invitations/", {"email": "wanted@example.test", "role": "viewer"}, format="json")
    assert answer.status_code == 201


@pytest.mark.django_db(transaction=True)
def test_repeats_sent_at_once_refused_as_pending_spend_no_part_of_the_addresss_budget(monkeypatch):
    """Before (a review's probe): the pending check before the throttle did not cover repeats sent at once: all three
    passed it, all three counted, two were refused under the lock, and the victim organisation's invitation to that
    address was refused (TooManyInvitations) for the day. Here all three pass the first check before any takes the
    lock, every time."""
    hostile_org, victim_org = OrganizationFactory(), OrganizationFactory()
    hostile, victim = UserFactory(), UserFactory()
    MembershipFactory(organization=hostile_org, user=hostile, role=Role.OWNER)
    MembershipFactory(organization=victim_org, user=victim, role=Role.OWNER)
    lock = invitations.lock_organizations
    all_past_the_first_check = threading.Barrier(3)

    def lock_once_all_checked(organization_ids):
        all_past_the_first_check.wait(timeout=20)
        return lock(organization_ids)

    monkeypatch.setattr(invitations, "lock_organizations", lock_once_all_checked)
    outcomes = []

    def send():
        try:
            invitations.invite_member(services.Actor(user=hostile, source_ip="203.0.113.5"), hostile_org,
                                      email="wanted@example.test", role=Role.VIEWER)
            outcomes.append("sent")
        except Exception as exc:  # noqa: BLE001 - what each caller got
            outcomes.append(type(exc).__name__)
        finally:
            connection.close()

    threads = [threading.Thread(target=send) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    monkeypatch.setattr(invitations, "lock_organizations", lock)

    assert sorted(outcomes) == ["AlreadyInvited", "AlreadyInvited", "sent"]
    invitations.invite_member(services.Actor(user=victim, source_ip="198.51.100.7"), victim_org,
                              email="wanted@example.test", role=Role.VIEWER)  # the address's second of 3 today
    assert Invitation.objects.filter(email="wanted@example.test").count() == 2
