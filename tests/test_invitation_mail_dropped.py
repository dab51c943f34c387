"""An invitation whose mail the senders' full backlog dropped (`mail_sender.send_later`: the relay slow, a flood of
account mails) is said to be unsent, and is not left pending: the inviter may send it again at once. Before, the
console said "We emailed an invitation" and the API answered 201 for a link nobody would ever get, and a second try
was refused as pending ("revoke it to send a new one"). The invitation throttles still count each try."""

import queue

import pytest
from django.core import mail
from django.test import Client
from django.urls import reverse

from controlplane.accounts import mail_sender
from controlplane.accounts.models import AuditEvent, Invitation, Role
from tests.factories import MembershipFactory, UserFactory, signed_in_api_client

pytestmark = pytest.mark.django_db

INVITED = "colleague@example.test"


@pytest.fixture
def full_backlog(settings, monkeypatch):
    """The web process's senders with `MAX_BACKLOG` mails already waiting: `send_later` drops the next one."""
    settings.SEND_MAIL_IN_REQUEST = False
    full = queue.Queue(maxsize=1)
    full.put_nowait(None)
    monkeypatch.setattr(mail_sender, "_senders", lambda: full)

    def drain():
        settings.SEND_MAIL_IN_REQUEST = True
    return drain


@pytest.fixture
def owner(org):
    user = UserFactory()
    MembershipFactory(organization=org, user=user, role=Role.OWNER)
    return user


def test_the_console_says_an_invitation_the_full_backlog_dropped_was_not_sent_and_it_can_be_sent_again(
        org, owner, full_backlog):
    client = Client()
    client.force_login(owner)

    dropped = client.post(reverse("console:members"), {"email": INVITED, "role": Role.MEMBER})

    page = dropped.content.decode()
    assert dropped.status_code == 503
    assert "We emailed an invitation" not in page
    assert "could not email the invitation" in page
    assert not Invitation.objects.for_org(org).pending().exists()
    assert AuditEvent.objects.filter(organization=org, action="invitation.revoke",
                                     details__reason="mail.dropped").count() == 1

    full_backlog()
    sent = client.post(reverse("console:members"), {"email": INVITED, "role": Role.MEMBER}, follow=True)
    assert "We emailed an invitation" in sent.content.decode()
    assert Invitation.objects.for_org(org).pending().filter(email=INVITED).count() == 1
    assert [message.to for message in mail.outbox] == [[INVITED]]


def test_the_api_answers_an_invitation_the_full_backlog_dropped_with_a_503_to_retry_and_it_can_be_sent_again(
        org, owner, full_backlog):
    api = signed_in_api_client(owner)

    dropped = api.post("/api/v1/invitations/", {"email": INVITED, "role": "member"}, format="json")

    assert dropped.status_code == 503 and int(dropped["Retry-After"]) > 0
    assert "could not email the invitation" in dropped.json()["detail"]
    assert api.get("/api/v1/invitations/").json()["results"] == []

    full_backlog()
    assert api.post("/api/v1/invitations/", {"email": INVITED, "role": "member"}, format="json").status_code == 201
    assert [message.to for message in mail.outbox] == [[INVITED]]


def test_invitations_the_full_backlog_dropped_still_spend_the_addresss_invitation_budget(org, owner, full_backlog):
    """Each try is a mail we meant to send: retried without a budget, a full backlog would be no limit at all."""
    api = signed_in_api_client(owner)
    for _ in range(3):  # `throttle.INVITATIONS`: 3 a day per address
        assert api.post("/api/v1/invitations/", {"email": INVITED, "role": "viewer"}, format="json").status_code == 503
    full_backlog()
    refused = api.post("/api/v1/invitations/", {"email": INVITED, "role": "viewer"}, format="json")
    assert refused.status_code == 429
    assert mail.outbox == []
