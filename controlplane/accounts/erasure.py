"""A deleted person's address and name, out of everything the platform keeps (GDPR's right to erasure), while the
records they took part in stay whole and name them by their account's id.

An account is never a deleted row (`endpoints.closing.end_account`, whether its owner deletes it or staff do in the
Django admin): its row stays, deactivated, so that every
record pointing at it (audit events' actor, keys' creator, the invitations it sent or accepted, ledger holds) still
names one account. What identified the person is replaced by a tombstone address (`deleted-<id>-<random>@deleted.invalid`:
`.invalid` is reserved, RFC 2606, so nothing is ever mailed to it) wherever the platform had copied it as text: an
audit event's `target_repr` ("ada@example.test in acme as admin") and its details (`email`, `owner`), invitations
to the address (`Invitation.email`: an organisation's list and its invitation links), and the Django admin's history
(`LogEntry.object_repr`, what "Recent actions" lists). The account's second-factor devices and enrolment codes, and
its address's verification, are deleted: they are only ever the account's. Invitations still pending to the address
are revoked first: whoever holds the address next (a mailbox given to someone else, or the person signing up again)
must not find a seat waiting that was offered to someone who has gone.

NOTE: an address is matched case-insensitively, as every address comparison of the platform is (`backends.same_address`
folds NFKC too; an address is stored folded since `normalize_email`, and an older one is matched as it was stored).
The audit log is read from the earliest moment it could name the address (the account's creation, or the first
invitation to it), by its `created_at` index, not whole.
"""

from __future__ import annotations

import re
import secrets
import unicodedata

from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import Max, Min, Q
from django_otp import devices_for_user

from controlplane.accounts.backends import TOMBSTONE_DOMAIN
from controlplane.accounts.members import revoke_invitations_to
from controlplane.accounts.models import AuditEvent, EmailVerification, Invitation, StaffEnrolmentCode
from controlplane.accounts.organizations import remember_erased_mailbox
from controlplane.accounts.services import Actor

# The audit action of staff changing an account's address or username in the admin; its details, the former ones
ADDRESS_CHANGE = "user.address_change"
# How many of the records naming an address are read at once to be rewritten
REWRITE_CHUNK = 500
# A character of an address's local part (RFC 5322's atext, and its dots)
_ATEXT = r"[\w.!#$%&'*+/=?^`{|}~-]"


def tombstone_address(user) -> str:
    """The address a deleted account is known by from then on: its id (the records stay attributable), a random part
    (a guess of it finds nothing), and a domain nothing is ever mailed to."""
    return f"deleted-{user.pk}-{secrets.token_hex(4)}@{TOMBSTONE_DOMAIN}"


def is_erased(user) -> bool:
    """Whether `user` is a deleted account: deactivated, its address its tombstone (`erase_person`), whose id is its
    own.

    NOTE: deactivated too, as every deletion leaves it (`closing.end_account`, in the same transaction): sign-up refuses
    no domain and ids are sequential, so an address alone, shaped as the account's own tombstone, made a live
    account's admin page read-only, and staff could not deactivate it there."""
    return (not user.is_active and (user.email or "").startswith(f"deleted-{user.pk}-")
            and user.email.endswith(f"@{TOMBSTONE_DOMAIN}"))


def addresses_of(user) -> set[str]:
    """Every spelling of the person's address the platform may have copied: the account's address and username, the
    address it verified, and those of the invitations it accepted, with their NFKC folding."""
    found = {user.email, user.username}
    found.update(EmailVerification.objects.filter(user=user).values_list("email", flat=True))
    found.update(Invitation.objects.filter(accepted_by=user).values_list("email", flat=True))
    return _spellings(found)


def former_addresses_of(user) -> dict[str, object]:
    """The addresses (and usernames) the account had before staff changed them in the admin
    (`admin.UserAdmin.save_model`), each with the last time it was the account's: the address may be another
    person's since."""
    former: dict[str, object] = {}
    for details, changed_at in AuditEvent.objects.filter(
            action=ADDRESS_CHANGE, target_type=get_user_model().__name__, target_id=str(user.pk)).values_list(
            "details", "created_at"):
        for address in _spellings(value for value in (details or {}).values() if isinstance(value, str)):
            former[address] = max(changed_at, former.get(address, changed_at))
    return former


def _spellings(addresses) -> set[str]:
    found = set(addresses)
    found.update({unicodedata.normalize("NFKC", address) for address in found if address})
    return {address.strip() for address in found if address and "@" in address}


@transaction.atomic
def erase_person(actor: Actor, user, *, reason: str) -> str:
    """Replaces the person's address and name by a tombstone on their account and in every record that copied them
    (`erase_records_of`); deletes their second-factor devices, enrolment codes and address verification. Returns the
    tombstone. The caller deactivates the account and ends its sessions (`endpoints.closing.end_account`)."""
    tombstone = erase_records_of(actor, user, reason=reason)
    remember_erased_mailbox(user)  # NOTE: its month's allowance without a card stays its mailbox's
    user.username = user.email = tombstone
    user.first_name = user.last_name = ""
    user.save(update_fields=["username", "email", "first_name", "last_name"])
    for device in devices_for_user(user, confirmed=None):
        device.delete()
    StaffEnrolmentCode.objects.filter(user=user).delete()
    EmailVerification.objects.filter(user=user).delete()
    return tombstone


