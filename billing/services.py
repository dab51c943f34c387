"""Writes with side effects for billing settings: accounts, spend caps, billing mode, payment standing."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from celery.exceptions import SoftTimeLimitExceeded
from django.db import transaction
from django.db.models import Count, Exists, F, Max, OuterRef, Q, QuerySet
from django.db.models.functions import Coalesce
from django.utils import timezone

from billing import alerts, standing
from billing.models import (
    BILLED_METER_EVENT_NAME,
    SET_MODE_AUDIT_ACTION,
    WRITTEN_OFF_INVOICE_STATUS,
    ApiKeySpendCap,
    BillingAccount,
    BillingMode,
    CardHolding,
    DeletedStripeCustomer,
    Dispute,
    Invoice,
    MeterEventPush,
    UsageRecord,
    UsageRollup,
    VoidedInvoiceMark,
    voided_after_deletion,
    voided_in_deletions_second,
)
from billing.periods import current_period
from billing.quota.counters import refresh_limits
from controlplane import redis_keys
from controlplane.accounts import keys
from controlplane.accounts.members import NotPermitted
from controlplane.accounts.models import AuditEvent, Role, Scope, lock_organizations
from controlplane.accounts.organizations import (
    held_by_any,
    organizations_of_its_people,
    organizations_sharing,
    same_mailbox,
)
from controlplane.accounts.services import SYSTEM, Actor, record_audit
from controlplane.clock import DatabaseClock
from controlplane.redis_client import get_redis
from controlplane.tasks import send_task

logger = logging.getLogger(__name__)


def set_spend_cap(actor: Actor, organization, *, spend_cap: Decimal | None) -> BillingAccount:
    """Set (or with None remove) the organisation's monthly hard cap; the gateway sees it at once.

    Every change of an account's limits is marked `limits_stale` in its own transaction: a process
    killed between the commit and `refresh_limits` leaves it for the payment-standing beat task
    (`review_all_payment_standing`), not Redis with the old limits for the rest of the month.

    Raises `NotPermitted` where an API key with a cap of its own would raise or remove it."""
    with transaction.atomic():
        account = BillingAccount.objects.select_for_update().for_organization(organization)
        previous = account.spend_cap
        loosens = previous is not None and (spend_cap is None or spend_cap > previous)
        own_cap = _calling_keys_cap(actor)
        # NOTE: the organisation's cap bounds every key and session together; a key with a cap sets no key's cap above
        # its own and removes none, and the same key removed the organisation's (a review's finding).
        if loosens and own_cap is not None:
            raise NotPermitted("spend_cap", f"This key is capped at {_plain(own_cap.spend_cap)}: it may lower the "
                                            "organisation's spend cap, not raise or remove it. Do that signed in, or "
                                            "with a key without a spend cap.")
        account.spend_cap = spend_cap
        account.limits_stale = True  # NOTE: with the change, until `refresh_limits` has written it to Redis
        account.save(update_fields=["spend_cap", "limits_stale"])
        record_audit(actor, organization, "billing.set_spend_cap", account,
                     spend_cap=_plain(spend_cap), previous=_plain(previous))
    refresh_limits(account)
    return account


def set_key_spend_cap(actor: Actor, api_key, *, spend_cap: Decimal | None) -> ApiKeySpendCap | None:
    """Set (or with None remove) a key's monthly cap, and cap every live key it minted (and those minted in turn)
    at most at the same (`_cap_minted_keys`); marked `limits_stale` with it, so the refresh (now, or the beat task's
    after a process killed meanwhile) writes every key's cap of the organisation.

    Raises `NotPermitted` where the actor may not (`ensure_may_set_key_spend_cap`)."""
    with transaction.atomic():
        # NOTE: the organisation's row first, as minting a key takes it (`keys.create_api_key`): a key this key mints
        # meanwhile is committed before the walk of its minted keys reads them, or its minting reads this cap
        # (`inherit_key_spend_cap`), never neither.
        lock_organizations([api_key.organization_id])
        account = BillingAccount.objects.select_for_update().for_organization(api_key.organization_id)
        current = ApiKeySpendCap.objects.filter(api_key=api_key).first()  # NOTE: read under the account's lock
        roles = keys.member_roles(api_key.organization)
        ensure_may_set_key_spend_cap(actor, api_key, current=current, spend_cap=spend_cap, roles=roles)
        if spend_cap is None:
            ApiKeySpendCap.objects.filter(api_key=api_key).delete()
            cap = None
        else:
            cap, _ = ApiKeySpendCap.objects.update_or_create(api_key=api_key, defaults={
                "spend_cap": spend_cap, "set_by_id": _cap_setter(current, actor.user.pk if actor.user else None, roles)})
            _cap_minted_keys(actor, api_key, cap, roles=roles)
        account.limits_stale = True
        account.save(update_fields=["limits_stale"])
        record_audit(actor, api_key.organization, "billing.set_key_spend_cap", api_key, spend_cap=_plain(spend_cap))
    refresh_limits(account)
    return cap


def ensure_may_set_key_spend_cap(actor: Actor, api_key, *, current: ApiKeySpendCap | None,
                                 spend_cap: Decimal | None, roles: dict[int, str]) -> None:
    """Who may set a key's cap: whoever may revoke it (`keys.may_revoke_api_key`: an admin not an owner's key);
    only an owner may raise or remove a cap an owner set; and a key with a cap may set no key's cap above its own.

    NOTE: a cap of 0 stops a key as revoking it does, and lifting a cap gives a key what its owner held back:
    each was a way round the rule that an admin may not revoke an owner's key.

    NOTE: a cap bounds its key (and the keys that key mints), not the person who made it: an admin whose key an owner
    capped may create another key when signed in, uncapped, as any admin may (README, "Roles on keys"). Bounding a
    person would take a cap of their own, across their keys and their playground; their role (viewer) or the
    organisation's cap bounds them now.
    """
    if actor.user is None:
        return
    actor_role = roles.get(actor.user.pk)
    if not keys.may_revoke_api_key(actor, api_key, actor_role=actor_role, creator_role=roles.get(api_key.created_by_id)):
        raise NotPermitted("spend_cap", "Only owners may set the spend cap of an owner's key.")
    loosens = current is not None and (spend_cap is None or spend_cap > current.spend_cap)
    if loosens and actor_role != Role.OWNER and roles.get(current.set_by_id) == Role.OWNER:
        raise NotPermitted("spend_cap", f"An owner capped this key at {_plain(current.spend_cap)}: only owners may "
                                        "raise or remove that cap.")
    own_cap = _calling_keys_cap(actor)
    if own_cap is not None and (spend_cap is None or spend_cap > own_cap.spend_cap):
        raise NotPermitted("spend_cap", f"This key is capped at {_plain(own_cap.spend_cap)}: it may set no key's cap "
                                        "above that, nor remove one.")


def _cap_minted_keys(actor: Actor, api_key, cap: ApiKeySpendCap, *, roles: dict[int, str]) -> None:
    """Every live key `api_key` minted, and every one those minted, capped at most at `cap` (a lower cap of its own
    stays), as `inherit_key_spend_cap` caps the keys it mints from now on; one audit event each.

    NOTE: "a key's cap bounds that key and the keys it mints", and a cap of 0 stops a key as revoking does; but the
    cap was copied only when a key was minted, so capping a leaked key left the keys minted with it before spending
    as before (a review's finding). Each key's cap is its own: a key that runs inference, minted before its parent was
    capped, may spend as much again (`inherit_key_spend_cap` refuses such keys to a capped key from now on). Raising or
    removing `api_key`'s cap later leaves theirs as they are."""
    for children in keys.minted_generations(api_key):
        caps = {own.api_key_id: own for own in ApiKeySpendCap.objects.filter(api_key__in=children)}
        for child in children:
            current = caps.get(child.pk)
            if child.revoked_at is not None or (current is not None and current.spend_cap <= cap.spend_cap):
                continue
            ApiKeySpendCap.objects.update_or_create(api_key=child, defaults={
                "spend_cap": cap.spend_cap, "set_by_id": _cap_setter(current, cap.set_by_id, roles)})
            record_audit(actor, api_key.organization, "billing.set_key_spend_cap", child, spend_cap=_plain(cap.spend_cap),
                         reason="minted by a capped key", minted_by=child.minted_by_id)


def _calling_keys_cap(actor: Actor) -> ApiKeySpendCap | None:
    """The spend cap of the API key the actor calls with (None: a session, the platform, or a key without one)."""
    return ApiKeySpendCap.objects.filter(api_key_id=actor.api_key.pk).first() if actor.api_key is not None else None


def _cap_setter(current: ApiKeySpendCap | None, setter_id: int | None, roles: dict[int, str]) -> int | None:
    """Who a key's cap counts as set by once `setter_id` sets it: an owner's cap stays the owner's when anyone else
    changes it (whom `ensure_may_set_key_spend_cap` lets only tighten it, the platform aside).

    NOTE: `set_by` decides who may raise or remove the cap. An admin who lowered an owner's $5.00 cap to $4.99 became
    its setter and then removed it, two steps past the rule that only an owner lifts an owner's cap (a review's
    finding)."""
    if current is not None and roles.get(current.set_by_id) == Role.OWNER and roles.get(setter_id) != Role.OWNER:
        return current.set_by_id
    return setter_id


def inherit_key_spend_cap(sender, *, api_key, minting_key, **kwargs) -> None:
    """A key minted by a key with a spend cap gets the same cap (`keys.api_key_created`, in its transaction)."""
    if minting_key is None:
        return
    own_cap = ApiKeySpendCap.objects.filter(api_key=minting_key).first()
    if own_cap is None:
        return
    # NOTE: a key's spend is counted per key: a child given its parent's cap starts the month with nothing spent, so a
    # capped key that had spent its cap minted a child and spent as much again, and so on, up to the organisation's
    # own cap or credit (a review's finding). A capped key creates keys that do not infer.
    if Scope.INFERENCE in api_key.scopes:
        raise NotPermitted("scopes", f"A key with a spend cap ({_plain(own_cap.spend_cap)}) may not create keys that run "
                                     "inference: each would have a cap of its own, and together they could spend past "
                                     "it. Create inference keys in the console, or with a key without a spend cap.")
    account = BillingAccount.objects.select_for_update().for_organization(api_key.organization_id)
    ApiKeySpendCap.objects.create(api_key=api_key, spend_cap=own_cap.spend_cap, set_by_id=own_cap.set_by_id)
    account.limits_stale = True
    account.save(update_fields=["limits_stale"])
    refresh_limits(account)  # once the key's transaction commits


def set_billing_mode(actor: Actor, organization, *, mode: str) -> BillingAccount:
    """Switch between prepaid credit and monthly invoices, for the calls admitted from now on.

    NOTE: the gateway admits a call under the mode of its organisation's quota counter, which `refresh_limits`
    rewrites once this commits, and its usage row is billed in that mode whenever it is written
    (`billing.ledger.UsageReport.billing_mode`, through the usage journal too), and its settlement draws credit only
    if that mode is prepaid: every call is in exactly one billing path, prepaid rows drawing credit, postpaid rows
    metered to Stripe. A call admitted before the switch and ended after it keeps the mode it was admitted under. A
    journal's report that does not say its mode (written before reports carried it) is billed in the mode this
    switch's audit event says was in effect when the call started.
    """
    if mode not in BillingMode.values:
        raise ValueError(f"mode must be one of {BillingMode.values}")
    with transaction.atomic():
        account = BillingAccount.objects.select_for_update().for_organization(organization)
        previous = account.mode
        account.mode = mode
        account.limits_stale = True
        account.save(update_fields=["mode", "limits_stale"])
        record_audit(actor, organization, SET_MODE_AUDIT_ACTION, account, mode=mode, previous=previous)
        card_ceiling_changed([account.card_fingerprint], organization_id=account.organization_id)
        allowance_changed(account.organization_id)
    refresh_limits(account)
    return account


def set_invoiced_without_card(actor: Actor, organization, *, allowed: bool) -> BillingAccount:
    """Staff: let an organisation that pays by bank transfer spend without a payment method on file. Its standing is
    reviewed once this commits (`_review_can_pay_now_changed`): before, a hold that only the want of a card made was
    lifted at the beat task's next review, minutes later."""
    with transaction.atomic():
        account = BillingAccount.objects.select_for_update().for_organization(organization)
        account.invoiced_without_card = allowed
        account.limits_stale = True
        account.save(update_fields=["invoiced_without_card", "limits_stale"])
        record_audit(actor, organization, "billing.set_invoiced_without_card", account, allowed=allowed)
        card_ceiling_changed([account.card_fingerprint], organization_id=account.organization_id)
        allowance_changed(account.organization_id)
    return _review_can_pay_now_changed(account)


def set_spend_ceiling(actor: Actor, organization, *, ceiling: Decimal | None, lifted: bool = False) -> BillingAccount:
    """Staff: the organisation's monthly spending ceiling in place of the one its paid history gives
    (`billing.standing.spend_ceiling`): `ceiling` USD, or with `lifted` none at all; neither: its history's again.
    Audited, and the gateway sees it at once (`limits_stale` with it, for the beat task if the refresh is lost)."""
    if lifted and ceiling is not None:
        raise ValueError("a ceiling is either an amount or lifted, not both")
    with transaction.atomic():
        account = BillingAccount.objects.select_for_update().for_organization(organization)
        previous = _ceiling_text(account.staff_spend_ceiling, lifted=account.staff_lifted_spend_ceiling)
        account.staff_spend_ceiling = ceiling
        account.staff_lifted_spend_ceiling = lifted
        account.limits_stale = True
        account.save(update_fields=["staff_spend_ceiling", "staff_lifted_spend_ceiling", "limits_stale"])
        record_audit(actor, organization, "billing.set_spend_ceiling", account,
                     spend_ceiling=_ceiling_text(ceiling, lifted=lifted), previous=previous)
    refresh_limits(account)
    return account


def _ceiling_text(ceiling: Decimal | None, *, lifted: bool) -> str | None:
    """Staff's ceiling as audited: "none" (lifted), the amount (USD, two places), or None (its paid history's)."""
    return "none" if lifted else None if ceiling is None else f"{ceiling:.2f}"


def paid_history_changed(organization_id: int) -> None:
    """An invoice paid, a refund or a dispute changed what the organisation has paid (`billing.standing.net_paid`),
    so its spending ceiling may have: marked `limits_stale` in the change's own transaction, and its standing reviewed
    once that commits (which writes its limits to Redis). A process killed between the two leaves it to the beat task
    (`review_all_payment_standing`). The organisations of its card one of its owners owns too count its history
    (`billing.standing.trusted_history`): written again too (`card_ceiling_changed`)."""
    BillingAccount.objects.filter(organization_id=organization_id).update(limits_stale=True)
    transaction.on_commit(lambda: review_payment_standing(organization_id), robust=True)
    fingerprint = BillingAccount.objects.filter(organization_id=organization_id).values_list(
        "card_fingerprint", flat=True).first()
    card_ceiling_changed([fingerprint or ""], organization_id=organization_id)


def card_ceiling_changed(fingerprints: Collection[str], *, organization_id: int) -> None:
    """What the other organisations of these cards may spend changed with `organization_id`: it joined or left one,
    paid, or staff changed its billing mode or vouched for it. Once the change commits, the others of each card
    (`billing.standing.card_holders`) are marked `limits_stale` and written again (`refresh_cards`).

    NOTE: outside the change's transaction, which locks only its own account: two changes of one card's organisations
    (two invoices paid at once) each locked its own row and then the other's, and PostgreSQL killed one as a deadlock.
    A process killed after the commit leaves a shared card to the beat task (`refresh_shared_card_ceilings`)."""
    fingerprints = sorted({fingerprint for fingerprint in fingerprints if fingerprint})
    if fingerprints:
        transaction.on_commit(lambda: refresh_cards(fingerprints, but=organization_id), robust=True)


# The task that writes one card's organisations' limits again (`billing.tasks.refresh_card`), and how long its
# queued marker stops another being queued for the card (it is dropped as the task starts).
CARD_REFRESH_TASK = "billing.refresh_card"
CARD_REFRESH_QUEUED_S = 60


def membership_changed(sender, instance, **kwargs) -> None:
    """A membership was saved or deleted (Django's `post_save`, `post_delete` of `Membership`): who owns the
    organisation may have changed, and with it whose paid history counts on its card (`billing.standing.
    trusted_history`), so once that commits a worker writes the limits of every organisation of each card it held this
    month (its own too) again (`queue_card_refresh`). Before, the gateway kept the old ceiling (none, for an owner's
    second organisation) until the beat task.

    NOTE: queued, at most one a card at a time, not run here: run in the request, a no-op role change (the members
    API) rewrote every organisation of the card, a user's removal from K organisations of one card K × K, and with
    Redis away each held the request ~5-10 s an organisation (third review). A card it left this month counts too: its
    history may still count there (`card_holders`)."""
    organization_id, user_id = instance.organization_id, instance.user_id
    account = BillingAccount.objects.filter(organization_id=organization_id).first()
    current = account.card_fingerprint if account is not None else None
    left = CardHolding.objects.filter(organization_id=organization_id,
                                      last_seen_at__gte=current_period().start).values_list("fingerprint", flat=True)
    fingerprints = sorted({current, *left} - {"", None})
    if fingerprints:
        transaction.on_commit(lambda: queue_card_refresh(fingerprints), robust=True)
    if account is not None and standing.held_without_payment_method(account):
        # NOTE: an owner who comes or goes shares, or no longer shares, the organisation's spend without a payment
        # method with their own organisations (`billing.standing.spent_without_card_by_its_people`): theirs and its
        # limits are written again by a worker, as a card's are. One with a card shares its spend with nobody.
        transaction.on_commit(lambda: queue_allowance_refresh(organization_id, user_id), robust=True)


def queue_card_refresh(fingerprints: Collection[str]) -> None:
    """Queue `CARD_REFRESH_TASK` for each card that has none queued (a Redis marker, dropped as the task starts: a
    change committed after that queues another)."""
    redis = get_redis()
    for fingerprint in fingerprints:
        if redis.set(redis_keys.card_refresh_queued_key(fingerprint), 1, nx=True, ex=CARD_REFRESH_QUEUED_S):
            send_task(CARD_REFRESH_TASK, args=[fingerprint])


def refresh_card(fingerprint: str) -> int:
    """`CARD_REFRESH_TASK`: the card's queued marker dropped first, then its organisations' limits written again."""
    get_redis().delete(redis_keys.card_refresh_queued_key(fingerprint))
    return refresh_cards([fingerprint])


def refresh_cards(fingerprints: Collection[str], *, but: int | None = None) -> int:
    """Write again the limits of every organisation that held these cards this month (but `but`): the card's spend
    read once for all of them (`billing.standing.card_spend`). A Redis failure is logged and leaves the account
    `limits_stale` for the beat task. Returns how many were written."""
    num_written = 0
    for card in standing.card_spend(fingerprints).values():
        organization_ids = sorted(pk for pk in card.spend if pk != but)
        if not organization_ids:
            continue
        BillingAccount.objects.filter(organization_id__in=organization_ids).update(limits_stale=True)
        num_written += _write_card_limits(card, organization_ids)
    return num_written


def _write_card_limits(card: standing.CardSpend, organization_ids: Collection[int]) -> int:
    """Write these organisations' limits with their card's spend read once (`card`); how many."""
    accounts = list(BillingAccount.objects.filter(organization_id__in=organization_ids).order_by("pk"))
    for account in accounts:
        _refresh_quietly(account, card=card)
    return len(accounts)


# Cards read and written together by the beat task (`refresh_shared_card_ceilings`), and its time: under the task's
# soft time limit (`billing.tasks.refresh_card_ceilings`), whatever the number of cards and organisations.
CARDS_PER_BATCH = 50
CARD_REFRESH_BUDGET_S = 40.0


def refresh_shared_card_ceilings(*, budget_s: float = CARD_REFRESH_BUDGET_S) -> int:
    """Write again the limits of every organisation of a card held by more than one this month
    (`billing.standing.card_holders`): each one's room is its ceiling less what the others spent, read when its limits
    are written, so the others' spend since reaches the gateway here (the beat task `billing.refresh_card_ceilings`,
    every minute). Each card's spend is read once for its organisations, `CARDS_PER_BATCH` cards at a time, the
    cards in a random order and the run stopped after `budget_s` (checked before each card): a card of many
    organisations, or many cards, take turns, and none is left out run after run. NOTE: one card's organisations are
    written together, about 7 queries each, so a card of thousands outlasts the budget on its own. Returns how many limits were written."""
    period = current_period()
    held = standing.held_to_a_ceiling().exclude(card_fingerprint="")
    several = (held.values("card_fingerprint").annotate(num_accounts=Count("pk")).filter(num_accounts__gt=1)
               .values_list("card_fingerprint", flat=True))
    left = CardHolding.objects.filter(last_seen_at__gte=period.start).values_list("fingerprint", flat=True)
    candidates = sorted({*several, *left.distinct()})
    random.shuffle(candidates)
    deadline = time.monotonic() + budget_s
    num_written = 0
    for start in range(0, len(candidates), CARDS_PER_BATCH):
        for done, card in enumerate(standing.card_spend(candidates[start:start + CARDS_PER_BATCH], period).values()):
            if time.monotonic() >= deadline:  # NOTE: per card: a batch of large cards outlasted the soft time limit
                logger.warning("card ceilings: %s card(s) left to the next run", len(candidates) - start - done)
                return num_written
            if len(card.spend) < 2:
                continue
            num_written += _write_card_limits(card, card.spend)
    return num_written


def refresh_shared_allowances(*, budget_s: float = CARD_REFRESH_BUDGET_S) -> int:
    """Write again the limits of the organisations held to the limit without a payment method whose people's other
    organisations spent without one this month (`billing.standing.limit_without_payment_method`, shared): each one's
    room is the limit less what the others spent, read when its limits are written, so the others' spend since reaches
    the gateway here (the beat task `billing.refresh_shared_allowances`, every minute), as a card's does
    (`refresh_shared_card_ceilings`). The organisations that spent are taken in a random order and the run stopped
    after `budget_s` (checked before each), so none is left out run after run. Returns how many limits were written."""
    if not standing.limit_without_payment_method_applies():
        return 0
    period = current_period()
    spent = UsageRecord.objects.filter(organization_id=OuterRef("organization_id"), finished_at__gte=period.start,
                                       finished_at__lt=period.end)
    spenders = [account.organization_id for account in _without_payment_method().filter(Exists(spent))
                if standing.held_without_payment_method(account)]
    spenders = sorted(organizations_sharing(spenders))  # NOTE: most spend alone: nothing of theirs to write
    random.shuffle(spenders)
    deadline = time.monotonic() + budget_s
    written: set[int] = set()
    for done, organization_id in enumerate(spenders):
        if time.monotonic() >= deadline:
            logger.warning("shared allowances: %s organisation(s) left to the next run", len(spenders) - done)
            break
        written |= _write_allowance_limits(organizations_of_its_people(organization_id), but=written)
    return len(written)


def refresh_allowances(organization_id: int, user_id: int) -> int:
    """`ALLOWANCE_REFRESH_TASK`, after a change of the person's membership of the organisation: its queued marker
    dropped first, then the limits of the organisation, of every organisation the person owns or created
    (`held_by_any`, at any account of their mailbox: `same_mailbox`) and of its people's others now
    (`organizations_of_its_people`: a creator who left handed it on to its owners) that the limit without a payment
    method holds written again: whether they share the allowance changed with it. Returns how many were written."""
    get_redis().delete(redis_keys.allowance_refresh_queued_key(organization_id, user_id))
    people = same_mailbox([user_id])
    return len(_write_allowance_limits({organization_id, *held_by_any(people).values_list("pk", flat=True),
                                        *organizations_of_its_people(organization_id)}))


def allowance_changed(organization_id: int) -> None:
    """Whether the organisation's month counts for its people's other organisations' allowance without a payment
    method (`billing.standing.spent_without_card_by_its_people`: only while it has no card, is postpaid and not
    "invoiced without card") may have changed: once the change commits, their limits are written again. A process
    killed in between leaves a lowered room to the beat task (`refresh_shared_allowances`), a raised one to the
    organisations' next write of their limits."""
    transaction.on_commit(lambda: _write_allowance_limits(organizations_of_its_people(organization_id)), robust=True)


def _write_allowance_limits(organization_ids: Collection[int], *, but: Collection[int] = ()) -> set[int]:
    """Write the limits of those of these organisations (but `but`) the limit without a payment method holds; their
    ids."""
    written = set()
    accounts = BillingAccount.objects.filter(organization_id__in=set(organization_ids) - set(but)).order_by("pk")
    for account in accounts:
        if standing.held_without_payment_method(account):
            _refresh_quietly(account)
            written.add(account.organization_id)
    return written


def _without_payment_method() -> QuerySet:
    """The accounts `billing.standing.held_without_payment_method` may hold (but for Stripe's set-up)."""
    return BillingAccount.objects.filter(mode=BillingMode.POSTPAID, payment_method_on_file=False,
                                         invoiced_without_card=False)


# The task that writes again the limits of an organisation's people's organisations (`billing.tasks.
# refresh_allowances`), and how long its queued marker stops another being queued for the organisation.
ALLOWANCE_REFRESH_TASK = "billing.refresh_allowances"
ALLOWANCE_REFRESH_QUEUED_S = 60


def queue_allowance_refresh(organization_id: int, user_id: int) -> None:
    """Queue `ALLOWANCE_REFRESH_TASK` for the organisation and the person unless one is queued (a Redis marker, dropped
    as the task starts: a change committed after that queues another)."""
    redis = get_redis()
    if redis.set(redis_keys.allowance_refresh_queued_key(organization_id, user_id), 1, nx=True,
                 ex=ALLOWANCE_REFRESH_QUEUED_S):
        send_task(ALLOWANCE_REFRESH_TASK, args=[organization_id, user_id])


def record_payment_method(customer_id: str, *, on_file: bool, observed_ms: int,
                          card_fingerprint: str = "") -> BillingAccount | None:
    """Stripe's customer `customer_id`, read at `observed_ms`, has (or has not) a default payment method, a card
    of `card_fingerprint` (empty: none, or Link; a bank debit's: `standing.card_fingerprint`); a reading older than the one recorded changes nothing. The gateway sees
    a change at once, and its hold too: the organisation's standing is reviewed then (`review_payment_standing`), as a
    card decides whether an invoice its deleted customer left unpaid holds it (`billing.standing.can_pay_now`).
    Before, a held organisation that added a card was refused until the beat task's next review, minutes later. A
    card of another fingerprint moves it to that card's ceiling, and the organisations of both cards have their
    limits written again (`card_ceiling_changed`).

    NOTE: a reading with no payment method keeps the fingerprint: the organisation stays with the card it last had,
    so removing a card (or deleting the customer) frees none of the card's ceiling for its other organisations; one
    that moves to another card, or to a method that is not a card, leaves its month's spend counted on the card it
    left (`CardHolding`)."""
    with transaction.atomic():
        account = BillingAccount.objects.select_for_update().filter(stripe_customer_id=customer_id).first()
        if account is None or account.payment_method_observed_ms >= observed_ms:
            return account
        # NOTE: a customer never read before was not limited (`billing.standing`): its limits change too.
        flipped = account.payment_method_on_file != on_file
        fingerprint = card_fingerprint if on_file else account.card_fingerprint
        previous_fingerprint = account.card_fingerprint
        moved = fingerprint != previous_fingerprint
        changed = flipped or moved or not account.payment_method_observed_ms
        account.payment_method_on_file = on_file
        account.payment_method_observed_ms = observed_ms
        account.card_fingerprint = fingerprint
        account.limits_stale = account.limits_stale or changed
        account.save(update_fields=["payment_method_on_file", "payment_method_observed_ms", "card_fingerprint",
                                    "limits_stale"])
        if flipped or moved:
            record_audit(SYSTEM, account.organization, "billing.payment_method", account, on_file=on_file,
                         card_changed=moved)
        if moved:
            _record_card_holding(account.organization_id, left=previous_fingerprint, joined=fingerprint)
            card_ceiling_changed([previous_fingerprint, fingerprint], organization_id=account.organization_id)
        if changed:
            allowance_changed(account.organization_id)
    if changed:
        account = _review_can_pay_now_changed(account)
    return account


def _review_can_pay_now_changed(account: BillingAccount) -> BillingAccount:
    """`review_payment_standing` once a change of what `billing.standing.can_pay_now` reads (a card on file, or staff's
    "invoiced without card") is committed: it decides whether an invoice a deleted customer left unpaid holds the
    organisation, so the hold is lifted or put back at once, not at the beat task's next review.

    NOTE: after the commit (at once outside a transaction; inside one, such as the Django admin's, when it commits),
    from the rows as they are then: the same whatever order the changes come in, and reviewing twice changes nothing."""
    if transaction.get_connection().in_atomic_block:
        transaction.on_commit(lambda: _review_quietly(account), robust=True)
        return account
    return _review_quietly(account)


def record_subscription_ended(subscription_id: str) -> BillingAccount | None:
    """Stripe ended the subscription `subscription_id` (cancelled, or expired before its first payment):
    the account billed through it forgets it, and its next push subscribes it again
    (`stripe_sync.ensure_subscription`, from where this one's invoices stopped). Before, usage went on being pushed
    to a customer nothing billed, silently.

    NOTE: an ended subscription never comes back, so this is safe in any order: it clears only the
    subscription it names, never a newer one stored since. The account's Stripe key generation moves
    on, so that the next creation is not answered with this one (`stripe_sync.IdempotencyKey`).
    """
    with transaction.atomic():
        account = BillingAccount.objects.select_for_update().filter(stripe_subscription_id=subscription_id).first()
        if account is None:
            return None
        account.stripe_subscription_id = ""
        account.stripe_subscription_started_at = None
        # NOTE: with it: a run cancelling it after the close held pushes back until now (`billing.closed_subscriptions`)
        account.subscription_ending_at = None
        account.stripe_key_generation += 1
        account.save(update_fields=["stripe_subscription_id", "stripe_subscription_started_at", "subscription_ending_at",
                                    "stripe_key_generation"])
        record_audit(SYSTEM, account.organization, "billing.subscription_ended", account, subscription=subscription_id)
    return account


def record_customer_deleted(customer_id: str, *, invoiced_until: datetime | None = None,
                            billed_periods: Sequence[tuple[int, int, int | None, str]] | None = None,
                            written_off: Sequence[str] = (),
                            voided_in_its_second: Sequence[tuple[str, int, int]] = (),
                            deleted_at: datetime | None = None) -> BillingAccount | None:
    """Stripe's customer `customer_id` was deleted (its subscriptions end with it): the account forgets
    both, has no payment method from now (`billing.standing`: the limit without one applies, at once in
    the gateway), and its next push or portal link makes a new customer. Before, usage was pushed to
    a customer that no longer existed, and a card on file that went with it still lifted the limit.

    The usage pushed to it that its invoices did not bill goes again, to the next customer (`push_again`): Stripe
    cancels the subscriptions of a deleted customer without a final invoice, and drops the events sent to it since.
    What its invoices settle is known by those mirrored and by `invoiced_until`, the end of the latest one Stripe
    has finalised or that staff wrote off (`written_off`: voided before the deletion), with what each finalised one
    billed (`billed_periods`; None: not read), all as read before (`stripe_sync.deleted_customer_invoices`): an
    invoice's webhook may come after the deletion's, and the usage it billed, pushed again, was billed twice. The usage
    of an invoice voided after the deletion, told before it, goes again too (`push_again_voided`). `deleted_at` is Stripe's time
    of the deletion (its event's `created`; now if none), the clock that dates its invoices' failures
    (`billing.standing`), their voids and the receipt of meter events. Audited with the write-offs it kept and its
    decisions on the events Stripe received in its own second (`_pushed_uninvoiced`). The usage that Stripe's records
    cannot place, of an invoice voided in the deletion's own second (`voided_in_its_second`, as read, and those
    mirrored) or of that second's events, is held for an operator (`hold_for_operator`), never sent again nor
    written off by rule.

    NOTE: a deleted customer never comes back: safe in any order, and only for the customer it names.
    """
    with transaction.atomic():
        account = BillingAccount.objects.select_for_update().filter(stripe_customer_id=customer_id).first()
        if account is None:
            return None
        # NOTE: with its organisation and what its invoices bill, in the transaction that forgets it: an invoice's
        # webhook that comes after this is mirrored to the organisation, and a push that sent usage to it meanwhile
        # decides by it (`push_again_uninvoiced`).
        deleted, _ = DeletedStripeCustomer.objects.get_or_create(stripe_customer_id=customer_id, defaults={
            "organization_id": account.organization_id, "invoiced_until": invoiced_until,
            "billed_periods": [list(period) for period in billed_periods or ()],
            "deleted_at": deleted_at or timezone.now()})
        uninvoiced = _pushed_uninvoiced(account.organization_id, customer_id, deleted)
        undecided = _not_again(uninvoiced, uninvoiced.undecided_in_its_second)
        num_again = push_again(uninvoiced.rollups)
        num_held = hold_for_operator(account, undecided, customer_id=customer_id, invoice="",
                                     reason=f"events of {customer_id}'s deletion's second its invoices cannot place")
        held_invoices = []
        if billed_periods is not None:
            voided = Invoice.objects.filter(organization_id=account.organization_id, stripe_customer_id=customer_id,
                                            period_start__isnull=False, period_end__isnull=False,
                                            status=WRITTEN_OFF_INVOICE_STATUS)
            # NOTE: the read came before this transaction: an invoice it saw billing may be void by now (staff voided
            # it after the read, and its void's webhook came first). Its period is billed by no invoice: before, it
            # counted as billed as read, and its usage was billed by no customer (a review's finding).
            void_ids = set(voided.values_list("stripe_invoice_id", flat=True))
            billed = [(_epoch(period[0]), _epoch(period[1])) for period in deleted.billed_periods
                      if period[3:4] == [] or period[3] not in void_ids]
            # NOTE: voided after the deletion: a later second on Stripe's clock, or one the read (after the deletion)
            # saw not void. One whose void's webhook came before this was taken for a write-off (the deletion not
            # known yet): its usage goes again now, unless another of its invoices bills it; the write-off overruled.
            voided_after = voided.filter(Q(voided_at__gt=deleted.deleted_at)
                                         | Q(stripe_invoice_id__in=deleted.billing_invoice_ids))
            for invoice in voided_after:
                num_again += _push_again_voided_period(account, invoice, billed)
            # NOTE: one voided in its second, as read now (after the deletion) or mirrored, that nothing orders: held,
            # not written off. The read is Stripe's word: a void mirrored without its time (before `billing/0024`)
            # that it dates earlier is a write-off.
            in_its_second = {invoice.stripe_invoice_id: (invoice.period_start, invoice.period_end)
                             for invoice in voided.voided_in_deletions_second(deleted.deleted_at)
                             .exclude(stripe_invoice_id__in=written_off)
                             .exclude(stripe_invoice_id__in=deleted.billing_invoice_ids)}
            in_its_second |= {invoice_id: (_epoch(start), _epoch(end)) for invoice_id, start, end in voided_in_its_second}
            for invoice_id, (start, end) in sorted(in_its_second.items()):
                if _hold_voided_period(account, invoice_id, customer_id, start, end, billed):
                    held_invoices.append(invoice_id)
        account.stripe_customer_id = ""
        account.stripe_subscription_id = ""
        account.stripe_subscription_started_at = None
        account.subscription_ending_at = None  # NOTE: no subscription left to end (`record_subscription_ended`)
        account.payment_method_on_file = False
        account.payment_method_observed_ms = 0  # no customer: the limit without a payment method applies
        account.stripe_key_generation += 1
        account.limits_stale = True
        account.save(update_fields=["stripe_customer_id", "stripe_subscription_id", "stripe_subscription_started_at",
                                    "subscription_ending_at", "payment_method_on_file",
                                    "payment_method_observed_ms", "stripe_key_generation", "limits_stale"])
        record_audit(SYSTEM, account.organization, "billing.customer_deleted", account, customer=customer_id,
                     num_rollups_pushed_again=num_again, invoices_written_off=list(written_off),
                     num_events_dropped_in_its_second=len(uninvoiced.dropped_in_its_second),
                     num_events_undecided_in_its_second=len(uninvoiced.undecided_in_its_second),
                     num_rollups_held=num_held, invoices_held=held_invoices)
    _refresh_quietly(account)
    return account


@dataclass(slots=True, frozen=True)
class _Uninvoiced:
    """What `_pushed_uninvoiced` found: the rollups to push again, and which events of the deletion's own second it
    found dropped, and could not place (held for an operator: `hold_for_operator`)."""

    rollups: QuerySet
    dropped_in_its_second: list[int]  # the ids of the billed meter's events (`MeterEventPush`)
    undecided_in_its_second: list[int]  # the same, of events neither known billed nor known dropped


def _not_again(uninvoiced: _Uninvoiced, event_ids: list[int]) -> QuerySet:
    """The rollups of the events `event_ids`, of their push generation (one pushed again since is the next customer's),
    that `uninvoiced` does not push again (its rollups, read now: pushed again, their events are of an older
    generation)."""
    again = list(uninvoiced.rollups.values_list("pk", flat=True))
    return UsageRollup.objects.filter(meter_events__pk__in=event_ids,
                                      meter_events__push_generation=F("push_generation")).exclude(pk__in=again).distinct()


def _pushed_uninvoiced(organization_id: int, customer_id: str, deleted: DeletedStripeCustomer) -> _Uninvoiced:
    """The organisation's postpaid rollups with an event of their push generation that went to `customer_id` (or,
    recorded before the customer was kept, `billing/0017`, to whichever it had then), `deleted`, dated after every
    invoice of it that settles its period: bills it (`Invoice.objects.billing()`: finalised, not void) or was written
    off (void before the deletion: `Invoice.objects.written_off`), mirrored or up to `deleted.invoiced_until`; or that
    Stripe received after the deletion (Stripe dropped it): those no invoice bills whole.

    NOTE: both clocks are Stripe's, in seconds (`MeterEventPush.stripe_created_at`, the deletion event's `created`).
    Before, an event a push sent after the deletion, dated within the period of an invoice the deletion finalised (an
    event is dated up to `stripe_sync.LATEST_PERIOD_GRACE` back), counted as billed by it, and was billed by none. One
    received in the deletion's own second is on the side its invoice says (`_dropped_in_its_second`); one whose receipt
    is not known (refused as a duplicate of an earlier try) counts as received before it: its invoices decide, so that
    nothing is billed twice; one of that second that the invoices cannot place is not pushed again here, but held for
    an operator by the caller (`undecided_in_its_second`)."""
    deleted_at = deleted.deleted_at
    events = _events_sent_to(organization_id, customer_id)
    dropped, undecided = _dropped_in_its_second(organization_id, customer_id, deleted)
    after_deletion = Q(stripe_created_at__gt=deleted_at) | Q(pk__in=dropped)
    mirrored = Invoice.objects.filter(organization_id=organization_id)
    settled = mirrored.billing() | mirrored.filter(stripe_customer_id=customer_id).written_off(deleted_at)
    mirrored_until = settled.aggregate(until=Max("period_end"))["until"]
    invoiced_until = max((until for until in (mirrored_until, deleted.invoiced_until) if until is not None), default=None)
    if invoiced_until is not None:
        events = events.filter(Q(event_at__gte=invoiced_until)
                               | Q(event_at__isnull=True, rollup__hour_start__gte=invoiced_until) | after_deletion)
    return _Uninvoiced(UsageRollup.objects.filter(pk__in=events.values("rollup_id")), dropped, undecided)


def _dropped_in_its_second(organization_id: int, customer_id: str,
                           deleted: DeletedStripeCustomer) -> tuple[list[int], list[int]]:
    """The ids of the billed meter's events (`billing.models.BILLED_METER_EVENT_NAME`) sent to `customer_id` that
    Stripe received in the second of its deletion but after it (dropped), and those of that second it cannot place.

    Stripe's clock says only the second; its invoices of the customer, final once it is deleted (the deletion
    finalises the drafts), say which: each one's `quantity` (`DeletedStripeCustomer.billed_periods`) is what Stripe
    received before the deletion of the events dated in its period. What it lacks of those sent, less those received a
    later second, was dropped in the deletion's own second: the last of that second's events, as they are sent one at a
    time and recorded in order (a push run at a time: `stripe_sync.push_pending_rollups`), whose values (never 0) add
    up to it; none when it lacks nothing. Where no such last events add up to it (an event not yet recorded, or two
    pushes at once), or the quantity is not known (None: `billing.stripe_sync.usage_quantity`), or what it lacks may be of
    an event whose receipt is not known (a duplicate's refusal), that second's events of the period are undecided:
    held for an operator (`hold_for_operator`): neither sent again by rule (billed twice if Stripe billed them) nor
    counted as received before the deletion (before, one Stripe had dropped was billed by no customer)."""
    dropped, undecided = [], []
    for start, end, quantity, *_ in deleted.billed_periods:
        in_period = MeterEventPush.objects.filter(
            rollup__organization_id=organization_id, stripe_customer_id=customer_id,
            event_name=BILLED_METER_EVENT_NAME).filter(_dated_within(_epoch(start), _epoch(end)))
        sent = list(in_period.order_by("pk").values_list("pk", "value", "stripe_created_at"))
        of_its_second = [(pk, value) for pk, value, received_at in sent if received_at == deleted.deleted_at]
        if not of_its_second:
            continue
        num_missing = None if quantity is None else (
            sum(value for _, value, _ in sent) - quantity
            - sum(value for _, value, received_at in sent if received_at is not None and received_at > deleted.deleted_at))
        if num_missing and any(received_at is None for _, _, received_at in sent):
            num_missing = None  # NOTE: part of what it lacks may be an event whose receipt is not known
        last = _last_adding_up_to(of_its_second, num_missing)
        if last is None:
            logger.warning("%d meter events sent to the deleted customer %s in its deletion's second cannot be placed "
                           "by its invoice's quantity (%s of %s): held for an operator", len(of_its_second),
                           customer_id, quantity, sum(value for _, value, _ in sent))
            undecided += [pk for pk, _ in of_its_second]
        else:
            dropped += [pk for pk, _ in last]
    return dropped, undecided


def _last_adding_up_to(events: list[tuple[int, int]], total: int | None) -> list[tuple[int, int]] | None:
    """The last of `events` (id, value) whose values add up to `total` (none for 0); None if no such run ends them."""
    if total is None or total < 0:
        return None
    added = 0
    for index in range(len(events), -1, -1):
        if added == total:
            return events[index:]
        if index:
            added += events[index - 1][1]
    return None


def _epoch(seconds: int) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def _events_sent_to(organization_id: int, customer_id: str):
    """The events of the organisation's postpaid rollups, of their push generation, that went to `customer_id` (or,
    recorded before the customer was kept, `billing/0017`, to whichever it had then)."""
    return MeterEventPush.objects.filter(
        Q(stripe_customer_id=customer_id) | Q(stripe_customer_id=""), rollup__organization_id=organization_id,
        rollup__billing_mode=BillingMode.POSTPAID, push_generation=F("rollup__push_generation"))


def _dated_within(start: datetime, end: datetime) -> Q:
    """Meter events dated in [start, end) (by their rollup's hour, for those recorded before their date was kept)."""
    return (Q(event_at__gte=start, event_at__lt=end)
            | Q(event_at__isnull=True, rollup__hour_start__gte=start, rollup__hour_start__lt=end))


# A live customer's void invoice, forgiven (`push_again_voided`): one audit event per invoice.
WRITTEN_OFF_AUDIT_ACTION = "billing.voided_invoice_written_off"


def push_again_voided(invoice: Invoice, *, billed_periods: list[tuple[datetime, datetime]] | None) -> int:
    """Stripe voided `invoice`. After its customer's deletion (`DeletedStripeCustomer`, by Stripe's clock:
    `billing.models.voided_after_deletion`): `push_again` the rollups whose events went to that customer dated in its
    period, unless another of its invoices bills them (`billed_periods`, as Stripe lists them:
    `stripe_sync.customer_billed_periods`): their usage goes to the organisation's customer of now, under new
    identifiers; audited. While its customer was live (any of its subscriptions; deleted since or not): written off,
    its usage forgiven (`billing.models.WRITTEN_OFF_INVOICE_STATUS`), audited once, nothing pushed again. Before, a
    write-off whose customer was deleted since, its void told after the deletion, went again. Voided in the deletion's
    own second (`billing.models.voided_in_deletions_second`: Stripe's clock cannot order the two): after it if the
    deletion's read of the invoices, made after it, saw this one not void (`DeletedStripeCustomer.billing_invoice_ids`);
    else held for an operator (`_hold_voided_period`; before, written off by rule, and a void after the deletion left
    its usage billed by nobody). Returns how many rollups went again.

    NOTE: a deleted customer's void invoice is owed by nobody: before, the usage of one voided after the deletion was
    billed by no invoice. Only events of their rollup's push generation count: once pushed again, a rollup's events of
    the next generation are dated now, so the void told again (`invoice.voided`, `invoice.updated`) finds nothing more,
    and nothing is billed twice. Under the account's lock, as the deletion and a push's last check
    (`stripe_sync.push_rollup`)."""
    if (invoice.status != WRITTEN_OFF_INVOICE_STATUS or invoice.period_start is None
            or invoice.period_end is None):
        return 0
    with transaction.atomic():
        account = BillingAccount.objects.select_for_update().for_organization(invoice.organization_id)
        customer_id = invoice.stripe_customer_id or "-"
        deleted = DeletedStripeCustomer.objects.filter(stripe_customer_id=customer_id,
                                                       organization_id=invoice.organization_id).first()
        in_its_second = deleted is not None and voided_in_deletions_second(invoice.voided_at, deleted.deleted_at)
        # NOTE: the deletion's read of its invoices, made after it, saw this one not void: voided after it.
        voided_after = deleted is not None and (
            voided_after_deletion(invoice.voided_at, deleted.deleted_at)
            or (in_its_second and invoice.stripe_invoice_id in deleted.billing_invoice_ids))
        if not voided_after and not in_its_second:
            if VoidedInvoiceMark.mark(invoice.stripe_invoice_id, VoidedInvoiceMark.Kind.WRITTEN_OFF):
                record_audit(SYSTEM, account.organization, WRITTEN_OFF_AUDIT_ACTION, account,
                             invoice=invoice.stripe_invoice_id, customer=customer_id)
            return 0
        if billed_periods is None:
            return 0
        if not voided_after:
            _hold_voided_period(account, invoice.stripe_invoice_id, customer_id, invoice.period_start,
                                invoice.period_end, billed_periods)
            return 0
        return _push_again_voided_period(account, invoice, billed_periods)


def _was_written_off(invoice_id: str) -> bool:
    """Whether the void invoice `invoice_id` was taken for a live customer's write-off (`push_again_voided`)."""
    return VoidedInvoiceMark.objects.filter(stripe_invoice_id=invoice_id, kind=VoidedInvoiceMark.Kind.WRITTEN_OFF).exists()


def _push_again_voided_period(account: BillingAccount, invoice: Invoice,
                              billed_periods: Sequence[tuple[datetime, datetime]]) -> int:
    """`push_again` the rollups whose events went to the void `invoice`'s customer, deleted before the void, dated in
    its period and in none of `billed_periods`; audited. Under the account's lock."""
    num_again = push_again(_voided_period_rollups(account.organization_id, invoice.stripe_customer_id or "-",
                                                  invoice.period_start, invoice.period_end, billed_periods))
    if num_again:
        # NOTE: its void's webhook may have come before the deletion was recorded, and taken it for a write-off.
        record_audit(SYSTEM, account.organization, "billing.voided_invoice_pushed_again", account,
                     invoice=invoice.stripe_invoice_id, customer=invoice.stripe_customer_id or "-",
                     num_rollups_pushed_again=num_again,
                     write_off_overruled=_was_written_off(invoice.stripe_invoice_id))
    return num_again


def _voided_period_rollups(organization_id: int, customer_id: str, start: datetime, end: datetime,
                           billed_periods: Sequence[tuple[datetime, datetime]]) -> QuerySet:
    """The rollups whose events of their push generation went to `customer_id` dated in a void invoice's period
    [`start`, `end`) and in none of `billed_periods`: the usage that invoice alone settled."""
    events = _events_sent_to(organization_id, customer_id).filter(_dated_within(start, end))
    for billed_start, billed_end in billed_periods:
        events = events.exclude(_dated_within(billed_start, billed_end))
    return UsageRollup.objects.filter(pk__in=events.values("rollup_id"))


# Usage sent to a deleted customer that Stripe's records cannot say was billed: held for an operator.
HELD_AUDIT_ACTION = "billing.usage_held_for_operator"


def _hold_voided_period(account: BillingAccount, invoice_id: str, customer_id: str, start: datetime, end: datetime,
                        billed_periods: Sequence[tuple[datetime, datetime]]) -> int:
    """Hold for an operator the usage that the void invoice `invoice_id` of the deleted `customer_id` alone settled
    (`_voided_period_rollups`), its void in the deletion's own second (`billing.models.voided_in_deletions_second`):
    a write-off if voided before the deletion, billed by nobody if after. Once per invoice, however often its void is
    told (an operator's decision stands). Under the account's lock. Returns how many rollups it held."""
    if VoidedInvoiceMark.objects.filter(stripe_invoice_id=invoice_id, kind=VoidedInvoiceMark.Kind.HELD).exists():
        return 0
    num_held = hold_for_operator(account, _voided_period_rollups(account.organization_id, customer_id, start, end,
                                                                 billed_periods),
                                 customer_id=customer_id, invoice=invoice_id,
                                 reason=f"{invoice_id} of {customer_id} voided in its deletion's second: written off, "
                                        "or voided after (billed by nobody)?")
    if num_held:
        VoidedInvoiceMark.mark(invoice_id, VoidedInvoiceMark.Kind.HELD)
    return num_held


def hold_for_operator(account: BillingAccount, rollups, *, customer_id: str, invoice: str, reason: str) -> int:
    """Hold `rollups`, whose events went to `customer_id`, deleted since, where Stripe's records cannot say whether
    their usage was billed (or written off by staff) or not: neither sent again by rule (billed twice) nor left as
    billed (lost). Each is marked pushed and held (`push_held_at`, `push_error` says why): an ERROR log line, an audit
    event (`HELD_AUDIT_ACTION`) and the usage rollups' admin list (filter "push held at"), where a superuser sends it
    again (`send_held_again`) or keeps it (`keep_held`). Under the account's lock. Returns how many it held."""
    rollup_ids = list(rollups.filter(push_held_at__isnull=True).values_list("pk", flat=True))
    if not rollup_ids:
        return 0
    UsageRollup.objects.filter(pk__in=rollup_ids).update(
        pushed_at=Coalesce(F("pushed_at"), DatabaseClock()), push_held_at=DatabaseClock(), push_claimed_at=None,
        push_error=f"held for an operator: {reason}"[:300])
    logger.error("rollups %s held: %s; decide in the admin (usage rollups: send again, or keep)", rollup_ids, reason)
    record_audit(SYSTEM, account.organization, HELD_AUDIT_ACTION, account, customer=customer_id, invoice=invoice,
                 reason=reason, rollups=rollup_ids)
    return len(rollup_ids)


def _held_for_operator(rollups) -> QuerySet:
    """Those of `rollups` held by `hold_for_operator` (pushed and held; a push held before it is sent is not)."""
    return rollups.filter(push_held_at__isnull=False, pushed_at__isnull=False)


class WaitingForFinalInvoice(Exception):
    """Held usage that Stripe's own record decides once it finalises a draft (`decide_held_by_final_invoice`)."""


def send_held_again(actor: Actor, rollups) -> int:
    """Staff: the usage of these rollups held for an operator (`hold_for_operator`) was billed by none of the deleted
    customer's invoices (Stripe dropped it, or voided its invoice after the deletion): `push_again`, to the
    organisation's customer of now; audited. Returns how many.

    Raises `WaitingForFinalInvoice`, sending nothing, where some are dated in the period of a draft of that customer
    that Stripe still advances (its quantity not told yet): that draft, once final, may bill them, and they are decided
    by it. Before, sent again then, they were billed twice when it did.

    NOTE: a draft's quantity, once told, is never taken back: one found final here stays final; one finalised after
    this check decides its held rollups itself, and those are no longer held when `_decide_held` reads them."""
    waiting = _waiting_for_final_invoice(_held_for_operator(rollups))
    if waiting:
        raise WaitingForFinalInvoice(
            f"Rollups {waiting} are dated in a draft invoice of the deleted customer that Stripe has not finalised yet: "
            "it may bill them, and decides them itself when Stripe finalises it. Nothing was sent.")
    return _decide_held(actor, rollups, "billing.held_usage_pushed_again", push_again)


def _waiting_for_final_invoice(rollups) -> list[int]:
    """The ids of `rollups` with an event that went to a deleted customer dated in the period of its draft that Stripe
    still advances, its quantity not told yet (`DeletedStripeCustomer.billed_periods`: final false or not kept,
    quantity None), unless its mirrored `Invoice` is past draft."""
    waiting = set()
    for deleted in DeletedStripeCustomer.objects.filter(organization_id__in=rollups.values("organization_id")):
        past_draft = set(Invoice.objects.filter(stripe_invoice_id__in=deleted.billing_invoice_ids)
                         .exclude(status="draft").values_list("stripe_invoice_id", flat=True))
        for period in deleted.billed_periods:
            # NOTE: a draft mirrored past draft is final whatever this entry says (its finalisation handled before the
            # deletion was saved): waiting on it was waiting for ever. An entry kept before drafts were told apart
            # (four elements, no "final") with no quantity may be a draft: it waits too, unless mirrored past draft.
            maybe_draft = len(period) == 4 or (len(period) > 4 and not period[4])
            if maybe_draft and period[2] is None and period[3] not in past_draft:
                waiting |= set(_events_sent_to(deleted.organization_id, deleted.stripe_customer_id)
                               .filter(rollup__in=rollups).filter(_dated_within(_epoch(period[0]), _epoch(period[1])))
                               .values_list("rollup_id", flat=True))
    return sorted(waiting)


def keep_held(actor: Actor, rollups) -> int:
    """Staff: the usage of these rollups held for an operator (`hold_for_operator`) was billed by the deleted
    customer's invoice, or written off by staff: the hold is lifted and nothing is sent; audited. Returns how many."""
    return _decide_held(actor, rollups, "billing.held_usage_kept",
                        lambda held: held.update(push_held_at=None, push_error=""))


def _decide_held(actor: Actor, rollups, action: str, decide) -> int:
    """`decide` (held rollups → how many) those of `rollups` held for an operator, an organisation at a time under its
    account's lock (as the deletion and a push's last check); audited as `action`. Returns how many."""
    num_decided = 0
    for organization_id in sorted(set(_held_for_operator(rollups).values_list("organization_id", flat=True))):
        with transaction.atomic():
            account = BillingAccount.objects.select_for_update().for_organization(organization_id)
            rollup_ids = list(_held_for_operator(rollups.filter(organization_id=organization_id))
                              .values_list("pk", flat=True))
            num_decided += decide(UsageRollup.objects.filter(pk__in=rollup_ids))
            record_audit(actor, account.organization, action, account, rollups=rollup_ids)
    return num_decided


def decide_held_by_final_invoice(customer_id: str, invoice_id: str, quantity: int | None) -> int:
    """Stripe finalised the invoice `invoice_id` of the deleted `customer_id` after the deletion read it (a draft Stripe
    advances itself, which the deletion could not finalise): what it billed of the usage price, `quantity`
    (`stripe_sync.usage_quantity`), is final now. It is kept with the deletion (`DeletedStripeCustomer.billed_periods`),
    and the events of the deletion's second held for an operator for want of it (`hold_for_operator`) are decided by
    it as the deletion decides (`_dropped_in_its_second`): those Stripe dropped go again, those it billed are kept;
    audited as `billing.held_usage_decided`. Once: a quantity already known is never replaced. Under the account's
    lock. Returns how many rollups went again.

    With `quantity` None (what it billed cannot be told) the draft is only marked final: its held rollups stay held,
    for an operator to decide (`send_held_again`, `keep_held`), no longer refused as waiting on a draft."""
    organization_id = DeletedStripeCustomer.objects.filter(stripe_customer_id=customer_id).values_list(
        "organization_id", flat=True).first()
    if organization_id is None:
        return 0
    with transaction.atomic():
        account = BillingAccount.objects.select_for_update().for_organization(organization_id)
        deleted = DeletedStripeCustomer.objects.select_for_update().get(stripe_customer_id=customer_id)
        periods = [list(period) for period in deleted.billed_periods]
        unknown = [period for period in periods if period[3:4] == [invoice_id] and period[2] is None]
        if quantity is None:
            for period in unknown:
                period[4:5] = [True]  # final, its quantity not known: the operator decides
            if unknown:
                deleted.billed_periods = periods
                deleted.save(update_fields=["billed_periods"])
            return 0
        if not unknown:
            return 0
        for period in unknown:
            period[2:5] = [quantity, invoice_id, True]  # final now
        deleted.billed_periods = periods
        deleted.save(update_fields=["billed_periods"])
        dropped, undecided = _dropped_in_its_second(organization_id, customer_id, deleted)
        held_ids = [pk for audited in AuditEvent.objects.filter(action=HELD_AUDIT_ACTION, details__customer=customer_id,
                                                                 details__invoice="")
                    for pk in audited.details.get("rollups") or []]
        held = _held_for_operator(UsageRollup.objects.filter(pk__in=held_ids))
        again_ids = list(held.filter(meter_events__pk__in=dropped).values_list("pk", flat=True).distinct())
        kept_ids = list(held.exclude(pk__in=again_ids).exclude(meter_events__pk__in=undecided)
                        .values_list("pk", flat=True))
        num_again = push_again(UsageRollup.objects.filter(pk__in=again_ids))
        UsageRollup.objects.filter(pk__in=kept_ids).update(push_held_at=None, push_error="")
        if again_ids or kept_ids:
            record_audit(SYSTEM, account.organization, "billing.held_usage_decided", deleted, customer=customer_id,
                         invoice=invoice_id, quantity=quantity, rollups_pushed_again=sorted(again_ids),
                         rollups_kept=sorted(kept_ids))
    return num_again


def push_again_uninvoiced(rollups, customer_id: str) -> int:
    """`push_again` those of `rollups` whose events went to `customer_id`, deleted since, and that none of its
    invoices bills (as `record_customer_deleted` found them: `DeletedStripeCustomer.invoiced_until` and
    `billed_periods`, with those mirrored: `_pushed_uninvoiced`). For a push that sent its events before the deletion
    was recorded and found the customer gone once done (`stripe_sync.push_rollup`, under the account's lock, which the
    deletion takes too). Audited when it places events of the deletion's own second. Returns how many."""
    deleted = DeletedStripeCustomer.objects.filter(stripe_customer_id=customer_id).first()
    if deleted is None:  # forgotten by nothing we know of: what billed it is not known
        return push_again(rollups)
    uninvoiced = _pushed_uninvoiced(deleted.organization_id, customer_id, deleted)
    num_dropped = MeterEventPush.objects.filter(pk__in=uninvoiced.dropped_in_its_second, rollup__in=rollups).count()
    undecided = _not_again(uninvoiced, uninvoiced.undecided_in_its_second).filter(pk__in=rollups.values("pk"))
    num_again = push_again(rollups.filter(pk__in=uninvoiced.rollups.values("pk")))
    num_held = hold_for_operator(
        BillingAccount.objects.for_organization(deleted.organization_id), undecided, customer_id=customer_id,
        invoice="", reason=f"events of {customer_id}'s deletion's second its invoices cannot place")
    if num_dropped or num_held:
        record_audit(SYSTEM, deleted.organization, "billing.pushed_to_deleted_customer", deleted, customer=customer_id,
                     num_rollups_pushed_again=num_again, num_events_dropped_in_its_second=num_dropped,
                     num_events_undecided_in_its_second=len(uninvoiced.undecided_in_its_second),
                     num_rollups_held=num_held)
    return num_again


def push_again(rollups) -> int:
    """Push `rollups` again from the start, under their next push generation: new meter-event identifiers (Stripe
    would drop the old ones as duplicates), no clock or hold of a try made under the old ones (`stripe_sync`'s
    23 h hold is for an answer that never came to an identifier of its own). For usage whose events went to a
    customer deleted since; the next push sends it to the account's customer of then. Returns how many.

    NOTE: a "send the difference" begun on one (`stripe_sync.send_held_difference`) goes too: it completed the old
    generation's events, and kept, its values and customer would be enforced on a hold of the new one."""
    return rollups.update(push_generation=F("push_generation") + 1, pushed_at=None, push_claimed_at=None,
                          push_first_tried_at=None, push_held_at=None, push_error="", num_unknown_lines_failures=0,
                          difference_started_at=None, difference_pending=None)


def _record_card_holding(organization_id: int, *, left: str, joined: str) -> None:
    """The organisation left the card `left` now (if any) and holds `joined` (if any): `CardHolding`."""
    now = timezone.now()
    if left:
        CardHolding.objects.update_or_create(organization_id=organization_id, fingerprint=left,
                                             defaults={"last_seen_at": now})
    if joined:
        CardHolding.objects.get_or_create(organization_id=organization_id, fingerprint=joined,
                                          defaults={"first_seen_at": now, "last_seen_at": now})


def _refresh_quietly(account: BillingAccount, *, credit: bool = False, card: standing.CardSpend | None = None) -> None:
    """`refresh_limits` after a change that is already committed (and marked `limits_stale` with it): a
    Redis failure is logged, not raised; the payment-standing beat task refreshes the account again. Celery's soft
    time limit is raised (before, logged as a Redis failure, and the beat task ran on to the hard kill)."""
    try:
        refresh_limits(account, credit=credit, card=card)
    except SoftTimeLimitExceeded:
        raise
    except Exception:
        logger.exception("could not refresh the gateway's limits of organisation %s", account.organization_id)


def _review_quietly(account: BillingAccount) -> BillingAccount:
    """`review_payment_standing` after a change that is already committed: a failure is logged, not raised, and the
    limits refreshed all the same; the beat task reviews a held organisation, or one with a failed invoice, again."""
    try:
        return review_payment_standing(account.organization_id)
    except SoftTimeLimitExceeded:
        raise
    except Exception:
        logger.exception("could not review the payment standing of organisation %s", account.organization_id)
        _refresh_quietly(account)
        return account


def review_payment_standing(organization_id: int, *, now: datetime | None = None) -> BillingAccount:
    """Apply `billing.standing.hold` to the organisation: put on hold or released, audited, owners and admins
    told of a hold (and of what holds it, when that changes), and the gateway sees it at once. The gateway's
    limits are written on every review, so a refresh that failed is made good by the next (the beat task's,
    within minutes)."""
    with transaction.atomic():
        account = BillingAccount.objects.select_for_update().for_organization(organization_id)
        hold = standing.hold(organization_id, now)
        since, reason = (hold.since, hold.reason) if hold is not None else (None, "")
        previous = standing.hold_reason(account)
        changed = reason != previous
        if since != account.past_due_since or reason != account.hold_reason:
            account.past_due_since = since
            account.hold_reason = reason
            account.limits_stale = account.limits_stale or changed
            account.save(update_fields=["past_due_since", "hold_reason", "limits_stale"])
        if changed:
            record_audit(SYSTEM, account.organization, f"billing.{reason}" if reason else f"billing.{previous}_cleared",
                         account, since=since.isoformat() if since else None)
    _refresh_quietly(account)
    if changed and since is not None:
        try:
            alerts.send_hold(account)
        except Exception:  # the hold stands; the email is a courtesy
            logger.exception("could not email organisation %s about its hold", organization_id)
    return account


def review_all_payment_standing(*, now: datetime | None = None) -> int:
    """`review_payment_standing` for every organisation on hold, with an unpaid, failed invoice (a grace period
    ends with no webhook) or with a disputed payment (its webhook's review may have failed). Returns how many are
    on hold."""
    failed = Invoice.objects.filter(status__in=standing.UNPAID_STATUSES).filter(
        payment_failed_at__isnull=False).values_list("organization_id", flat=True)
    uncollectible = Invoice.objects.filter(status="uncollectible").values_list("organization_id", flat=True)
    disputed = Dispute.objects.filter(status__in=standing.HOLDING_DISPUTE_STATUSES, hold_lifted_at__isnull=True
                                      ).values_list("organization_id", flat=True)
    held = BillingAccount.objects.filter(past_due_since__isnull=False).values_list("organization_id", flat=True)
    on_hold = 0
    for organization_id in sorted({*failed, *uncollectible, *disputed, *held}):
        try:
            on_hold += review_payment_standing(organization_id, now=now).past_due_since is not None
        except Exception:
            logger.exception("payment standing review failed for organisation %s", organization_id)
    # Changes whose refresh failed or never ran (a process killed after its commit): caps, billing modes,
    # released holds, cards added or removed, credit granted (its Redis figure is dropped, rebuilt from the grants).
    for account in BillingAccount.objects.filter(limits_stale=True)[:500]:
        _refresh_quietly(account, credit=True)
    return on_hold


def lift_dispute_hold(actor: Actor, dispute: Dispute) -> Dispute:
    """Staff: the dispute is settled with its organisation (a lost one repaid, or an open one staff vouch for), so
    it stops nothing any more; audited, and the organisation reviewed at once. A dispute won needs no lifting."""
    with transaction.atomic():
        dispute = Dispute.objects.select_for_update().get(pk=dispute.pk)
        if dispute.hold_lifted_at is not None:
            return dispute
        dispute.hold_lifted_at = timezone.now()
        dispute.hold_lifted_by = actor.user
        dispute.save(update_fields=["hold_lifted_at", "hold_lifted_by", "updated_at"])
        record_audit(actor, dispute.organization, "billing.lift_dispute_hold", dispute, status=dispute.status,
                     amount=dispute.amount, currency=dispute.currency)
    review_payment_standing(dispute.organization_id)
    return dispute


def _plain(value: Decimal | None) -> str | None:
    return None if value is None else str(value)
