"""A signed-in person creates another organisation (the console's "New organisation", `POST /api/v1/organizations/`):
the bounds a self-service organisation needs, then `services.create_organization`, the one path sign-up's first
organisation takes too. Nothing else is set here: the plan (none: the platform's default quotas), the billing account
(made on first use with the default cap, `BillingAccount.objects.for_organization`) and the standing rules are a
sign-up's, whichever way the organisation came.

NOTE: what an organisation gets without paying is its own: the default quotas (a share of the fleet), the spend
allowed without a card on an installation that bills through Stripe (`INFERPLANE_SPEND_LIMIT_WITHOUT_CARD`), its own
budgets of keys and invitations, its share of a gateway's fairness. Organisations made at will would multiply each of
them, so a person holds at most `settings.MAX_OWNED_ORGANIZATIONS`: every organisation they own or ever created,
closed ones included (a closed organisation spent its allowance: closing one and making another must not renew it),
and given-away ones (handed to a second account, which then owns it, then the next one made) included. The spend
allowed without a card is shared besides (`organizations_of_its_people`, `billing.standing.
limit_without_payment_method`): a person has one allowance, not one an organisation, spent by the organisations they
created, handed on or not, and those handed on to them (`holdings_of`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import CharField, F, Func, Q, Value
from django.db.models.functions import Now, Replace
from django.db.models.signals import post_save
from django.utils.crypto import salted_hmac
from redis.exceptions import RedisError

from controlplane import redis_keys
from controlplane.accounts import throttle
from controlplane.accounts.backends import TOMBSTONE_DOMAIN
from controlplane.accounts.models import (
    ORGANIZATION_CREATED_ACTION,
    AuditEvent,
    Membership,
    Organization,
    Role,
    email_is_verified,
    lock_person,
)
from controlplane.accounts.services import Actor, NotPermitted, create_organization
from controlplane.redis_client import get_redis

logger = logging.getLogger(__name__)

# How long a deleted account's mailbox still names it (`remember_erased_mailbox`): past the end of the month of its
# deletion, whose allowance without a card it spent; and the salt of the mailbox's keyed digest.
ERASED_MAILBOX_TTL_S = 32 * 86_400
ERASED_MAILBOX_SALT = "controlplane.accounts.organizations.erased-mailbox"

# The audit action `services.create_organization` writes, its actor the person who created it (sign-up, or here).
CREATED = ORGANIZATION_CREATED_ACTION


class CreationRefused(NotPermitted):
    """The person may not create an organisation at all (a 403 on `/api/`); `code` says why, for a client."""

    def __init__(self, code: str, message: str):
        super().__init__("non_field_errors", message)
        self.code = code


class TooManyOrganizations(ValueError):
    """The person already owns or created `settings.MAX_OWNED_ORGANIZATIONS` organisations (a 400)."""

    field = "non_field_errors"


class TooManyAttempts(ValueError):
    """Past `throttle.NEW_ORGANIZATIONS`: try again in `retry_after_s` (a 429)."""

    def __init__(self, retry_after_s: int):
        super().__init__(f"Too many organisations created lately; try again in {max(1, retry_after_s // 60)} minutes.")
        self.retry_after_s = retry_after_s


def held_by(user):
    """The organisations that count against `user`'s `MAX_OWNED_ORGANIZATIONS`: those they own now, and those they
    created (the `organization.create` events they acted: at sign-up or here), closed or given away."""
    return held_by_any([user.pk])


def held_by_any(user_ids: Collection[int]):
    """`held_by` of each of these people, together."""
    created = AuditEvent.objects.filter(actor_id__in=user_ids, action=CREATED).values("organization_id")
    return Organization.objects.filter(
        Q(memberships__user_id__in=user_ids, memberships__role=Role.OWNER) | Q(pk__in=created)).distinct()


def people_of(organization_id: int, *, since: datetime | None = None, until: datetime | None = None) -> set[int]:
    """The people whose organisation it was between `since` and `until` (unbounded where None), for what one person may
    have without paying (`holdings_of`), each with every account at their mailbox (`same_mailbox`)."""
    shares = holdings_of([organization_id])[organization_id]
    return same_mailbox(set().union(*(share.people for share in shares if share.overlaps(since, until))))


@dataclass(frozen=True, slots=True)
class Share:
    """Whose allowance an organisation's spend from `since` (always where None) is: `people`'s."""

    people: frozenset[int]
    since: datetime | None = None

    def overlaps(self, since: datetime | None, until: datetime | None) -> bool:
        """Whether it is theirs at some moment between `since` and `until` (unbounded where None)."""
        return self.since is None or until is None or self.since < until


def holdings_of(organization_ids: Collection[int]) -> dict[int, list[Share]]:
    """Whose allowance each of these organisations spends, in four queries however many they are: its creator's (its
    `organization.create` event's actor), always; once handed on (its owners all others: `Organization.handed_on_at`)
    its owners' too from then (one handed on before that was kept, all of it); with no creation event, its owners'.

    NOTE: an owner who joined (by invitation) shares nothing while its creator owns it: before, every owner was one of
    its people both ways, and a stranger invited as an owner then had her own organisations refused for what the
    inviter spent in his, and his for hers. Its creator's whatever it spends, whoever holds it: owners are read as they
    are now, so an owner who leaves takes nothing of what was spent in their time with them, and a creator freed of
    one handed on had a fresh allowance for each of the five he may make, each spent by a second account of his that
    then handed it on to a third (a review's finding). What it spent before it was handed on is none of its new
    owners', so handing one on drains none of theirs."""
    ids = set(organization_ids)
    creators: dict[int, set[int]] = defaultdict(set)
    owners: dict[int, set[int]] = defaultdict(set)
    for organization_id, actor_id in AuditEvent.objects.filter(
            organization_id__in=ids, action=CREATED, actor_id__isnull=False).values_list("organization_id", "actor_id"):
        creators[organization_id].add(actor_id)
    for organization_id, user_id in Membership.objects.filter(organization_id__in=ids, role=Role.OWNER
                                                              ).values_list("organization_id", "user_id"):
        owners[organization_id].add(user_id)
    states = {pk: (closed_at, handed_on_at) for pk, closed_at, handed_on_at in Organization.objects.filter(
        pk__in=ids).values_list("pk", "closed_at", "handed_on_at")}
    mailboxes = _mailboxes(set().union(*creators.values(), *owners.values()))
    holdings = {}
    for organization_id in ids:
        its_creators, its_owners = frozenset(creators[organization_id]), frozenset(owners[organization_id])
        closed_at, handed_on_at = states.get(organization_id, (None, None))
        if not its_creators:
            holdings[organization_id] = [Share(its_owners)]
        elif _own_it(its_creators, its_owners, mailboxes):
            holdings[organization_id] = [Share(its_creators)]
        elif handed_on_at is not None:
            holdings[organization_id] = [Share(its_creators), Share(its_owners, since=handed_on_at)]
        elif closed_at is not None or not its_owners:
            holdings[organization_id] = [Share(its_creators)]
        else:  # handed on before `handed_on_at` was kept
            holdings[organization_id] = [Share(its_creators), Share(its_owners)]
    return holdings


def _mailboxes(user_ids: Collection[int]) -> dict[int, str | int]:
    """Each account's mailbox (`mailbox_of`), or the account itself where its username is none (staff's, a
    tombstone)."""
    return {pk: mailbox_of(username) or pk
            for pk, username in get_user_model().objects.filter(pk__in=user_ids).values_list("pk", "username")}


def _own_it(creators: Collection[int], owners: Collection[int], mailboxes: dict[int, str | int]) -> bool:
    """Whether an account at a creator's mailbox is one of the owners."""
    return bool({mailboxes.get(pk, pk) for pk in creators} & {mailboxes.get(pk, pk) for pk in owners})


def note_handed_on(sender=None, instance: Membership | None = None, **kwargs) -> None:
    """A membership was saved or deleted (Django's `post_save`, `post_delete` of `Membership`): stamp the
    organisation's `handed_on_at` (PostgreSQL's clock) as its creator stops owning it, clear it as they own it again.

    NOTE: in the membership's own transaction, so a change and its stamp commit together; a closed or ownerless one
    keeps its stamp, and one whose creator is unknown (no creation event) has none. An owner saved hands nothing on:
    read further only where it may take the stamp away (one query a save, as a repeated no-op role change makes)."""
    organization_id = instance.organization_id
    organization = Organization.objects.filter(pk=organization_id)
    if instance.role == Role.OWNER and kwargs.get("signal") is post_save:
        if not organization.exclude(handed_on_at=None).exists():
            return
    creators = set(AuditEvent.objects.filter(organization_id=organization_id, action=CREATED, actor_id__isnull=False
                                             ).values_list("actor_id", flat=True))
    if not creators:
        return
    owners = set(Membership.objects.filter(organization_id=organization_id, role=Role.OWNER
                                           ).values_list("user_id", flat=True))
    if not owners:
        return
    if _own_it(creators, owners, _mailboxes(creators | owners)):
        organization.exclude(handed_on_at=None).update(handed_on_at=None)
    else:
        organization.filter(handed_on_at=None, closed_at=None).update(handed_on_at=Now())


def same_mailbox(user_ids: Collection[int]) -> set[int]:
    """These accounts and every other whose address reaches the same mailbox with or without a sub-address
    (`ada+anything@example.test` is delivered to `ada@example.test`'s inbox by most mail hosts), at Gmail whatever its
    dots and at either of its domains (`mailbox_of`).

    NOTE: each sub-address is a mailbox its owner verifies at no cost: before, one inbox signed up as many accounts as
    it wanted, each with its own organisations and allowance without a card; so did each spelling of a Gmail mailbox
    with dots, 2^(n-1) of an n-letter one. Read by the username (an account's address, lower-cased:
    `backends.normalize_email`), through its index, and a Gmail one through the index of its local part without dots
    or sub-address (`dotless_local`, migration 0021). Not folded: dots elsewhere (`a.da@example.test` is
    another person's, as a host may have it) and another sub-address separator (`ada-x@`) stay apart. `+` is read so at
    every host, the safe side: two people at a host where it is part of a name share one allowance (refused sooner,
    never given more)."""
    users = get_user_model().objects
    found, mailboxes, dotless = Q(pk__in=user_ids), set(), set()
    for address in users.filter(pk__in=user_ids).values_list("username", flat=True):
        if (mailbox := mailbox_of(address)) is not None:
            base, _, domain = mailbox.rpartition("@")
            if domain == GMAIL:
                dotless.add(base)
            else:
                found |= Q(username=mailbox) | Q(username__startswith=f"{base}+", username__endswith=f"@{domain}")
            mailboxes.add(mailbox)
    if dotless:
        found |= Q(pk__in=at_gmail(dotless).values("pk"))
    found |= Q(pk__in=erased_at(mailboxes))
    return set(users.filter(found).values_list("pk", flat=True))


# Gmail's domain, and the other it delivers to the same mailboxes; it ignores the dots of a local part.
GMAIL = "gmail.com"
_GMAIL_DOMAINS = frozenset({GMAIL, "googlemail.com"})
_AT_GMAIL = Q(username__endswith=f"@{GMAIL}") | Q(username__endswith="@googlemail.com")


def at_gmail(dotless: Collection[str]):
    """The accounts at Gmail whose local part, without its sub-address and dots, is one of these (`dotless_local`)."""
    return get_user_model().objects.filter(_AT_GMAIL).annotate(dotless=dotless_local()).filter(dotless__in=dotless)


def dotless_local():
    """An account's local part without its sub-address and dots, as PostgreSQL reads it from the username.

    NOTE: the expression of the index migration 0021 makes (`auth_user_dotless_local`), to the letter: another one
    finds nothing by it, and Gmail's mailboxes were read whole at each write of an organisation's limits."""
    local = Func(F("username"), Value("@"), Value(1), function="split_part", output_field=CharField())
    return Replace(Func(local, Value("+"), Value(1), function="split_part", output_field=CharField()), Value("."),
                   Value(""))


def mailbox_of(username: str) -> str | None:
    """The mailbox an account's address reaches, its sub-address dropped (`ada+x@example.test`: `ada@example.test`),
    and at Gmail its dots too, at its own domain (`a.da@googlemail.com`: `ada@gmail.com`), as `same_mailbox` matches
    it; None for a username that is no address (a staff account's) or a tombstone."""
    local, at, domain = username.rpartition("@")
    base = local.split("+", 1)[0]
    if domain in _GMAIL_DOMAINS:
        base, domain = base.replace(".", ""), GMAIL
    return f"{base}@{domain}" if at and base and domain != TOMBSTONE_DOMAIN else None


def _mailbox_digest(mailbox: str) -> str:
    return salted_hmac(ERASED_MAILBOX_SALT, mailbox).hexdigest()


def remember_erased_mailbox(user) -> None:
    """Once the deletion of `user`'s account commits, its mailbox (`mailbox_of`) names it for `ERASED_MAILBOX_TTL_S`,
    as a keyed digest in Redis, never the address: the mailbox's accounts (`same_mailbox`) include it, and their
    allowance without a card its organisations' spend of the month (`erasure.erase_person` calls it before the address
    goes).

    NOTE: the deletion replaced the address by a tombstone, and with it every link to the mailbox: a sub-address
    signed up, spent the allowance, was deleted (its organisation closed), and the next sub-address, or the same address
    signed up again, had the whole allowance again, as often as sign-up's throttle allowed. Lost with Redis's memory,
    or where Redis fails then (logged): that month's link only."""
    mailboxes = {mailbox_of(user.username), mailbox_of(user.email or "")} - {None}

    def remember() -> None:
        pipeline = get_redis().pipeline(transaction=False)
        for mailbox in sorted(mailboxes):
            key = redis_keys.erased_mailbox_key(_mailbox_digest(mailbox))
            pipeline.sadd(key, user.pk)
            pipeline.expire(key, ERASED_MAILBOX_TTL_S)
        pipeline.execute()

    if mailboxes:
        transaction.on_commit(remember, robust=True)


def erased_at(mailboxes: Collection[str]) -> set[int]:
    """The accounts deleted lately at these mailboxes (`remember_erased_mailbox`), in one round trip; none, logged,
    where Redis fails."""
    if not mailboxes:
        return set()
    pipeline = get_redis().pipeline(transaction=False)
    for mailbox in sorted(mailboxes):
        pipeline.smembers(redis_keys.erased_mailbox_key(_mailbox_digest(mailbox)))
    try:
        found = pipeline.execute()
    except RedisError:
        logger.warning("the accounts deleted lately at %s mailbox(es) are not readable now", len(mailboxes))
        return set()
    return {int(member) for members in found for member in members}


def organizations_sharing(organization_ids: Collection[int]) -> set[int]:
    """Those of these organisations whose people (`people_of`) may have another (`organizations_of_its_people`), read
    together in six queries however many they are: a creator or owner (a superset of `holdings_of`) who holds another,
    or whose mailbox another account reaches too (any with a sub-address, or at Gmail with dots or at googlemail.com, counted so: `mailbox_of`).

    NOTE: a superset, never less, of those whose spend leaves another less: whose others' limits the beat task writes
    (`billing.services.refresh_shared_allowances`). Not an account deleted lately at the mailbox
    (`remember_erased_mailbox`): its organisations are closed, or another's whose room its mailbox's spend leaves
    whole. Five queries for each organisation that spent without a card this month, most of
    them a person's only one, took a worker ~6 ms each every minute to write nothing: past ~6,000 of them a run
    outlasted its budget and left a random part to the next. The addresses spelt otherwise are read whole (the
    username index serves no `+` inside a name): one scan of the accounts a run."""
    creators = AuditEvent.objects.filter(organization_id__in=organization_ids, action=CREATED, actor_id__isnull=False
                                         ).values_list("organization_id", "actor_id")
    owners = Membership.objects.filter(organization_id__in=organization_ids, role=Role.OWNER
                                       ).values_list("organization_id", "user_id")
    people: dict[int, set[int]] = defaultdict(set)  # organisation: its people
    for organization_id, user_id in (*creators, *owners):
        people[organization_id].add(user_id)
    everyone = set().union(*people.values())
    held: dict[int, set[int]] = defaultdict(set)  # person: the organisations they hold (`held_by_any`)
    for user_id, organization_id in (
            *AuditEvent.objects.filter(actor_id__in=everyone, action=CREATED).values_list("actor_id", "organization_id"),
            *Membership.objects.filter(user_id__in=everyone, role=Role.OWNER).values_list("user_id", "organization_id")):
        held[user_id].add(organization_id)
    users = get_user_model().objects
    mailboxes = {pk: mailbox_of(username) for pk, username in users.filter(pk__in=everyone).values_list("pk", "username")}
    # NOTE: every account whose address is not its mailbox as written: a sub-address, or a Gmail one with dots or at
    # googlemail.com (`mailbox_of`)
    spelt_otherwise = (Q(username__contains="+") | Q(username__regex=r"^[^@]*\.[^@]*@g(oogle)?mail\.com$")
                       | Q(username__endswith="@googlemail.com"))
    shared = {mailbox_of(username) for username in users.filter(spelt_otherwise).values_list("username", flat=True)}
    return {organization_id for organization_id, its_people in people.items()
            if any(held[user_id] - {organization_id} or mailboxes.get(user_id) in shared - {None}
                   for user_id in its_people)}


def organizations_of_its_people(organization_id: int, *, since: datetime | None = None,
                                until: datetime | None = None) -> list[int]:
    """The other organisations of the people whose organisation it is (`people_of`), closed ones too, between `since`
    and `until` (unbounded where None): `allowance_windows_of_its_people`'s."""
    return sorted(allowance_windows_of_its_people(organization_id, since=since, until=until))


def allowance_windows_of_its_people(organization_id: int, *, since: datetime | None = None,
                                    until: datetime | None = None) -> dict[int, tuple[datetime | None, datetime | None]]:
    """Each other organisation whose allowance was one of the people's whose organisation this is (`people_of`)
    between `since` and `until`, with the part of that time its spend is theirs (`holdings_of`: all of it but for one
    handed on to them in between). NOTE: what a person gets without paying is shared among these
    (`billing.standing.limit_without_payment_method`), as `MAX_OWNED_ORGANIZATIONS` bounds how many they created."""
    people = people_of(organization_id, since=since, until=until)
    if not people:
        return {}
    candidates = set(held_by_any(people).values_list("pk", flat=True)) - {organization_id}
    windows = {}
    for other_id, shares in holdings_of(candidates).items():
        theirs = [share for share in shares if share.people & people and share.overlaps(since, until)]
        if theirs:
            windows[other_id] = (_latest(since, *(share.since for share in theirs)), until)
    return windows


def _latest(bound: datetime | None, *starts: datetime | None) -> datetime | None:
    """The latest of `bound` and the earliest of `starts` (None: unbounded)."""
    start = None if None in starts else min(starts)
    return max((moment for moment in (bound, start) if moment is not None), default=None)


def create_own_organization(actor: Actor, *, name: str) -> Organization:
    """A new organisation named `name` (a free slug made from it), owned by the signed-in `actor.user`, audited
    (`organization.create`).

    Refused (`CreationRefused`, with its `code`) with an API key (`session_required`: a key acts in its own
    organisation, and is bounded by it; a leaked key must make nothing outside it), for an account that is inactive
    (`account_inactive`: deactivated or deleted, its address a tombstone) or whose address is not verified
    (`email_unverified`, as the console refuses it every page); `TooManyOrganizations` at the person's cap;
    `TooManyAttempts` past the throttle, counted only once every other check passed.
    """
    if actor.api_key is not None or actor.user is None:
        raise CreationRefused("session_required", "An API key acts in its own organisation only: create "
                                                  "organisations when signed in, in the console.")
    with transaction.atomic():
        # NOTE: the person's row, locked: two creations at once each counted the others' organisations before either
        # was written, and both passed the cap; and the account's end waits for it (`lock_person`).
        user = lock_person(actor.user.pk)
        if user is None or not user.is_active:
            raise CreationRefused("account_inactive", "This account is deactivated: it creates nothing.")
        if not email_is_verified(user):
            raise CreationRefused("email_unverified", "Verify your email address first: follow the link we emailed "
                                                      "you.")
        limit = settings.MAX_OWNED_ORGANIZATIONS
        if held_by(user).count() >= limit:
            raise TooManyOrganizations(
                f"You already own or created {limit} organisations, the most one person may (closed ones and ones "
                "you handed to others count too).")
        # NOTE: counted only here, past every refusal: a refused attempt made nothing and spends no budget.
        retry_after_s = throttle.take(throttle.NEW_ORGANIZATIONS, {
            "user": str(user.pk), "ip": actor.source_ip or ""}).retry_after_s
        if retry_after_s is not None:
            raise TooManyAttempts(retry_after_s)
        return create_organization(Actor(user=user, source_ip=actor.source_ip), name=name, owner=user)