@transaction.atomic
def erase_records_of(actor: Actor, user, *, reason: str) -> str:
    """Revokes the invitations pending to the person's address (audited with `reason`) and writes a new tombstone in
    place of the address wherever a record copied it; the tombstone."""
    addresses = addresses_of(user)
    for address in addresses:
        revoke_invitations_to(actor, address, reason=reason)
    tombstone = tombstone_address(user)
    pseudonymise_records(addresses, tombstone, since=user.date_joined, user=user)
    # NOTE: an address staff changed: as far as the change, not in what its next holder did with it since
    for address, until in former_addresses_of(user).items():
        if address not in addresses:
            pseudonymise_records({address}, tombstone, since=user.date_joined, until=until, user=user)
    return tombstone


def pseudonymise_records(addresses: set[str], tombstone: str, *, since, until=None, user=None) -> None:
    """Writes `tombstone` in place of each of `addresses` wherever a record copied one as text: audit events and the
    admin's history from `since` (or the first invitation to one of them, if earlier) on (up to `until`, if given),
    invitations; but nothing from before another account than `user` last held one of the addresses
    (`_held_by_another_until`)."""
    if not addresses:
        return
    # NOTE: a whole address only: `ada@example.test` is also the end of `nada@example.test` and the start of
    # `ada@example.test.org`, another person's, which the database's match finds too and which must stay as it is.
    # NOTE: `{` and `}` never end what stands before an address, and `'` only where no letter of an address stands
    # before it: they are letters of a local part too (RFC 5322's atext), and `o'brien@example.test` or
    # `{brien@example.test` is another person's than `brien@example.test`.
    either = "|".join(re.escape(address) for address in sorted(addresses, key=len, reverse=True))
    pattern = re.compile(rf"(?<![^\s<>()\[\],;:\"'])(?<!{_ATEXT}')(?:{either})(?![\w-]|\.[\w-])", re.IGNORECASE)
    to_address = Q()
    for address in addresses:
        to_address |= Q(email__iexact=address)
    invited = Invitation.objects.filter(to_address)
    if until is not None:
        invited = invited.filter(created_at__lte=until)
    if (held_until := _held_by_another_until(user, to_address, until)) is not None:
        invited = invited.filter(created_at__gt=held_until)
    first_invited = invited.aggregate(first=Min("created_at"))["first"]
    if first_invited is not None and (since is None or first_invited < since):
        since = first_invited
    if held_until is not None and (since is None or since < held_until):
        since = held_until
    invited.update(email=tombstone)

    _rewrite_records(AuditEvent, "created_at", addresses, since=since, until=until, rewrites={
        "target_repr": lambda text: pattern.sub(tombstone, text)[:200],
        "details": lambda details: _replaced(details, pattern, tombstone)})
    _rewrite_records(LogEntry, "action_time", addresses, since=since, until=until, rewrites={
        "object_repr": lambda text: pattern.sub(tombstone, text)[:200],
        "change_message": lambda text: pattern.sub(tombstone, text)})


def _rewrite_records(model, time_field: str, addresses: set[str], *, since, until, rewrites: dict) -> None:
    """Each of `model`'s records from `since` to `until` (its `time_field`) that names one of `addresses` in a field of
    `rewrites`, each such field rewritten by its function (a row at a time, only where it changes)."""
    naming = Q()
    for address in addresses:
        for name in rewrites:
            naming |= Q(**{f"{name}__icontains": address})
    records = model.objects.filter(naming)
    if since is not None:
        records = records.filter(**{f"{time_field}__gte": since})
    if until is not None:
        records = records.filter(**{f"{time_field}__lte": until})
    # NOTE: their ids first, in a plain query, unordered: read through a server-side cursor (`iterator`) in the
    # model's order (newest first), PostgreSQL planned for the first rows and walked the time index through every
    # event since `since`, and a cursor unordered prefers a sequential scan to the trigram indexes (migration 0019).
    ids = list(records.order_by().values_list("pk", flat=True))
    for start in range(0, len(ids), REWRITE_CHUNK):
        for record in model.objects.filter(pk__in=ids[start:start + REWRITE_CHUNK]).order_by().only("pk", *rewrites):
            changed = {name: rewritten for name, rewrite in rewrites.items()
                       if (rewritten := rewrite(getattr(record, name))) != getattr(record, name)}
            if changed:
                model.objects.filter(pk=record.pk).update(**changed)


def _held_by_another_until(user, to_address: Q, until=None):
    """When another account than `user` last held the address, as the records tell (the last invitation to it another
    account accepted, or that account's deletion, whichever is later); None where none did.

    NOTE: an account deleted before its address was erased from the records (the release before `erase_person`)
    left it in its invitations and events, and the address may sign up again: the next holder's erasure rewrote
    them to its own tombstone, and the trail named the wrong account, by id, for what the former holder did."""
    taken = Invitation.objects.filter(to_address, accepted_at__isnull=False)
    if until is not None:
        taken = taken.filter(accepted_at__lte=until)
    if user is not None:
        taken = taken.exclude(accepted_by=user)
    last = taken.aggregate(last=Max("accepted_at"))["last"]
    if last is None:
        return None
    holders = {str(pk) for pk in taken.exclude(accepted_by=None).values_list("accepted_by", flat=True)}
    deletions = AuditEvent.objects.filter(action="user.delete", target_type=get_user_model().__name__,
                                          target_id__in=holders)
    if until is not None:
        deletions = deletions.filter(created_at__lte=until)
    left = deletions.aggregate(left=Max("created_at"))["left"]
    return max(last, left) if left is not None else last


def _replaced(value, pattern: re.Pattern, tombstone: str):
    """`value` (an audit event's details: JSON) with each string's addresses replaced, keys included."""
    if isinstance(value, str):
        return pattern.sub(tombstone, value)
    if isinstance(value, list):
        return [_replaced(item, pattern, tombstone) for item in value]
    if isinstance(value, dict):
        return {_replaced(key, pattern, tombstone): _replaced(item, pattern, tombstone) for key, item in value.items()}
    return value
