"""Names a tenant sets and another person reads (an API key's, an organisation's, an invited address) hold no
character that hides or reorders the text shown (`controlplane.text.name_problem`): a direction override, another
format or control character, a private-use or unassigned code point, a line or paragraph separator. They are stored
NFC, their length counted so; one stored before the rule is shown with those characters escaped, never as it reads."""

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core import mail
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from controlplane.accounts.models import ApiKey, AuditEvent, Invitation, Organization, Role
from tests.factories import signed_in_api_client

pytestmark = pytest.mark.django_db

# A key that reads "prod-key" in a right-to-left override, its text stored as "yek-dorp": Trojan Source's trick.
SPOOFED = "\u202eyek-dorp"
HIDDEN = {
    "right-to-left override": "\u202e", "left-to-right embedding": "\u202a", "first-strong isolate": "\u2068",
    "pop directional isolate": "\u2069", "right-to-left mark": "\u200f", "Arabic letter mark": "\u061c",
    "zero-width space": "\u200b", "private use": "\ue000", "unassigned": "\u0378", "line separator": "\u2028",
    # Letters (Lo) and a mark (Mn) that render as nothing, default-ignorable: a key named "\u3164" looked unnamed, and
    # "prod\u3164key" as "prod key" (the review of the name rule)
    "Hangul filler": "\u3164", "Hangul choseong filler": "\u115f", "halfwidth Hangul filler": "\uffa0",
    "combining grapheme joiner": "\u034f", "Khmer inherent vowel": "\u17b4",
    # Variation selectors after a letter they do not vary (marks, Mn): "prod\U000e0100-key" read "prod-key"
    "Mongolian free variation selector": "\u180b", "Mongolian free variation selector four": "\u180f",
    "ideographic variation selector": "\U000e0100", "last ideographic variation selector": "\U000e01ef",
    # And the standard ones after a letter (an emoji's U+FE0F is allowed after an emoji): "prod\ufe0f-key" read
    # "prod-key" (the review of the variation selector rule)
    "standard variation selector": "\ufe00", "emoji presentation selector": "\ufe0f", "text selector": "\ufe0e",
}


@pytest.mark.parametrize("hidden", HIDDEN.values(), ids=HIDDEN.keys())
def test_an_api_key_named_with_a_hidden_or_reordering_character_is_refused_with_a_field_error(owner_client, hidden):
    refused = owner_client.post("/api/v1/keys/", {"name": f"prod{hidden}-key", "scopes": ["inference"]}, format="json")
    assert refused.status_code == 400, refused.content
    assert list(refused.json()) == ["name"] and f"U+{ord(hidden):04X}" in refused.json()["name"][0]
    assert ApiKey.objects.count() == 1  # the fixture's own


def test_a_key_name_may_hold_a_variation_selector_after_a_character_of_its_own_script(owner_client):
    """A Mongolian word's letter form and a Japanese family name's ideograph glyph are a name's own (only a selector
    after another script's character, or at the start, shows as nothing)."""
    for name in ("\u182e\u1823\u180b\u1829\u182d\u1823\u182f", "\u845b\U000e0100\u57ce", "\u2764\ufe0f ops",
                 "\u203c\ufe0f \u00a9\ufe0e", "team 1\ufe0f\u20e3", "\u8279\ufe00"):
        created = owner_client.post("/api/v1/keys/", {"name": name, "scopes": ["inference"]}, format="json")
        assert created.status_code == 201, created.content
        assert created.json()["api_key"]["name"] == name
    refused = owner_client.post("/api/v1/keys/", {"name": "\U000e0100\u845b", "scopes": ["inference"]}, format="json")
    assert refused.status_code == 400 and "U+E0100" in refused.json()["name"][0]


def test_the_console_refuses_a_key_name_with_a_direction_override_next_to_the_field(owner_client):
    console = Client()
    console.force_login(owner_client.user)
    page = console.post(reverse("console:keys"), {"name": SPOOFED, "scopes": ["inference"]}).content.decode()
    assert "U+202E" in page and "direction override" in page
    assert ApiKey.objects.count() == 1


