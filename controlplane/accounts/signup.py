"""How users and their first organisation come to be: self-service sign-up, proving the email
address (the signed link mailed, verifying it), what a forgotten password's reset secures, and the operators' and
tests' one-shot bootstrap."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.hashers import make_password
from django.core import signing
from django.core.exceptions import ValidationError
from django.core.mail import EmailMessage
from django.db import IntegrityError, transaction
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone

from controlplane.accounts import throttle
from controlplane.accounts.backends import (
    ACCOUNT_EMAIL_MAX_LENGTH,
    account_named,
    accounts_with_email,
    email_in_use,
    normalize_email,
)
from controlplane.accounts.invitations import remove_members_invited_by
from controlplane.accounts.keys import create_api_key, revoke_api_keys_of
from controlplane.accounts.mail_sender import send_later
from controlplane.accounts.members import add_member, revoke_invitations_sent_by
from controlplane.accounts.models import (
    EmailVerification,
    Membership,
    Organization,
    Role,
    Scope,
    email_is_verified,
)
from controlplane.accounts.services import SYSTEM, Actor, create_organization, record_audit
from controlplane.text import shown_name

User = get_user_model()
logger = logging.getLogger(__name__)


def sign_up_user(*, email: str, password: str, organization_name: str, source_ip: str | None = None):
    """A new user and their first organisation, which they own (nobody is ever without one), and the link that
    verifies the address mailed to it; None when the address has an account already, which is mailed instead.

    NOTE: the answer a stranger sees is the same either way ("check your inbox"), and nobody is signed in by signing
    up: sign-up must not tell who has an account. Nor may its time: the password is hashed either way (the hash is
    most of a new account's time; before, an address with an account was answered without one, at once). What it
    cannot hide is that the new account logs in with the password given, and an existing one does not. The account
    is unverified: the console shows it nothing but the verify-email page, and it may join nothing, until its owner
    follows the link signed in as it. A `ValidationError` where the address is too long once normalised
    (`backends.normalize_email`: the sign-up form takes it from there first).
    """
    email = normalize_email(email, max_length=ACCOUNT_EMAIL_MAX_LENGTH)
    if email_in_use(email):
        make_password(password)  # NOTE: the work a new account's hash costs, thrown away (see above)
        send_account_exists_email(email)
        return None
    try:
        with transaction.atomic():
            user = User.objects.create_user(username=email, email=email, password=password)
            create_organization(Actor(user=user, source_ip=source_ip), name=organization_name, owner=user)
    except IntegrityError:
        if email_in_use(email):  # a concurrent sign-up with the same address won
            send_account_exists_email(email)
            return None
        raise
    send_verification_email(user)
    return user


def _may_mail(limits: tuple[throttle.Limit, ...], email: str, *, unsolicited: bool = False) -> bool:
    """Whether one more account mail of a kind (`throttle.VERIFICATION_MAILS`, `throttle.ACCOUNT_EXISTS_MAILS`) may
    go to `email` today, whoever asks for it. An `unsolicited` one (anyone may have it sent to any address: "you have
    an account", "no account has this address") is not sent while the budget cannot be read (Redis down).

    NOTE: let through then, as the console's throttles are, a Redis outage let anyone mail any address without bound
    from the reset and sign-up forms (their own limits, per client and per address, let through too)."""
    return throttle.take(limits, {"email": email}, refuse_when_unavailable=unsolicited).retry_after_s is None


def send_account_exists_email(email: str) -> bool:
    """Tells the address that signed up again that it has an account; whether it was mailed
    (`throttle.ACCOUNT_EXISTS_MAILS`, a budget of its own: these never spend the address's verification links)."""
    if not _may_mail(throttle.ACCOUNT_EXISTS_MAILS, email, unsolicited=True):
        return False
    body = render_to_string("registration/account_exists_email.txt", {
        "email": email, "login": settings.PUBLIC_URL + reverse("login"),
        "reset": settings.PUBLIC_URL + reverse("password_reset"),
    })
    send_later(EmailMessage("You already have an Inferplane account", body, None, [email]),
               what="a sign-up's account-exists email")
    return True


def send_no_account_email(email: str) -> bool:
    """Tells an address a password reset was asked for that no account (able to log in) has it, off the request
    (`mail_sender.send_later`: the reset's answer waits for no relay, as its link's does not), within its budget
    (`throttle.NO_ACCOUNT_MAILS`, a few a day per mailbox: `name+tag@` counts as `name@`; a budget of its own, so a
    stranger's resets for addresses without an account never spend an owner's links); whether it was handed over.

    NOTE: the budget is taken by the sender, as it sends (`only_if`), never within the request: taken there (a Redis
    round trip), it made a reset without an account slower than one with, whose link spends none, and the answer's time
    told who has an account. The mail is rendered either way, the reset's work alike. A mail that cannot be sent (the
    relay down or refusing it, an address Django takes whose host IDNA cannot encode) is logged by the sender, as the
    link's is."""
    body = render_to_string("registration/no_account_email.txt", {
        "email": email, "signup": settings.PUBLIC_URL + reverse("signup"),
    })
    mailbox = throttle.mailbox(email)
    return send_later(EmailMessage("Password reset for Inferplane", body, None, [email]),
                      what="a password reset's no-account email",
                      only_if=lambda: _may_mail(throttle.NO_ACCOUNT_MAILS, mailbox, unsolicited=True))


VERIFY_EMAIL_SALT = "inferplane.verify-email"
VERIFY_EMAIL_MAX_AGE = timedelta(days=3)


class InvalidLink(ValueError):
    """A signed link that is forged, expired or no longer matches what it was made for."""


def email_verification_token(user) -> str:
    # NOTE: the token names the address as well as the user: it proves that mailbox, no other.
    return signing.TimestampSigner(salt=VERIFY_EMAIL_SALT).sign_object({"user": user.pk, "email": user.email.lower()})


class LinkMailed(enum.Enum):
    """What became of a verification link (`send_verification_email`)."""

    SENT = "sent"  # handed to the web process's senders
    OVER_BUDGET = "over budget"  # the address had as many links as it may today (`throttle.VERIFICATION_MAILS`)
    DROPPED = "dropped"  # the senders' backlog was full (`mail_sender.send_later`, logged at ERROR)


def send_verification_email(user) -> LinkMailed:
    """Mails `user` a link that verifies their address; what became of it.

    NOTE: `DROPPED` is not `SENT`: told "we sent a new link" for one the full backlog dropped, the user waited for it."""
    if not _may_mail(throttle.VERIFICATION_MAILS, user.email):
        return LinkMailed.OVER_BUDGET
    link = settings.PUBLIC_URL + reverse("verify-email-confirm", args=[email_verification_token(user)])
    body = render_to_string("registration/verify_email_email.txt", {"user": user, "link": link,
                                                                     "max_age_days": VERIFY_EMAIL_MAX_AGE.days})
    # NOTE: off the request, as every account mail (`mail_sender.send_later`): sent within it, a relay refusing the
    # address (or down) answered the sign-up, whose account was made, or the resend with a 500.
    taken = send_later(EmailMessage("Verify your email for Inferplane", body, None, [user.email]),
                       what="an address's verification link")
    return LinkMailed.SENT if taken else LinkMailed.DROPPED


def mark_email_verified(user) -> EmailVerification:
    verification, _ = EmailVerification.objects.update_or_create(
        user=user, defaults={"email": user.email.lower(), "verified_at": timezone.now(), "confirmed_by_owner": True}
    )
    return verification


def verification_link_user(token: str):
    """The user whose address the signed `token` proves (verified or not); `InvalidLink` otherwise."""
    try:
        claim = signing.TimestampSigner(salt=VERIFY_EMAIL_SALT).unsign_object(token, max_age=VERIFY_EMAIL_MAX_AGE)
        user = User.objects.get(pk=claim["user"], is_active=True)
    except (signing.BadSignature, User.DoesNotExist, KeyError, TypeError):
        raise InvalidLink("This verification link is invalid or has expired. Log in and send a new one.") from None
    if user.email.lower() != claim["email"]:
        raise InvalidLink("This verification link was sent to an address that is no longer yours.")
    return user


def verify_email(token: str, *, signed_in_as):
    """The user whose email the signed `token` proves, now verified; `InvalidLink` otherwise, and when
    `signed_in_as` (the user whose session followed the link) is someone else.

    NOTE: the link counts only in the account's own session. Before, a link followed signed out verified whoever it
    named: a stranger who signed up with someone's address and kept the session had a verified owner's session (and
    made keys with it) as soon as the address's owner clicked the link in their mailbox.
    """
    user = verification_link_user(token)
    if signed_in_as is None or signed_in_as.pk != user.pk:
        raise InvalidLink(f"This link verifies {user.email}: log out, and log in as {user.email} to follow it.")
    if not email_is_verified(user):
        mark_email_verified(user)
        for membership in Membership.objects.filter(user=user).select_related("organization"):
            record_audit(Actor(user=user), membership.organization, "user.verify_email", user, email=user.email)
    elif not EmailVerification.objects.filter(user=user, confirmed_by_owner=True).exists():
        mark_email_verified(user)  # verified before links counted only in the account's session: its owner's now
    return user


@dataclass(slots=True, frozen=True)
class ResetSecured:
    """What a forgotten password's reset revoked (`secure_after_password_reset`)."""

    num_keys_revoked: int
    num_invitations_revoked: int
    num_members_removed: int = 0


def secure_after_password_reset(user, *, source_ip: str | None = None) -> ResetSecured:
    """What a forgotten password's reset (its link followed, the new password saved) does besides: the address is
    proven (the link went to it), and if its owner had not confirmed it before, every key the account made and
    every pending invitation it sent are revoked, and the members who joined through its accepted invitations (and
    through theirs) removed, each audited (reason "password.reset"); how many.

    NOTE: an address not confirmed by its owner (a link followed signed out, before that was refused: rows from
    before `confirmed_by_owner`) may have been someone else's sign-up whose session became verified: its keys and
    its invitations (to a second address of its own), made by that session, outlived the reset that ended the
    session. An owner's own confirmation (the link in the account's session, an operator's or a reset) keeps them:
    a password stolen and used is not this case.
    """
    with transaction.atomic():
        verification = EmailVerification.objects.select_for_update().filter(user=user).first()
        confirmed = user.is_staff or (verification is not None and verification.confirmed_by_owner
                                      and verification.email.lower() == user.email.lower())
        if confirmed:
            return ResetSecured(num_keys_revoked=0, num_invitations_revoked=0)
        actor = Actor(user=user, source_ip=source_ip)
        secured = ResetSecured(
            num_keys_revoked=revoke_api_keys_of(actor, user, reason="password.reset"),
            num_invitations_revoked=revoke_invitations_sent_by(actor, user, reason="password.reset"),
            num_members_removed=remove_members_invited_by(actor, user, reason="password.reset"),
        )
        if user.email:
            mark_email_verified(user)
    return secured


def bootstrap_organization(*, slug: str, owner_email: str, name: str | None = None, password: str | None = None):
    """Operators' and tests' one-shot set-up: org, owner (created if new) and a manage+inference key.

    The owner is the account sign-in finds by the address (`account_named`): an operator's account made by
    `createsuperuser` (another username), or one stored before addresses were folded. A `ValidationError` where
    several accounts have it. NOTE: looked up by the folded address as a username alone, neither was found: a second
    account with the address became the owner, and the first could no longer sign in by its address."""
    owner_email = normalize_email(owner_email, max_length=ACCOUNT_EMAIL_MAX_LENGTH)
    with transaction.atomic():
        owner, created = account_named(owner_email), False
        if owner is None and (num_accounts := accounts_with_email(owner_email).count()):
            raise ValidationError(f"{num_accounts} accounts have the address {shown_name(owner_email)}: sign-in takes "
                                  "none of them by it; give all but one another address first.")
        if owner is None:
            owner, created = User.objects.get_or_create(username=owner_email, defaults={"email": owner_email})
        if created or password:
            if password:
                owner.set_password(password)
            else:
                owner.set_unusable_password()
            owner.save()
        # NOTE: an operator names this owner; there is no stranger's sign-up to guard against.
        if not email_is_verified(owner):
            mark_email_verified(owner)
        organization = Organization.objects.filter(slug=slug).first()
        if organization is None:
            organization = create_organization(SYSTEM, name=name or slug, owner=owner, slug=slug)
        elif not Membership.objects.filter(organization=organization, user=owner).exists():
            add_member(SYSTEM, organization, user=owner, role=Role.OWNER)
    created_key = create_api_key(
        Actor(user=owner), organization, name="bootstrap", scopes=[Scope.MANAGE, Scope.INFERENCE]
    )
    return organization, owner, created_key
