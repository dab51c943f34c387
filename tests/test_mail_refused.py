"""A relay that refuses an address (or is down) never turns an account's mail into a 500: the sign-up, the
verification link's resend and an invitation are answered as they would be, the mail's failure logged (by the address's
digest, never the address: `controlplane.log_privacy`). Sent within the request, the refusal answered with a 500 an
account or an invitation already made, and a second invitation was refused as pending."""

import logging
import smtplib

import pytest
from django.core.mail.backends.base import BaseEmailBackend
from django.test import Client
from django.urls import reverse

from controlplane.accounts.models import Invitation, Role
from tests.factories import MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db


class RefusingBackend(BaseEmailBackend):
    """A relay that refuses every recipient, as `smtplib` reports it."""

    def send_messages(self, email_messages):
        raise smtplib.SMTPRecipientsRefused({address: (550, b"no such mailbox")
                                             for message in email_messages for address in message.recipients()})


@pytest.fixture
def refusing_relay(settings):
    settings.EMAIL_BACKEND = f"{__name__}.RefusingBackend"


def _failures(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.levelno >= logging.ERROR and record.getMessage().startswith("Failed to send")]


def test_a_sign_up_whose_verification_mail_is_refused_is_answered_as_any_sign_up(refusing_relay, caplog):
    client = Client(raise_request_exception=False)
    response = client.post(reverse("signup"), {"email": "bounce@example.test", "password": "a long passphrase",
                                               "organization_name": "Bounced"})
    assert response.status_code == 302 and response["Location"] == reverse("signup-done")
    assert _failures(caplog) == ["Failed to send an address's verification link"]
    assert "bounce@example.test" not in caplog.text


def test_a_verification_links_resend_refused_by_the_relay_is_no_500(refusing_relay, caplog):
    client = Client(raise_request_exception=False)
    client.force_login(UserFactory(email="bounce@example.test", username="bounce@example.test", verified=False))
    response = client.post(reverse("verify-email-resend"))
    assert response.status_code == 302 and response["Location"] == reverse("verify-email")
    assert _failures(caplog) == ["Failed to send an address's verification link"]


def test_an_invitation_whose_mail_is_refused_is_made_once_and_answered_as_any_invitation(org, refusing_relay, caplog):
    owner = Client(raise_request_exception=False)
    user = UserFactory()
    MembershipFactory(organization=org, user=user, role=Role.OWNER)
    owner.force_login(user)
    response = owner.post(reverse("console:members"), {"email": "bounce@example.test", "role": Role.MEMBER})
    assert response.status_code == 302
    assert Invitation.objects.filter(organization=org, email="bounce@example.test").count() == 1
    assert _failures(caplog) == ["Failed to send an invitation's email"]
    assert "bounce@example.test" not in caplog.text
