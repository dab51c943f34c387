"""API keys: minting (the secret shown once), who may revoke whose key, revoking (a key with the keys it
minted, a person's keys where their membership ends), and finding and authenticating a key from its plain
secret, with its creator's current role."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import DatabaseError, IntegrityError, transaction
from django.dispatch import Signal
from django.utils import timezone

from controlplane import tokens
from controlplane.accounts.known_credentials import SharedKnownCredentials
from controlplane.accounts.models import ApiKey, Membership, Organization, Role, Scope, lock_organizations
from controlplane.accounts.services import Actor, NotPermitted, actor_role, ensure_open, record_audit
from controlplane.clock import DatabaseClock
from controlplane.credential_lookups import CredentialLookups

logger = logging.getLogger(__name__)

# last_used_at is written at most this often per key, so hot keys cost no write per call.
LAST_USED_RESOLUTION = timedelta(seconds=60)

# NOTE: anyone may send well-formed keys never seen before, each a query: refused ones are remembered for
# `INFERPLANE_API_KEY_NEGATIVE_CACHE_S`, and at most this many are looked up at once per process (the gateway's
# key cache and `/api/v1` alike; see `controlplane.credential_lookups`).
API_KEY_LOOKUPS = CredentialLookups(max_concurrent=4, refused_for_s=lambda: settings.API_KEY_NEGATIVE_CACHE_S)
# Keys real to any process, or just minted: a process that never saw one looks it up without waiting behind a flood
# of made-up ones for a slot (`controlplane.accounts.known_credentials`).
API_KEYS_KNOWN = SharedKnownCredentials("api_key")

# Sent in the transaction that creates a key, with `api_key` and `minting_key` (the key that created it, or None):
# billing gives a key minted by a key with a spend cap the same cap (`billing.services.inherit_key_spend_cap`).
api_key_created = Signal()


@dataclass(slots=True, frozen=True)
class CreatedApiKey:
    api_key: ApiKey
    plain: str  # the only time the secret exists outside the client


class TooManyKeys(ValueError):
    """The organisation already holds `settings.MAX_LIVE_API_KEYS_PER_ORG` live keys (a 400, not the caller's role)."""

    field = "non_field_errors"


def _ensure_room_for_a_key(organization: Organization) -> None:
    """Refuses a key past the organisation's live keys (neither revoked nor expired); under its row's lock.

    NOTE: the gateway keeps at most `auth.KNOWN_KEYS_MAX` keys per process, least recently used dropped first: one
    organisation calling in turn with more keys than that pushed every other tenant's key out, each of their calls
    then a PostgreSQL lookup queued (4 at once) behind its flood. Keys were unbounded. (The cache is now also shared
    fairly between organisations: `auth._callers_by_key`.)"""
    limit = settings.MAX_LIVE_API_KEYS_PER_ORG
    live = ApiKey.objects.filter(organization=organization, revoked_at__isnull=True).exclude(
        expires_at__lte=DatabaseClock())  # as `find_api_key` judges it
    if live.count() >= limit:
        raise TooManyKeys(f"This organisation already has {limit} live API keys, the most it may hold; "
                          "revoke one it no longer uses.")


def create_api_key(
    actor: Actor,
    organization: Organization,
    *,
    name: str,
    scopes: list[str],
    expires_at: datetime | None = None,
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
    max_priority_boost: int | None = None,
) -> CreatedApiKey:
    """A new key; its secret is in the answer and nowhere else.

    NOTE: a key acts with its creator's role, and a `manage` key can do what its creator can,
    so only owners and admins may mint one; a key mints only keys within its own bounds (expiry, scopes,
    limits, priority range, spend cap: `_bounded_by_minting_key`). Likewise only owners and admins may give
    a key a priority range (its calls ahead of colleagues' and of batch work) or limits above the platform's
    defaults; a member may set stricter ones.
    """
    if actor.user is not None:
        _ensure_role_may_mint(actor_role(actor, organization), scopes=scopes, requests_per_minute=requests_per_minute,
                              tokens_per_minute=tokens_per_minute, max_priority_boost=max_priority_boost)
    minting = actor.api_key
    if minting is not None:
        requests_per_minute, tokens_per_minute = _bounded_by_minting_key(
            minting, scopes=scopes, expires_at=expires_at, requests_per_minute=requests_per_minute,
            tokens_per_minute=tokens_per_minute, max_priority_boost=max_priority_boost)
    for _ in range(3):
        issued = tokens.issue_token(ApiKey.TOKEN_KIND)
        try:
            with transaction.atomic():
                # NOTE: NO KEY UPDATE: other keys' creations in the organisation queue behind it, inserts that only
                # reference the row do not (see below).
                lock_organizations([organization.pk])
                ensure_open(organization.pk)
                # NOTE: the minting key's row stays locked until its child is committed, so revoking it
                # (`revoke_api_key`, which looks for its children once it has updated it) waits and finds the child;
                # a key revoked since this call was authenticated mints nothing.
                if minting is not None and ApiKey.objects.select_for_update().filter(
                        pk=minting.pk, revoked_at__isnull=True).values_list("pk", flat=True).first() is None:
                    raise NotPermitted("non_field_errors", "The key this call was made with was revoked.")
                if actor.user is not None:
                    # NOTE: the organisation's row was locked first, as removing or re-roling a member takes it
                    # (`members._lock_membership`), so one of them waits for this key's commit and then lists it to
                    # revoke, or this waits for theirs and reads the role it left; a member removed (or demoted) since
                    # the check above gets no key. Before, a key created while its creator was being removed outlived
                    # the removal, and came back with them (the review of this stop's diff); and with the membership's
                    # row alone locked here, the change (holding the organisation's row) waited on it while this
                    # commit's deferred foreign-key check waited on the organisation's row: a deadlock, one of them
                    # failed. Taken first (above), before the minting key's row, which a removal revokes too.
                    role = Membership.objects.select_for_update().filter(
                        organization=organization, user=actor.user).values_list("role", flat=True).first()
                    if role is None:
                        raise NotPermitted("non_field_errors", "You are no longer a member of this organisation.")
                    _ensure_role_may_mint(role, scopes=scopes, requests_per_minute=requests_per_minute,
                                          tokens_per_minute=tokens_per_minute, max_priority_boost=max_priority_boost)
                _ensure_room_for_a_key(organization)
                api_key = ApiKey.objects.create(
                    organization=organization,
                    created_by=actor.user,
                    minted_by=minting,
                    name=name,
                    lookup=issued.lookup,
                    digest=issued.digest,
                    scopes=sorted(set(scopes)),
                    expires_at=expires_at,
                    requests_per_minute=requests_per_minute,
                    tokens_per_minute=tokens_per_minute,
                    max_priority_boost=max_priority_boost,
                )
                record_audit(actor, organization, "api_key.create", api_key, scopes=api_key.scopes)
                api_key_created.send(sender=ApiKey, api_key=api_key, minting_key=minting)
                # NOTE: known to every process from its first call: a key just minted was a stranger to each, and
                # its first calls were 503s behind any flood of made-up keys (`known_credentials`).
                transaction.on_commit(functools.partial(API_KEYS_KNOWN.add, API_KEY_LOOKUPS.digest(issued.plain),
                                                         owner=organization.pk))
            return CreatedApiKey(api_key=api_key, plain=issued.plain)
        except IntegrityError:  # a lookup collision: astronomically rare, try a new one
            continue
    raise RuntimeError("could not allocate a unique API key lookup")


def _ensure_role_may_mint(role: str | None, *, scopes: list[str], requests_per_minute: int | None,
                          tokens_per_minute: int | None, max_priority_boost: int | None) -> None:
    if role in (Role.OWNER, Role.ADMIN):
        return
    if Scope.MANAGE in scopes:
        raise NotPermitted("scopes", "Only owners and admins may create keys with the 'manage' scope.")
    if max_priority_boost is not None:
        raise NotPermitted("max_priority_boost", "Only owners and admins may let a key set its calls' priority.")
    for field, value, default in (("requests_per_minute", requests_per_minute, settings.DEFAULT_KEY_REQUESTS_PER_MINUTE),
                                  ("tokens_per_minute", tokens_per_minute, settings.DEFAULT_KEY_TOKENS_PER_MINUTE)):
        if value is not None and default and value > default:
            raise NotPermitted(field, f"Only owners and admins may raise a key's limit above the platform's {default}.")


def _bounded_by_minting_key(
    minting: ApiKey,
    *,
    scopes: list[str],
    expires_at: datetime | None,
    requests_per_minute: int | None,
    tokens_per_minute: int | None,
    max_priority_boost: int | None,
) -> tuple[int | None, int | None]:
    """The rate limits of a key that `minting` creates: its own when not given; refuses anything beyond its own.

    NOTE: a key minted by a key is bounded by it: a leaked key, revoked by nobody, must not outlive its expiry,
    widen its scopes (a `manage`-only key minting an `inference` key), or lift its rate limits or spend cap
    (billing copies the cap) through its child.
    """
    if minting.expires_at is not None and (expires_at is None or expires_at > minting.expires_at):
        raise NotPermitted("expires_at", "A key that expires may only create keys that expire no later than it does "
                                         f"({minting.expires_at.isoformat()}): set expires_at.")
    beyond = sorted(set(scopes) - set(minting.scopes))
    if beyond:
        raise NotPermitted("scopes", f"A key may only create keys with scopes it has itself ({', '.join(minting.scopes)}),"
                                     f" not {', '.join(beyond)}.")
    if max_priority_boost is not None and (minting.max_priority_boost is None
                                           or max_priority_boost > minting.max_priority_boost):
        raise NotPermitted("max_priority_boost", "A key may only let the keys it creates set their calls' priority "
                                                 f"as far as it may itself ({minting.max_priority_boost or 'not at all'}).")
    # NOTE: a key's limits are counted per key: a child given its parent's limits has a window of its own, so a key
    # limited to N calls a minute that may create keys made two children and called 3N times a minute (a review's
    # finding). As with a spend cap (`billing.services.inherit_key_spend_cap`), a key with limits of its own creates
    # no key that runs inference; a key at the platform's limits may, each child getting what a key made in the
    # console gets.
    if Scope.INFERENCE in scopes and (minting.requests_per_minute is not None or minting.tokens_per_minute is not None):
        raise NotPermitted("scopes", "A key with rate limits of its own (requests_per_minute or tokens_per_minute) may "
                                     "not create keys that run inference: each would have limits of its own, and "
                                     "together they could call past them. Create inference keys in the console, or "
                                     "with a key at the platform's limits.")
    limits = []
    for field, value, own, own_effective in (
        ("requests_per_minute", requests_per_minute, minting.requests_per_minute, minting.effective_requests_per_minute),
        ("tokens_per_minute", tokens_per_minute, minting.tokens_per_minute, minting.effective_tokens_per_minute),
    ):
        if value is None:
            value = own  # its own limit; None is the platform's default, which is then its own as well
        elif own_effective and value > own_effective:
            raise NotPermitted(field, f"A key may only create keys with limits no higher than its own ({own_effective}).")
        limits.append(value)
    return limits[0], limits[1]


def may_revoke_api_key(actor: Actor, api_key: ApiKey, *, actor_role: str | None, creator_role: str | None) -> bool:
    """Members revoke their own keys, admins any key but an owner's, owners every key. The same rule says who
    may set a key's spend cap (`billing.services.set_key_spend_cap`).

    `creator_role` is the key creator's role now (None once they left: anyone who may revoke
    others' keys may revoke it). The system (actor without a user) may revoke any key.
    """
    if actor.user is None:
        return True
    if actor_role is None or actor_role == Role.VIEWER:
        return False
    if api_key.created_by_id == actor.user.pk or actor_role == Role.OWNER:
        return True
    return actor_role == Role.ADMIN and creator_role != Role.OWNER


def member_roles(organization: Organization) -> dict[int, str]:
    """Each member's role by user id: one query for a page of keys."""
    return dict(Membership.objects.filter(organization=organization).values_list("user_id", "role"))


@transaction.atomic
def revoke_api_key(actor: Actor, api_key: ApiKey) -> ApiKey:
    """Revokes the key and every key it minted (`ApiKey.minted_by`), and theirs, in one transaction, with one audit
    event each.

    NOTE: a key minted by a key has that key's power: revoking a leaked key left the keys its holder had minted
    with it working, unbounded in time (a review's finding). Revoking a key already revoked revokes what it minted
    that still works (keys minted before their parent was recorded, then linked from the audit log by migration
    0009, were not revoked with it)."""
    # NOTE: the organisation's row first, as removing or demoting the key's creator does before revoking their keys:
    # with the key's row alone, each waited on the other (this commit's foreign keys take the organisation's row) and
    # PostgreSQL failed one.
    lock_organizations([api_key.organization_id])
    roles = member_roles(api_key.organization)
    if not may_revoke_api_key(actor, api_key, actor_role=roles.get(actor.user.pk) if actor.user else None,
                              creator_role=roles.get(api_key.created_by_id)):
        raise NotPermitted("api_key", "Members may revoke only their own keys, and only owners may revoke an owner's key.")
    _revoke_with_minted(actor, api_key, now=timezone.now())
    api_key.refresh_from_db()
    return api_key


@transaction.atomic
def revoke_api_keys_of(actor: Actor, user, *, organization: Organization | None = None, reason: str) -> int:
    """Revokes every key `user` created (in `organization`, or in every organisation), and the keys those minted,
    each audited with `reason`; the number revoked.

    NOTE: called wherever a person's membership ends (`members.remove_member`) or staff deactivate their account. A
    key acts with its creator's current role, so a removed member's keys only seemed dead: invited back, even as a
    viewer, every key they had made came back, `manage` keys included (a review's finding)."""
    created = ApiKey.objects.filter(created_by=user, revoked_at__isnull=True).select_related("organization")
    if organization is not None:
        created = created.filter(organization=organization)
    # NOTE: each organisation's row first (in one order), as `revoke_api_key` does.
    lock_organizations(created.values("organization_id"))
    now = timezone.now()
    return sum(_revoke_with_minted(actor, api_key, now=now, reason=reason) for api_key in created.order_by("pk"))


@transaction.atomic
def revoke_api_keys_of_organization(actor: Actor, organization: Organization, *, reason: str) -> int:
    """Revokes every live key of `organization` (whoever created it, a departed member's included), each audited
    with `reason`, as `revoke_api_keys_of` does; the number revoked. Called where the organisation closes
    (`endpoints.closing.close_organization`)."""
    lock_organizations([organization.pk])
    now = timezone.now()
    live = ApiKey.objects.filter(organization=organization, revoked_at__isnull=True).select_related("organization")
    return sum(_revoke_with_minted(actor, api_key, now=now, reason=reason) for api_key in live.order_by("pk"))


@transaction.atomic
def revoke_api_keys_beyond_role(actor: Actor, user, *, organization: Organization, role: str, reason: str) -> int:
    """Revokes every key `user` created in `organization` that `role` may not create (`_ensure_role_may_mint`: the
    `manage` scope, a priority range, limits above the platform's), and the keys those minted, each audited with
    `reason`; the number revoked.

    NOTE: called where a member's role falls (`members.change_member_role`). A key acts with its creator's current
    role, but what only an admin may give a key stayed on it: an admin demoted to member kept their `manage` keys, and
    keys whose calls ran ahead of colleagues' or past the platform's limits, which no member may make (a review's
    finding). Keys the new role may make stay (a viewer's are refused on `/v1` by its role, as before)."""
    num_revoked, now = 0, timezone.now()
    created = ApiKey.objects.filter(organization=organization, created_by=user, revoked_at__isnull=True)
    for api_key in created.select_related("organization").order_by("pk"):
        try:
            _ensure_role_may_mint(role, scopes=api_key.scopes, requests_per_minute=api_key.requests_per_minute,
                                  tokens_per_minute=api_key.tokens_per_minute,
                                  max_priority_boost=api_key.max_priority_boost)
        except NotPermitted:
            num_revoked += _revoke_with_minted(actor, api_key, now=now, reason=reason)
    return num_revoked


def _revoke_with_minted(actor: Actor, api_key: ApiKey, *, now, **details) -> int:
    """Revokes `api_key` and the keys minted from it, generation by generation; the number revoked here."""
    num_revoked = ApiKey.objects.filter(pk=api_key.pk, revoked_at__isnull=True).update(revoked_at=now)
    if num_revoked:
        record_audit(actor, api_key.organization, "api_key.revoke", api_key, **details)
    # NOTE: each generation is read after the one before it is updated: a child being minted by one of those
    # (its row locked by `create_api_key`) made that update wait for its commit, so it is read here.
    for children in minted_generations(api_key):
        for child in children:
            if ApiKey.objects.filter(pk=child.pk, revoked_at__isnull=True).update(revoked_at=now):
                num_revoked += 1
                record_audit(actor, api_key.organization, "api_key.revoke", child,
                             **(details or {"reason": "minted by a revoked key"}), minted_by=child.minted_by_id)
    return num_revoked


def minted_generations(api_key: ApiKey) -> Iterator[list[ApiKey]]:
    """The keys `api_key` minted (`ApiKey.minted_by`), revoked ones too, then the keys those minted, and so on: one
    generation at a time, each read only once the caller has handled the one before."""
    seen, generation = {api_key.pk}, [api_key.pk]
    while generation:
        children = list(ApiKey.objects.filter(minted_by_id__in=generation).exclude(pk__in=seen).order_by("pk"))
        if not children:
            return
        yield children
        seen.update(child.pk for child in children)
        generation = [child.pk for child in children]


def find_api_key(plain: str) -> ApiKey | None:
    """The usable key that `plain` names, or None. Marks it used (coarsely)."""
    lookup = tokens.split_token(plain, ApiKey.TOKEN_KIND)
    if lookup is None:
        return None
    # NOTE: its expiry judged by PostgreSQL's clock, read by the lookup's query (`looked_up_at`): by this pod's own
    # (`ApiKey.is_usable`'s default), one 10 minutes behind let a key that had expired work 10 minutes more, and one
    # ahead refused a key with minutes left.
    api_key = (ApiKey.objects.select_related("organization", "created_by").filter(lookup=lookup)
               .annotate(looked_up_at=DatabaseClock()).first())
    if api_key is None or not tokens.token_matches(plain, api_key.digest) or not api_key.is_usable(api_key.looked_up_at):
        return None
    touch_api_key(api_key)
    return api_key


def authenticate_api_key(plain: str) -> ApiKey | None:
    """The key, if it is usable and its creator still belongs to its organisation (`/api/v1`).

    A malformed key, or one refused within `INFERPLANE_API_KEY_NEGATIVE_CACHE_S`, costs no query; raises
    `LookupsBusy` when other lookups hold every slot for longer than a caller may wait.
    """
    if tokens.split_token(plain, ApiKey.TOKEN_KIND) is None or API_KEY_LOOKUPS.is_refused(plain):
        return None
    digest = API_KEY_LOOKUPS.digest(plain)
    marked = False

    def known_elsewhere(digest: str) -> bool:
        nonlocal marked
        marked = API_KEYS_KNOWN.contains(digest)
        return marked

    with API_KEY_LOOKUPS.slot_for(plain, known_elsewhere=known_elsewhere):
        authenticated = authenticate_api_key_with_role(plain)
    if authenticated is None:
        # NOTE: only a key known here or marked has a mark to take away (a match or a mint sets one): deleting one for
        # every made-up key cost Redis a write each (with Redis away, a connect timeout holding a web thread)
        if marked or digest in API_KEY_LOOKUPS.known:
            API_KEYS_KNOWN.discard(digest)
        API_KEY_LOOKUPS.refuse(plain)
        return None
    API_KEY_LOOKUPS.know(plain, owner=authenticated[0].organization_id)  # never pushed out by another organisation's keys
    return authenticated[0]


def authenticate_api_key_with_role(plain: str) -> tuple[ApiKey, str] | None:
    """The key and its creator's current role, if it is usable and the creator still belongs to its organisation.

    NOTE: a key acts with its creator's role, so it dies with the creator's membership and
    a creator demoted to viewer demotes their keys.
    """
    api_key = find_api_key(plain)
    if api_key is None:
        return None
    role = creator_role(api_key)
    if role is None:
        return None
    digest = API_KEY_LOOKUPS.digest(plain)
    # NOTE: renewed at each match from every process, but once an hour on /api/v1 (`know`), not at each call
    if digest not in API_KEY_LOOKUPS.known:
        API_KEYS_KNOWN.add(digest, owner=api_key.organization_id)
    return api_key, role


def creator_role(api_key: ApiKey) -> str | None:
    """The role the key acts with: its creator's current one; None once the creator is inactive or gone
    from the key's organisation."""
    creator = api_key.created_by
    if creator is None or not creator.is_active:
        return None
    return Membership.objects.filter(organization_id=api_key.organization_id, user_id=creator.pk).values_list(
        "role", flat=True).first()


def touch_api_key(api_key: ApiKey) -> None:
    """Record the key's use, at most once per `LAST_USED_RESOLUTION`; a database refusing the write leaves it unrecorded.

    NOTE: a failover's demoted primary (or a full disk) serves reads and refuses writes, and the gateway goes on
    answering from what it reads, its usage going to the journal. The write raised instead, so every key looked up
    again (its cache lasts seconds) whose last use was over a minute old was refused for the rest of the outage. In a
    savepoint, so a caller's transaction goes on."""
    now = timezone.now()
    if api_key.last_used_at is None or now - api_key.last_used_at > LAST_USED_RESOLUTION:
        try:
            with transaction.atomic():
                ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=now)
        except DatabaseError as exc:
            logger.warning("API key %s: its last use is not recorded (%s)", api_key.pk, type(exc).__name__)
            return
        api_key.last_used_at = now