def test_a_key_name_is_stored_composed_and_its_length_counted_so(owner_client):
    """`e` and a combining acute is `é`: 100 of them are a name of 100 characters, not of 200 (refused before)."""
    created = owner_client.post("/api/v1/keys/", {"name": "e\u0301" * 100, "scopes": ["inference"]}, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["api_key"]["name"] == "\u00e9" * 100
    assert ApiKey.objects.get(pk=created.json()["api_key"]["id"]).name == "\u00e9" * 100
    emoji = owner_client.post("/api/v1/keys/", {"name": "\u0645\u062b\u0627\u0644 \U0001f680 test", "scopes": ["inference"]},
                              format="json")
    assert emoji.status_code == 201  # another script, an emoji: a name may hold them


def test_a_key_name_stored_before_the_rule_is_listed_and_shown_escaped_not_reordered(owner_client):
    spoofed = ApiKey.objects.get()
    ApiKey.objects.filter(pk=spoofed.pk).update(name=SPOOFED)
    listed = owner_client.get("/api/v1/keys/")
    assert listed.status_code == 200
    assert [key["name"] for key in listed.json()["results"]] == ["\\u202eyek-dorp"]
    console = Client()
    console.force_login(owner_client.user)
    page = console.get(reverse("console:keys")).content.decode()
    assert "\\u202eyek-dorp" in page and "\u202e" not in page


@pytest.mark.parametrize("hidden", ["\u2028", "\ue000", "\u0378", "\u202e"])
def test_sign_up_refuses_an_organisation_name_with_a_hidden_or_reordering_character(client, hidden):
    page = client.post("/signup/", {"email": "ada@example.test", "password": "a long passphrase 1",
                                    "organization_name": f"Acme{hidden}Corp"}).content.decode()
    assert f"U+{ord(hidden):04X}" in page
    assert not get_user_model().objects.exists() and not Organization.objects.exists()


def test_sign_up_stores_an_organisation_name_composed(client):
    client.post("/signup/", {"email": "ada@example.test", "password": "a long passphrase 1",
                             "organization_name": "Cafe\u0301"})
    assert Organization.objects.get().name == "Caf\u00e9"


def test_an_address_with_a_direction_override_in_its_domain_is_refused_and_nobody_is_invited(org, member_client_factory):
    """Django's email check passes a format character in the domain: the members page and the mail showed another
    address than the one invited."""
    owner = signed_in_api_client(member_client_factory(org, Role.OWNER).user)
    refused = owner.post("/api/v1/invitations/", {"email": "ceo@\u202emoc.elpmaxe", "role": "admin"}, format="json")
    assert refused.status_code == 400 and list(refused.json()) == ["email"]
    assert not Invitation.objects.exists() and mail.outbox == []


def test_an_organisation_name_stored_before_the_rule_is_escaped_in_the_console_and_in_the_invitation_mail(owner_client):
    Organization.objects.filter(pk=owner_client.user.memberships.get().organization_id).update(name="Acme\u202eevil")
    console = Client()
    console.force_login(owner_client.user)
    page = console.get(reverse("console:keys")).content.decode()
    assert "Acme\\u202eevil" in page and "\u202e" not in page
    assert console.post(reverse("console:members"), {"email": "new@example.test", "role": Role.MEMBER}).status_code == 302
    assert "Acme\\u202eevil" in mail.outbox[-1].subject and "\u202e" not in mail.outbox[-1].body


def test_an_audit_event_naming_a_key_from_before_the_rule_is_listed_escaped(owner_client):
    key = owner_client.post("/api/v1/keys/", {"name": "ci", "scopes": ["inference"]}, format="json").json()["api_key"]
    ApiKey.objects.filter(pk=key["id"]).update(name=SPOOFED)
    assert owner_client.post(f"/api/v1/keys/{key['id']}/revoke/").status_code == 200
    events = owner_client.get("/api/v1/audit-log/").json()["results"]
    revoked = next(event for event in events if event["action"] == "api_key.revoke")
    assert revoked["target_repr"].startswith("\\u202eyek-dorp (") and "\u202e" not in revoked["target_repr"]


@pytest.mark.parametrize("email", ["ceo@ex\u05d0ample.test", "a@" + "\u00e9" * 60 + ".test"])
def test_an_address_whose_domain_mail_cannot_encode_is_refused_and_nobody_is_invited(org, member_client_factory, email):
    """Django's email check passes a domain IDNA refuses (a label mixing Hebrew and Latin letters, one past 63 bytes
    encoded); its invitation's mail raised `UnicodeError` as it was sent: a 500."""
    owner = signed_in_api_client(member_client_factory(org, Role.OWNER).user)
    owner.raise_request_exception = False
    refused = owner.post("/api/v1/invitations/", {"email": email, "role": "viewer"}, format="json")
    assert refused.status_code == 400 and list(refused.json()) == ["email"], refused.content
    assert not Invitation.objects.exists() and mail.outbox == []


def test_a_key_named_before_the_rule_is_recorded_escaped_in_the_audit_events_made_from_now_on(owner_client):
    key = owner_client.post("/api/v1/keys/", {"name": "ci", "scopes": ["inference"]}, format="json").json()["api_key"]
    ApiKey.objects.filter(pk=key["id"]).update(name=SPOOFED)
    assert owner_client.post(f"/api/v1/keys/{key['id']}/revoke/").status_code == 200
    stored = AuditEvent.objects.get(action="api_key.revoke").target_repr
    assert stored.startswith("\\u202eyek-dorp (") and "\u202e" not in stored


def test_the_message_after_revoking_a_key_from_before_the_rule_names_it_escaped(owner_client):
    """The console's flash message quoted the key's name raw: "Key “prod-key” was revoked" for a key that is not."""
    key = owner_client.post("/api/v1/keys/", {"name": "ci", "scopes": ["inference"]}, format="json").json()["api_key"]
    ApiKey.objects.filter(pk=key["id"]).update(name=SPOOFED)
    console = Client()
    console.force_login(owner_client.user)
    page = console.post(reverse("console:key-revoke", args=[key["id"]]), follow=True).content.decode()
    assert "was revoked" in page and "\\u202eyek-dorp" in page and "\u202e" not in page


def test_the_message_after_removing_a_member_names_the_organisation_escaped(org, member_client_factory):
    owner = member_client_factory(org, Role.OWNER).user
    removed = member_client_factory(org, Role.MEMBER).user
    Organization.objects.filter(pk=org.pk).update(name="Acme\u202eevil")
    console = Client()
    console.force_login(owner)
    page = console.post(reverse("console:member-remove", args=[removed.memberships.get().pk]), follow=True).content.decode()
    assert "was removed from" in page and "Acme\\u202eevil" in page and "\u202e" not in page


def test_a_name_from_before_the_rule_that_shows_as_nothing_is_shown_escaped():
    from controlplane.text import shown_name

    assert shown_name("\u3164") == "\\u3164" and shown_name("prod\u3164key") == "prod\\u3164key"
    assert shown_name("\u2764\ufe0f ops") == "\u2764\ufe0f ops"  # an emoji's variation selector is part of a name
    assert shown_name("prod\U000e0100") == "prod\\U000e0100" and shown_name("\u845b\U000e0100") == "\u845b\U000e0100"
    assert shown_name("prod\ufe0f-key") == "prod\\ufe0f-key" and shown_name("v1\ufe0f") == "v1\\ufe0f"
    assert shown_name("prod\u2013\ufe0fkey") == "prod\u2013\\ufe0fkey"  # after punctuation that no selector varies
    assert shown_name("\ufe0f\u2764") == "\\ufe0f\u2764" and shown_name("\u2764\ufe0f\ufe0f") == "\u2764\ufe0f\\ufe0f"


SPOOFED_ADDRESS = "ops@ex\u202emoc.elpmaxe"  # allowed before the rule: Django's check passes a format character there


def _with_old_address(user):
    from controlplane.accounts.signup import mark_email_verified

    get_user_model().objects.filter(pk=user.pk).update(email=SPOOFED_ADDRESS)
    user.refresh_from_db()
    mark_email_verified(user)  # as it was when they signed up
    return user


def test_the_api_lists_a_members_address_from_before_the_rule_escaped(org, owner_client, member_client_factory):
    """The members page showed it escaped (`|shown_name`); `/api/v1/members/`, the invitations' `invited_by`, the audit
    log's `actor` and a credential's `created_by` wrote it raw."""
    from controlplane.accounts.services import Actor
    from endpoints.credentials import create_credential

    member = _with_old_address(member_client_factory(org, Role.ADMIN).user)
    Invitation.objects.create(organization=org, email="new@example.test", role=Role.VIEWER, invited_by=member,
                              expires_at=timezone.now() + timedelta(days=1))
    create_credential(Actor(user=member), org, name="hub", kind="hf", hf_token="hf_" + "x" * 30)
    answers = {
        "members": [row["email"] for row in owner_client.get("/api/v1/members/").json()["results"]],
        "invitations": [row["invited_by"] for row in owner_client.get("/api/v1/invitations/").json()["results"]],
        "credentials": [row["created_by"] for row in owner_client.get("/api/v1/credentials/").json()["results"]],
        "audit log": [row["actor"] for row in owner_client.get("/api/v1/audit-log/").json()["results"]],
    }
    escaped = "ops@ex\\u202emoc.elpmaxe"
    assert all(escaped in shown for shown in answers.values()), answers
    assert not any("\u202e" in str(address) for shown in answers.values() for address in shown), answers


def test_the_credentials_page_names_a_creator_whose_address_is_from_before_the_rule_escaped(org, owner_client,
                                                                                            member_client_factory):
    from controlplane.accounts.services import Actor
    from endpoints.credentials import create_credential

    member = _with_old_address(member_client_factory(org, Role.ADMIN).user)
    create_credential(Actor(user=member), org, name="hub", kind="hf", hf_token="hf_" + "x" * 30)
    console = Client()
    console.force_login(owner_client.user)
    page = console.get(reverse("console:credentials")).content.decode()
    assert "ops@ex\\u202emoc.elpmaxe" in page and "\u202e" not in page


def test_the_invitation_mail_names_an_inviter_whose_address_is_from_before_the_rule_escaped(org, member_client_factory):
    inviter = _with_old_address(member_client_factory(org, Role.OWNER).user)
    console = Client()
    console.force_login(inviter)
    assert console.post(reverse("console:members"), {"email": "new@example.test", "role": Role.MEMBER}).status_code == 302
    assert "ops@ex\\u202emoc.elpmaxe invited you" in mail.outbox[-1].body and "\u202e" not in mail.outbox[-1].body


def test_the_audit_logs_details_name_an_address_from_before_the_rule_escaped(org, owner_client, member_client_factory):
    """An event's details quote addresses (`invitation.accept`'s `email`, `organization.create`'s `owner`): written raw in
    `/api/v1/audit-log/` where its `actor` and `target_repr` are escaped."""
    from controlplane.accounts.services import SYSTEM, record_audit

    record_audit(SYSTEM, org, "invitation.accept", None, email=SPOOFED_ADDRESS, role="member", nested={"to": [SPOOFED]})
    [event] = [row for row in owner_client.get("/api/v1/audit-log/").json()["results"] if row["action"] == "invitation.accept"]
    assert event["details"] == {"email": "ops@ex\\u202emoc.elpmaxe", "role": "member", "nested": {"to": ["\\u202eyek-dorp"]}}


@pytest.mark.parametrize("typed", ["ada@\uff45xample.test", "ada@\uff45\uff58\uff41\uff4d\uff50\uff4c\uff45.test"])
def test_an_address_typed_with_fullwidth_letters_is_stored_as_its_username_and_its_mail_have_it(client, typed):
    """Django folds a username (NFKC: fullwidth "ｅ" is "e", `normalize_username`) and the mail's domain (IDNA);
    sign-up stored the address unfolded beside it, so an invitation to `ada@example.test`, the mailbox that gets its
    mail, was refused to its account as another address's."""
    signed_up = client.post("/signup/", {"email": typed, "password": "a long passphrase 1", "organization_name": "Acme"})
    assert signed_up.status_code == 302, signed_up.content.decode()[:2000]
    client.logout()
    assert client.post("/login/", {"username": typed, "password": "a long passphrase 1"}).status_code == 302
    user = get_user_model().objects.get()
    assert user.email == user.username == "ada@example.test"
