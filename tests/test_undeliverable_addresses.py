"""An address is stored only where mail on the internet reaches it and the log scrubber hides it whole
(`backends.normalize_email`, `log_privacy.hides_domain`): a domain name with a dot and a top label of letters. Django's
check passes `ada@localhost`, an IP literal (`ada@[10.0.0.1]`) and a top label with a digit of another script
(`ada@example.ab\u0663`); none is an address a production relay delivers to, and each was stored, then written whole
in every log line that named it (`log_privacy.ADDRESS` wants a dotted name), outliving the account's erasure."""

from __future__ import annotations

import logging
import time

import pytest
from django.core import mail
from django.core.exceptions import ValidationError
from django.core.validators import validate_email
from django.test import Client
from django.urls import reverse

from controlplane.accounts.backends import normalize_email
from controlplane.accounts.models import Invitation, Role
from controlplane.log_privacy import address_digest, hide_addresses
from tests.factories import signed_in_api_client

UNDELIVERABLE = ["ada@localhost", "ada@[10.0.0.1]", "ada@[::1]", "ada@example.ab\u0663",
                 "ada@ex\u00a2ample.test", "ada@example.te-st"]
# Local parts of punctuation alone: Django's check passes them, and the scrubber, which starts an address at a word
# character (`-ada@example.test` is hidden from its `a`), hid none of them: each was written whole, domain and all.
UNHIDDEN_LOCAL_PARTS = ["+@example.test", "-.-@example.test", "{}@example.test"]


@pytest.mark.django_db
@pytest.mark.parametrize("email", UNDELIVERABLE)
def test_an_invitation_to_an_address_no_relay_delivers_to_is_a_400_naming_email(org, member_client_factory, email):
    owner = signed_in_api_client(member_client_factory(org, Role.OWNER).user)
    refused = owner.post("/api/v1/invitations/", {"email": email, "role": "viewer"}, format="json")
    assert refused.status_code == 400 and list(refused.json()) == ["email"]
    assert "domain name" in refused.json()["email"][0]
    assert not Invitation.objects.exists() and mail.outbox == []


@pytest.mark.django_db
@pytest.mark.parametrize("email", UNHIDDEN_LOCAL_PARTS)
def test_an_invitation_to_an_address_of_punctuation_before_its_at_is_a_400_naming_email(org, member_client_factory,
                                                                                        email):
    owner = signed_in_api_client(member_client_factory(org, Role.OWNER).user)
    refused = owner.post("/api/v1/invitations/", {"email": email, "role": "viewer"}, format="json")
    assert refused.status_code == 400 and list(refused.json()) == ["email"]
    assert "letter or a digit" in refused.json()["email"][0]
    assert not Invitation.objects.exists() and mail.outbox == []


@pytest.mark.django_db
@pytest.mark.parametrize("email", ["ada@localhost", "ada@[10.0.0.1]"])
def test_a_sign_up_with_an_address_no_relay_delivers_to_is_refused_on_its_form(email):
    page = Client().post(reverse("signup"), {"email": email, "password": "a long passphrase",
                                             "organization_name": "Engines"})
    assert page.status_code == 200 and "domain name" in page.content.decode()
    assert mail.outbox == []


@pytest.mark.parametrize("email", [
    "ada@example.test", "ada.lovelace+x@mail.example.co.uk", "ada@xn--bcher-kva.example", "ada@example.xn--p1ai",
    "-ada@example.test", "ada@\u00e9xample.test", "ada@example.\u00e9x", "a@b.cd",
    *UNDELIVERABLE, *UNHIDDEN_LOCAL_PARTS,
])
def test_every_address_normalize_email_takes_is_hidden_whole_in_a_log_line(email):
    try:
        validate_email(email)  # a form's and a serializer's check, before `normalize_email`
        stored = normalize_email(email)
    except ValidationError:
        assert email in UNDELIVERABLE + UNHIDDEN_LOCAL_PARTS
        return
    assert email not in UNDELIVERABLE + UNHIDDEN_LOCAL_PARTS
    hidden = hide_addresses(f"Failed to send to {stored}.")
    assert stored.partition("@")[2] not in hidden and address_digest(stored.lstrip("-")) in hidden


def test_a_hostile_100_kb_line_of_address_fragments_is_scrubbed_in_linear_time(caplog):
    # Runs that each begin an address the bounded parts must give up on: dotted labels without a top label of letters,
    # `xn--` top labels, local parts of punctuation, every one 100 KB; the last the worst found for the pattern alone
    # (`tests/test_log_privacy.py` holds the scrubber to milliseconds on it).
    lines = ["a@" + "b." * 50_000, "a@" + "b.xn--" * 16_666, "a" * 50_000 + "@" + "b." * 25_000,
             "+" * 50_000 + "@b.cd", "a@b-" * 25_000, ("a" * 253 + "@" + "b." * 126 + "1 ") * 200]
    logger = logging.getLogger("django.security.DisallowedHost")
    started = time.monotonic()
    for line in lines:
        logger.error("Invalid HTTP_HOST header: %r.", line)
    assert time.monotonic() - started < 2 * len(lines)
