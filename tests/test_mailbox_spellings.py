"""A mailbox's daily budget of mail it gets without asking (`throttle.mailbox`) counts every spelling that mail
delivers to it: the password reset form's address is checked by Django's email check alone, which passes a format
character in the domain, and the mail's address is the domain IDNA writes (`sanitize_address`), which drops the
characters nameprep maps to nothing (a zero-width space, a soft hyphen, a word joiner) and folds fullwidth letters."""

import pytest
from django.core import mail
from django.test import Client
from django.urls import reverse

from controlplane.accounts import throttle

pytestmark = pytest.mark.django_db


def test_the_same_mailbox_spelt_with_hidden_or_fullwidth_characters_shares_one_budget():
    spellings = [f"stranger@{'elsewhere'[:i]}{hidden}{'elsewhere'[i:]}.test"
                 for hidden in ("\u200b", "\u00ad", "\u2060") for i in range(1, 5)]
    spellings += ["stranger@\uff45lsewhere.test", "stranger@ELSEWH\u200bERE.test"]
    assert {throttle.folded(throttle.mailbox(spelling)) for spelling in spellings} == {"stranger@elsewhere.test"}

    for n, spelling in enumerate(spellings):  # each from its own client address, past the reset form's own limits
        answer = Client().post(reverse("password_reset"), {"email": spelling}, REMOTE_ADDR=f"203.0.113.{n + 1}")
        assert answer.status_code == 302, answer.content.decode()[:500]
    assert len(mail.outbox) == next(limit.num_attempts for limit in throttle.NO_ACCOUNT_MAILS)


def test_a_domain_idna_cannot_write_keeps_its_own_budget():
    assert throttle.mailbox("a+tag@ex\u05d0ample.test") == "a@ex\u05d0ample.test"
