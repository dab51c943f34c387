"""Leaving the platform, self-service: an owner closes their organisation, a user deletes their account.

Closing ends everything the organisation runs or keeps through the services that end each of them one by one: its
keys (`keys.revoke_api_keys_of_organization`), pending invitations (`invitations.revoke_invitation`), adapters,
endpoints (their replicas drain), credentials, open batches (cancelled) and files (expired at once: the expired-file
sweep deletes their bytes, as it deletes any expired file's, once the batches reading them end; the outputs of a
batch that ends after the close expire as they are written, `batches.services._output_expiry`). What stays is the
billing and legal record: usage rows and rollups (still rolled up and pushed to Stripe), invoices, the credit ledger
and the audit log, readable by its members (README, "What is kept"). A closed organisation is never opened again.
Once its last usage is in Stripe, its subscription is cancelled with a final invoice (`end_closed_subscriptions`,
`billing.closed_subscriptions`). A close is refused while purchased credit remains (support refunds it:
`credit_refusal`); promotional credit is forfeited, once the owner acknowledges its amount.

Deleting an account ends each of the user's memberships as a removal does (`members.leave_organization`: their keys
and pending invitations revoked), ends their sessions, deactivates the user and erases their address and name from
every record that copied them, revoking the invitations pending to it (`accounts.erasure.erase_person`); it is
refused while they are the only owner of an open organisation that others or live resources depend on. Staff deleting
an account in the Django admin do the same, by the same rule (`end_account`, which the accounts app's admin reaches
through `accounts.departures`, filled in `EndpointsConfig.ready`), but for the password: the row is never deleted.

NOTE: both in a signed-in session only, never with an API key (`members.ensure_in_a_session`): a leaked `manage` key
must not be able to end an organisation or an account.
"""

from __future__ import annotations

import contextlib
import logging

from celery.exceptions import SoftTimeLimitExceeded
from django.db import transaction
from django.db.models import Q
from django.http import Http404

from billing import closed_subscriptions, credits
from controlplane.accounts import departures, erasure, invitations, keys, members, throttle
from controlplane.accounts.models import (
    Invitation,
    Membership,
    Organization,
    Role,
    lock_organizations,
    lock_person,
)
from controlplane.accounts.services import Actor, NotPermitted, actor_role, record_audit
from controlplane.clock import database_now
from controlplane.redis_client import held_alone
from controlplane.redis_keys import CLOSED_SUBSCRIPTIONS_RUN_LOCK_KEY
from endpoints.adapters import delete_adapter
from endpoints.batches import services as batches
from endpoints.batches.models import Batch, BatchStatus, File
from endpoints.credentials import delete_credential
from endpoints.models import Adapter, Endpoint, ModelCredential
from endpoints.services import delete_endpoint

logger = logging.getLogger(__name__)

CLOSE_REASON = "organization.close"
# How long one run's lock lasts unless renewed (every third of it while the run lives).
CLOSED_SUBSCRIPTIONS_RUN_LOCK_S = 60.0
DELETE_REASON = "user.delete"


