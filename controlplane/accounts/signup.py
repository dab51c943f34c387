"""How users and their first organisation come to be: self-service sign-up, proving the email
address (the signed link mailed, verifying it), and the operators' and tests' one-shot bootstrap."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core import signing
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone

from controlplane.accounts.backends import email_in_use
from controlplane.accounts.keys import create_api_key
from controlplane.accounts.members import add_member
from controlplane.accounts.models import (
    EmailVerification,
    Membership,
    Organization,
    Role,
    Scope,
    email_is_verified,
)
from controlplane.accounts.services import SYSTEM, Actor, create_organization, record_audit

User = get_user_model()


class EmailTaken(Exception):
    """Another sign-up took the address between the form's check and the insert."""


def sign_up_user(*, email: str, password: str, organization_name: str, source_ip: str | None = None):
    """A new user and their first organisation, which they own: nobody is ever without one. Raises
    `EmailTaken` when a concurrent sign-up with the same address won (the form checked it first).

    NOTE: the account is unverified: the console shows it nothing but the verify-email page,
    and it may join nothing, until the link mailed here is followed.
    """
    try:
        with transaction.atomic():
            user = User.objects.create_user(username=email.lower(), email=email.lower(), password=password)
            organization = create_organization(Actor(user=user, source_ip=source_ip), name=organization_name, owner=user)
    except IntegrityError:
        if email_in_use(email):
            raise EmailTaken(email) from None
        raise
    send_verification_email(user)
    return user, organization


VERIFY_EMAIL_SALT = "inferplane.verify-email"
VERIFY_EMAIL_MAX_AGE = timedelta(days=3)


class InvalidLink(ValueError):
    """A signed link that is forged, expired or no longer matches what it was made for."""


def email_verification_token(user) -> str:
    # NOTE: the token names the address as well as the user: it proves that mailbox, no other.
    return signing.TimestampSigner(salt=VERIFY_EMAIL_SALT).sign_object({"user": user.pk, "email": user.email.lower()})


def send_verification_email(user) -> None:
    link = settings.PUBLIC_URL + reverse("verify-email-confirm", args=[email_verification_token(user)])
    body = render_to_string("registration/verify_email_email.txt", {"user": user, "link": link,
                                                                     "max_age_days": VERIFY_EMAIL_MAX_AGE.days})
    send_mail("Verify your email for Inferplane", body, None, [user.email])


def mark_email_verified(user) -> EmailVerification:
    verification, _ = EmailVerification.objects.update_or_create(
        user=user, defaults={"email": user.email.lower(), "verified_at": timezone.now()}
    )
    return verification


def verify_email(token: str):
    """The user whose email the signed `token` proves, now verified; `InvalidLink` otherwise."""
    try:
        claim = signing.TimestampSigner(salt=VERIFY_EMAIL_SALT).unsign_object(token, max_age=VERIFY_EMAIL_MAX_AGE)
        user = User.objects.get(pk=claim["user"], is_active=True)
    except (signing.BadSignature, User.DoesNotExist, KeyError, TypeError):
        raise InvalidLink("This verification link is invalid or has expired. Log in and send a new one.") from None
    if user.email.lower() != claim["email"]:
        raise InvalidLink("This verification link was sent to an address that is no longer yours.")
    if not email_is_verified(user):
        mark_email_verified(user)
        for membership in Membership.objects.filter(user=user).select_related("organization"):
            record_audit(Actor(user=user), membership.organization, "user.verify_email", user, email=user.email)
    return user


def bootstrap_organization(*, slug: str, owner_email: str, name: str | None = None, password: str | None = None):
    """Operators' and tests' one-shot set-up: org, owner (created if new) and a manage+inference key."""
    with transaction.atomic():
        owner, created = User.objects.get_or_create(
            username=owner_email.lower(), defaults={"email": owner_email.lower()}
        )
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
