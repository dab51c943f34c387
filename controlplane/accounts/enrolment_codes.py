"""Staff's enrolment codes: the proof beyond the password that a staff account needs to set up its authenticator.

A staff account with no authenticator (a new one, or one an operator reset) would otherwise enrol one with its
password alone, and whoever first held a leaked password would own the account's second factor. So enrolling
takes a code issued out of band: mailed to the account's address (on the enrol page's request) or printed by an
operator (`manage.py reset_staff_second_factor`). A code is 80 random bits, kept only as a digest, taken once,
within `ENROLMENT_CODE_TTL`; taking one voids the account's others. Issuing, taking and refusing one are audited;
posts are throttled with the second factor's codes (`throttle.SECOND_FACTOR`) and mails on their own
(`throttle.ENROLMENT_EMAIL`).
"""

from __future__ import annotations

from datetime import timedelta

from django.core.mail import send_mail
from django.db import transaction
from django.template.loader import render_to_string
from django.utils import timezone

from controlplane import tokens
from controlplane.accounts.models import StaffEnrolmentCode
from controlplane.accounts.services import Actor, record_audit

ENROLMENT_CODE_TTL = timedelta(minutes=30)
Channel = StaffEnrolmentCode.Channel


def issue_enrolment_code(actor: Actor, user, *, channel: Channel) -> str:
    """A new code for `user` (the account's codes already issued stay usable until they expire). Returns the
    plain code: the caller mails or prints it, and nothing keeps it."""
    now = timezone.now()
    plain = tokens.issue_typed_code()
    StaffEnrolmentCode.objects.filter(user=user, expires_at__lte=now).delete()
    StaffEnrolmentCode.objects.create(
        user=user,
        digest=tokens.typed_code_digest(plain),
        channel=channel,
        created_at=now,
        expires_at=now + ENROLMENT_CODE_TTL,
    )
    record_audit(actor, None, "staff.second_factor.enrolment_code.issue", user, channel=channel.value)
    return plain


def email_enrolment_code(actor: Actor, user) -> bool:
    """Mails a new code to the account's own address; False when it has none (an operator prints one then)."""
    if not user.email:
        return False
    plain = issue_enrolment_code(actor, user, channel=Channel.EMAIL)
    body = render_to_string(
        "registration/second_factor_enrolment_email.txt",
        {"user": user, "code": plain, "ttl_min": int(ENROLMENT_CODE_TTL.total_seconds() // 60)},
    )
    send_mail("Your Inferplane staff enrolment code", body, None, [user.email])
    return True


def take_enrolment_code(user, typed: str) -> str | None:
    """Takes `user`'s code `typed`: None when it was theirs, unused and unexpired (the account's other codes are
    then void), else why not: "wrong", "expired" or "used".

    NOTE: taken by a conditional update: of two requests with one code, exactly one changes the row.
    """
    now = timezone.now()
    digest = tokens.typed_code_digest(typed)
    with transaction.atomic():
        num_taken = StaffEnrolmentCode.objects.filter(
            user=user, digest=digest, used_at__isnull=True, expires_at__gt=now
        ).update(used_at=now)
        if num_taken == 1:
            StaffEnrolmentCode.objects.filter(user=user, used_at__isnull=True).delete()
            return None
    code = StaffEnrolmentCode.objects.filter(user=user, digest=digest).first()
    if code is None:
        return "wrong"
    return "used" if code.used_at is not None else "expired"


def void_enrolment_codes(user) -> int:
    """Voids every code `user` has not taken; returns how many."""
    num_void, _ = StaffEnrolmentCode.objects.filter(user=user, used_at__isnull=True).delete()
    return num_void