class Refused(ValueError):
    """The request is refused as it is: `field` names the input at fault (a 400 on `/api/`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class TooManyAttempts(ValueError):
    """Too many wrong passwords from this account lately: a 429 after `retry_after_s`."""

    def __init__(self, retry_after_s: int):
        super().__init__("Too many wrong passwords: wait a few minutes and try again.")
        self.retry_after_s = retry_after_s


class AlreadyClosed(ValueError):
    """The organisation is closed already (a 409)."""


def close_organization(actor: Actor, organization: Organization, *, confirm_name: str,
                       forfeit_promotional_credit: bool = False) -> Organization:
    """Closes the organisation, in one transaction (see the module's note); `confirm_name` must be its name as it is.

    Raises `NotPermitted` unless the actor is one of its owners in a signed-in session, `AlreadyClosed` where it is
    closed already, `Refused` where the name does not match, where purchased credit remains (`credit_refusal`), or
    where promotional credit remains and `forfeit_promotional_credit` does not acknowledge that it ends with it."""
    members.ensure_in_a_session(actor, "confirm_name")
    with transaction.atomic():
        # NOTE: the organisation's row first, as every change of its keys, members and invitations takes it: a key, an
        # invitation or an endpoint being made meanwhile either committed first (and is ended below) or waits and is
        # refused (`services.ensure_open`, `endpoints.services.create_endpoint`).
        lock_organizations([organization.pk])
        organization = Organization.objects.get(pk=organization.pk)
        if actor.user is not None and actor_role(actor, organization) != Role.OWNER:
            raise NotPermitted("confirm_name", "Only the organisation's owners may close it.")
        if organization.closed_at is not None:
            raise AlreadyClosed(f"This organisation was closed on {organization.closed_at:%Y-%m-%d %H:%M} UTC; it "
                                "cannot be closed again or opened.")
        if confirm_name != organization.name:
            raise Refused("confirm_name", "Type the organisation's name exactly as it is shown to confirm closing it.")
        if refusal := credit_refusal(organization):
            raise Refused("non_field_errors", refusal)
        promotional = credits.remaining_credit(organization.pk).promotional
        if promotional > 0 and not forfeit_promotional_credit:
            raise Refused("forfeit_promotional_credit",
                          f"{promotional:.2f} USD of promotional credit remains; it ends with the organisation and is "
                          "not refunded. Confirm that you forfeit it to close.")
        _close(actor, organization)
    organization.refresh_from_db()
    return organization


def _close(actor: Actor, organization: Organization) -> None:
    # NOTE: by PostgreSQL's clock, as every money rule judges time (`controlplane.clock`): the close is when usage stops
    # being the organisation's to run, and the subscription ends once what was recorded up to it is billed
    # (`billing.closing`); by the web pod's, one minutes ahead or behind moved that line.
    now = database_now()
    Organization.objects.filter(pk=organization.pk).update(closed_at=now)
    organization.closed_at = now
    num_keys = keys.revoke_api_keys_of_organization(actor, organization, reason=CLOSE_REASON)
    for invitation in Invitation.objects.for_org(organization).pending().select_related("organization").order_by("pk"):
        invitations.revoke_invitation(actor, invitation)
    num_adapters = 0
    for adapter in Adapter.objects.filter(endpoint__organization=organization, endpoint__deleted_at__isnull=True
                                          ).select_related("endpoint__organization").order_by("pk"):
        with contextlib.suppress(Http404):  # NOTE: a member deleted it meanwhile (it takes no organisation's lock)
            delete_adapter(actor, adapter)
            num_adapters += 1
    endpoints = list(Endpoint.objects.live().filter(organization=organization).order_by("pk"))
    for endpoint in endpoints:
        delete_endpoint(actor, endpoint)
    credentials = list(ModelCredential.objects.filter(organization=organization).order_by("pk"))
    for credential in credentials:
        with contextlib.suppress(Http404):  # NOTE: an admin deleted it meanwhile (it takes no organisation's lock)
            delete_credential(actor, credential)
    num_batches = 0
    for batch in Batch.objects.filter(organization=organization,
                                      status__in=[BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS]).order_by("pk"):
        batches.cancel_batch(batch)
        num_batches += 1
    # NOTE: expired, not deleted here: the bytes go with the sweep (`batches.services.sweep_expired_files`) once no
    # open batch reads them, as any expired file's do, never from within this transaction.
    num_files = File.objects.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now), organization=organization,
                                    deleted_at__isnull=True).update(expires_at=now)
    forfeited = credits.forfeit_promotional_credit(actor, organization, now=now)
    record_audit(actor, organization, "organization.close", organization, num_api_keys=num_keys,
                 num_endpoints=len(endpoints), num_adapters=num_adapters, num_credentials=len(credentials),
                 num_batches_cancelled=num_batches, num_files=num_files,
                 promotional_credit_forfeited=f"{forfeited:.2f}")


def end_closed_subscriptions() -> int:
    """End the Stripe subscription of each closed organisation whose last usage is billed
    (`billing.closed_subscriptions`), one run at a time; returns how many ended. A cancelled batch whose lines still
    run (`Batch.objects.open()`) holds its organisation's until it ends: those lines' usage is the close's last.
    One organisation's failure (Stripe down) leaves it for the next run and the others go on."""
    with held_alone(CLOSED_SUBSCRIPTIONS_RUN_LOCK_KEY, CLOSED_SUBSCRIPTIONS_RUN_LOCK_S, renewed=True) as held:
        if not held:
            return 0
        num_ended = 0
        for organization_id in list(closed_subscriptions.closed_with_subscription()):
            if Batch.objects.open().filter(organization_id=organization_id).exists():
                continue
            try:
                num_ended += closed_subscriptions.end_subscription_after_close(organization_id)
            except SoftTimeLimitExceeded:
                # NOTE: the task's time is up (an Exception): taken for one organisation's failure, the run went on to
                # the next until the hard limit killed the worker in the middle of its Stripe call
                raise
            except Exception:  # noqa: BLE001 - the next run tries it again; the others go on
                logger.exception("ending the subscription of closed organisation %s failed; the next run retries",
                                 organization_id)
        return num_ended


def credit_refusal(organization: Organization) -> str | None:
    """Why the organisation may not be closed yet for its money: purchased credit remains, which is the customer's and
    is refunded by support, never forfeited by a close; None where none does."""
    purchased = credits.remaining_credit(organization.pk).purchased
    if purchased <= 0:
        return None
    return (f"{purchased:.2f} USD of purchased credit remains on {organization.name}: contact support to have it "
            "refunded, then close the organisation.")


def close_refusal(organization: Organization, user) -> str | None:
    """Why `user`'s account may not be deleted while they are in `organization` and it is open: they are its only owner
    and other members or live resources depend on it, or purchased credit remains on it (`credit_refusal`); None where
    nothing does. The same rule whoever deletes the account: its owner (`delete_account`) or staff in the Django admin
    (`end_account`, reached there through `accounts.departures`)."""
    if organization.closed_at is not None:
        return None
    if Membership.objects.filter(organization=organization).owners_besides(user).exists():
        return None
    held = []
    if Membership.objects.filter(organization=organization).exclude(user=user).exists():
        held.append("other members")
    if Endpoint.objects.live().filter(organization=organization).exists():
        held.append("endpoints")
    if ModelCredential.objects.filter(organization=organization).exists():
        held.append("credentials")
    if Batch.objects.open().filter(organization=organization).exists():
        held.append("open batches")
    if File.objects.for_org(organization.pk).exists():
        held.append("files")
    if refusal := credit_refusal(organization):
        return refusal
    if not held:
        return None
    return (f"{user.email or user.username} is the only owner of {organization.name} (slug {organization.slug}), "
            f"which has {', '.join(held)}: make another member its owner, or close it, before deleting the account.")


def account_refusals(user) -> list[str]:
    """Why `user`'s account may not be deleted now (`close_refusal`, for each open organisation they solely own), as
    read without locks: what a confirmation page shows. `end_account` judges again under the organisations' locks."""
    return [reason for membership in Membership.objects.filter(user=user, role=Role.OWNER).select_related(
            "organization").order_by("organization_id")
            if (reason := close_refusal(membership.organization, user))]


def delete_account(actor: Actor, user, *, password: str) -> None:
    """Deletes the user's own account (see the module's note). Raises `NotPermitted` with an API key or for a staff
    account, `Refused` for a wrong password (`password`) or where an organisation depends on them
    (`non_field_errors`, `close_refusal`), `TooManyAttempts` past the wrong passwords allowed."""
    members.ensure_in_a_session(actor, "password")
    if user.is_staff:
        raise NotPermitted("password", "Staff accounts are deactivated by an operator, in the admin.")
    # NOTE: the same budget as the password change's (`throttle.PASSWORD_CHANGE`, wrong answers only): unthrottled, a
    # borrowed or stolen session guessed the password without end here, and once right ended the account.
    attempt = throttle.take(throttle.PASSWORD_CHANGE, {"user": str(user.pk)})
    if attempt.retry_after_s is not None:
        attempt.refund()
        raise TooManyAttempts(attempt.retry_after_s)
    if not user.check_password(password):
        raise Refused("password", "The password is not this account's.")  # NOTE: counted
    attempt.refund()
    try:
        end_account(actor, user)
    except departures.AccountDeletionRefused as exc:
        raise Refused("non_field_errors", str(exc)) from None


@transaction.atomic
def end_account(actor: Actor, user) -> None:
    """Ends the account (see the module's note): what its own deletion does once its password is checked, and what
    staff deleting it in the Django admin do (`accounts.departures`). The row is kept, deactivated and tombstoned, so
    every record still names it; a staff account loses its staff powers with it. Raises
    `departures.AccountDeletionRefused` where an organisation depends on the user (`close_refusal`)."""
    # NOTE: the account's own row first, held to the commit, and read again (`models.lock_person`): a new organisation
    # of theirs, an invitation to their address, their acceptance of one or staff's save of their admin form, each
    # under the same lock, either committed before and is ended below, or waits and then finds the account
    # tombstoned. Without it, an invitation sent meanwhile stayed pending to the address (the revocation below had not
    # seen it), and a stale admin form wrote the address back over the tombstone.
    lock_person(user.pk)
    user.refresh_from_db()
    # NOTE: read again once their organisations' rows are held, as a role change or an invitation's acceptance takes
    # them: read only before, a member made the only owner meanwhile was judged as the member they had been, and
    # their departure then raised `LastOwnerError` (a 500). One joined meanwhile is taken in turn.
    locked: set[int] = set()
    while True:
        memberships = list(Membership.objects.filter(user=user).select_related("organization")
                           .order_by("organization_id"))
        if not (missing := sorted({m.organization_id for m in memberships} - locked)):
            break
        lock_organizations(missing)
        locked.update(missing)
    refusals = [reason for m in memberships if m.role == Role.OWNER
                and (reason := close_refusal(Organization.objects.get(pk=m.organization_id), user))]
    if refusals:
        raise departures.AccountDeletionRefused(refusals)
    for membership in memberships:
        organization = Organization.objects.get(pk=membership.organization_id)
        sole_owner = not Membership.objects.filter(organization=organization).owners_besides(user).exists()
        if membership.role == Role.OWNER and sole_owner and organization.closed_at is None:
            # NOTE: nobody else is in it and it holds nothing live (`close_refusal`): closed rather than left with
            # no one to own it, its records kept as any closed organisation's.
            _close(actor, organization)
        members.leave_organization(actor, membership, reason=DELETE_REASON)
    # NOTE: the keys they made anywhere else (an organisation they left before) and invitations they sent
    keys.revoke_api_keys_of(actor, user, reason=DELETE_REASON)
    members.revoke_invitations_sent_by(actor, user, reason=DELETE_REASON)
    # NOTE: their address and name out of every record that copied them, invitations pending to it revoked
    erasure.erase_person(actor, user, reason=DELETE_REASON)
    user.is_active = False
    # NOTE: a tombstoned account keeps no powers, should it ever be activated again by hand
    user.is_staff = user.is_superuser = False
    # NOTE: a new password hash ends every session (Django's and the gateway's check it), wherever signed in
    user.set_unusable_password()
    user.save(update_fields=["is_active", "is_staff", "is_superuser", "password"])
    record_audit(actor, None, "user.delete", user)
