"""Staff's enrolment codes: the proof beyond the password that a staff account needs to set up its authenticator.

A staff account with no authenticator (a new one, or one an operator reset) would otherwise enrol one with its
password alone, and whoever first held a leaked password would own the account's second factor. So enrolling
takes a code issued out of band, by someone who can tell who asked: printed by an operator
(`manage.py reset_staff_second_factor`) or issued in the admin by a staff member who passed their own second
factor (`second_factor.issue_staff_enrolment_code`). A code is never mailed to the account: its password and its
mailbox are what one phishing page takes together. A code is 80 random bits, kept only as a digest, taken once,
within `ENROLMENT_CODE_TTL`; taking one voids the account's others. Issuing, taking and refusing one are audited
(`staff.second_factor.enrolment_code.*`, with the channel); posts are throttled with the second factor's codes
(`throttle.SECOND_FACTOR`).
"""

from __future__ import annotations

from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from controlplane import tokens
from controlplane.accounts.models import StaffEnrolmentCode
from controlplane.accounts.services import Actor, record_audit

ENROLMENT_CODE_TTL = timedelta(minutes=30)
Channel = StaffEnrolmentCode.Channel


def issue_enrolment_code(actor: Actor, user, *, channel: Channel) -> str:
    """A new code for `user` (the account's codes already issued stay usable until they expire). Returns the
    plain code: the caller prints or shows it, and nothing keeps it."""
    channel = Channel(channel)  # NOTE: only the out-of-band channels exist; a mailed code is never issued.
    # NOTE: its TTL stamped and judged by web pods' own clocks, moved by a pod's skew, seconds: as
    # any web process's skew past 2 s is an ERROR and on `/metrics` (`controlplane.clock.record_offset`)
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


def take_enrolment_code(actor: Actor, user, typed: str) -> bool:
    """Takes `user`'s code `typed`: True when it was theirs, issued out of band, unused and unexpired (the
    account's other codes are then void). Audited either way: the channel it came by, or why it was refused
    ("wrong", "expired", "used", or "mailed" for a code mailed before mailing stopped).

    NOTE: taken by a conditional update: of two requests with one code, exactly one changes the row.
    """
    now = timezone.now()
    digest = tokens.typed_code_digest(typed)
    with transaction.atomic():
        num_taken = StaffEnrolmentCode.objects.filter(
            user=user, digest=digest, channel__in=Channel.values, used_at__isnull=True, expires_at__gt=now
        ).update(used_at=now)
        if num_taken == 1:
            StaffEnrolmentCode.objects.filter(user=user, used_at__isnull=True).delete()
    code = StaffEnrolmentCode.objects.filter(user=user, digest=digest).first()
    if num_taken == 1:
        record_audit(actor, None, "staff.second_factor.enrolment_code.accept", user, channel=code.channel)
        return True
    record_audit(actor, None, "staff.second_factor.enrolment_code.refuse", user, reason=_refusal(code))
    return False


def _refusal(code: StaffEnrolmentCode | None) -> str:
    if code is None:
        return "wrong"
    if code.channel not in Channel.values:
        return "mailed"
    return "used" if code.used_at is not None else "expired"


def void_enrolment_codes(user) -> int:
    """Voids every code `user` has not taken; returns how many."""
    num_void, _ = StaffEnrolmentCode.objects.filter(user=user, used_at__isnull=True).delete()
    return num_void
