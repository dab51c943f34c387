"""Payment standing: how much an organisation may spend before it can pay, and when an unpaid invoice
stops it. The rules only; `billing.services.review_payment_standing` applies them, and the gateway
enforces them through the organisation's quota counter (`billing.quota.counters.limit_fields`).

On an installation that bills through Stripe (`STRIPE_SECRET_KEY` set):

- **Payment method.** A postpaid organisation whose Stripe customer has no default payment method
  spends at most `SPEND_LIMIT_WITHOUT_PAYMENT_METHOD` a month, whatever cap it sets itself: its usage is
  invoiced after the month, and nothing could collect it. Adding a card in the Customer Portal lifts the
  limit (Stripe's `customer.updated` webhook); removing it puts the limit back. Staff may mark an
  account that pays by bank transfer `invoiced_without_card`. Prepaid accounts spend only credit. The limit is a
  person's: what the other organisations of the organisation's people (its creator, and once handed on its owners:
  `organizations.holdings_of`) spent this month without a card
  counts against it (`limit_without_payment_method`, shared), or one mailbox had it once per organisation it made.
- **Past due.** An invoice whose payment failed and that is still unpaid `PAST_DUE_GRACE_DAYS` after
  the failure (Stripe retries meanwhile), or that Stripe marked uncollectible, stops every call of the
  organisation until it is paid or voided. Endpoints, keys and data stay; only inference stops. An
  invoice of a customer Stripe deleted since (`DeletedStripeCustomer`: its drafts finalised by the deletion)
  has no card to charge, and the organisation did not delete it: one that neither failed nor was marked
  uncollectible before the deletion stops the organisation only while the organisation has no way to pay now
  (`can_pay_now`). Otherwise it stays owed, shown on the billing page (`num_unpaid_invoices_without_card`), and
  paid from its page; it holds again if the card goes. One that failed or was uncollectible before the deletion
  holds as any other: deleting the customer and adding a new card does not pay it.
- **Disputed.** A payment disputed with the card's bank (a chargeback, or the inquiry before one) stops
  every call at once, while the dispute is open and after it is lost: a dispute leaves its invoice `paid`,
  so without this a stolen card ran a month, was disputed, and ran the next. A dispute won, an inquiry
  closed without a chargeback, or one prevented releases it; staff lift the hold of a lost one once it is
  settled (`billing.services.lift_dispute_hold`, audited).

- **Spending ceiling.** A postpaid organisation spends at most, a month, the ceiling its paid history gives
  (`SPEND_CEILINGS`: the total its paid invoices paid, less refunds and payments disputed and not won, `net_paid`),
  whatever cap it sets itself: a stolen or empty card added, the cap removed, ran our GPUs for a month and the grace
  period before anything stopped it. An invoice paid raises it at once (its webhook's review writes the limits
  again); a refund or a dispute lowers it. Staff may set an organisation's own (`staff_spend_ceiling`, or none).
  The upgrade gave those already spending past it a floor (`grandfathered_spend_ceiling`) that paying rises past.
  Prepaid accounts (credit bounds them) and those staff mark `invoiced_without_card` (staff vouch for them) are not
  held to it. Only money paid counts, not days since it was: a chargeback of it stops the organisation at once
  (`Disputed`) and takes it out of the paid total.
- **Spend is shared per card; history is not borrowed.** Organisations whose card has one fingerprint
  (`BillingAccount.card_fingerprint`, Stripe's mark of a card number, or of a bank debit's account) share its month: each may spend, of its own
  ceiling, what every other organisation that held the card this month (`card_spend`, `CardHolding`: leaving the card
  frees nothing) has not spent (`SpendCeiling.room`): before, a stolen card behind N sign-ups had N ceilings. The
  ceiling's amount comes from the paid history of the organisation and of those on its card with an active owner
  who owns it too (`trusted_history`), never from an unrelated tenant's payments: a thief adding a customer's card number
  inherits nothing. A ceiling staff set, and the upgrade's floor, stay the organisation's own. NOTE: what a tenant is
  shown (`standing`, the alerts) is its own: its own paid total and spend, the ceiling's amount and whether it is
  shared, never the others' figures, their number, or the room their spend leaves (from which it could read it).
  Where the gateway refuses it (at the room) tells it the others' spend in whole steps of the ceiling
  (`shared_room_step`: 5 %, at least $1); a tenant with a second sign-up on the card, moving the others' total a cent
  at a time, still reads it to the cent (README, Payment standing).

Without Stripe, nothing is invoiced, so no rule applies (caps and credit still do).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import ROUND_CEILING, ROUND_DOWN, Decimal

from django.conf import settings
from django.db.models import F, OuterRef, Subquery, Sum
from django.utils import timezone

from billing.ledger import organizations_period_spends
from billing.models import (
    BillingAccount,
    BillingMode,
    CardHolding,
    DeletedStripeCustomer,
    Dispute,
    Invoice,
    RefundedCharge,
)
from billing.periods import Period, current_period
from controlplane.accounts.models import Membership
from controlplane.accounts.organizations import allowance_windows_of_its_people
from controlplane.hot_settings import hot

# Invoice states that still owe money (Stripe's `status`).
UNPAID_STATUSES = ("open", "uncollectible")
# Dispute states that stop the organisation (Stripe's `status`): open (an inquiry, or a chargeback not decided
# yet) and lost. NOTE: a state not named (won, warning_closed, prevented, or one Stripe adds) stops nothing.
HOLDING_DISPUTE_STATUSES = ("warning_needs_response", "warning_under_review", "needs_response", "under_review", "lost")
# The gateway's refusal reasons for a hold (`billing.quota.counters.QuotaExceeded`).
PAST_DUE = "past_due"
DISPUTED = "disputed"
# The gateway's refusal reasons at a spend limit (`SpendLimit.reason`).
ORG_CAP = "org_cap"
PAYMENT_METHOD = "payment_method"
SPEND_CEILING = "spend_ceiling"  # the one its paid history gives
SPEND_CEILING_STAFF = "spend_ceiling_staff"  # one staff set: paying does not raise it
SPEND_LIMIT_REASONS = (ORG_CAP, PAYMENT_METHOD, SPEND_CEILING, SPEND_CEILING_STAFF)
# Where an organisation's spending ceiling comes from (`SpendCeiling.source`).
PAID_HISTORY = "paid_history"
GRANDFATHERED = "grandfathered"  # the upgrade's floor (`billing/0032`), above its paid history's for now
STAFF = "staff"
CENTS_PER_DOLLAR = 100
# A shared card's others' spend is counted in whole steps of the ceiling (`SpendCeiling.room`): 5 % of it, at least
# $1, so where the gateway refuses tells a tenant the others' spend to a step, never to the cent.
SHARED_ROOM_STEP_PERCENT = 5
SHARED_ROOM_MIN_STEP = Decimal(1)


@dataclass(slots=True, frozen=True)
class SpendLimit:
    """The most an organisation may spend this month (None: no limit) and why, as the gateway's
    refusal names it: `org_cap` (its own cap), `payment_method` (the limit without one), `spend_ceiling` (the
    ceiling its paid history gives) or `spend_ceiling_staff` (a ceiling staff set)."""

    cap: Decimal | None
    reason: str

    def __post_init__(self) -> None:
        if self.reason not in SPEND_LIMIT_REASONS:
            raise ValueError(f"not a spend limit reason: {self.reason}")


@dataclass(slots=True, frozen=True)
class SpendCeiling:
    """An organisation's monthly spending ceiling (`amount`, None: none), where it comes from (`PAID_HISTORY`,
    `GRANDFATHERED` or `STAFF`), what it has paid (`paid`: `net_paid`), and the paid total at which its history gives the next, higher one
    (`next_paid`, `next_amount`: None for none; `next_paid` None: paying raises it no more).

    `paid` is the paid history the amount comes from (`trusted_history`: its own and that of the organisations on its
    card with an owner who owns it too); `own_paid` the organisation's own. A card held this month by
    `num_other_organizations_on_card` others, which spent `spent_by_others` this month, shares its room with them.
    NOTE: staff's figures: a tenant is shown `own_paid`, `amount` and `is_shared` only (`standing`), never the others'
    number or spend, nor `paid`, which sums payments of organisations it may not see."""

    amount: Decimal | None
    source: str
    paid: Decimal
    next_paid: Decimal | None = None
    next_amount: Decimal | None = None
    num_other_organizations_on_card: int = 0
    spent_by_others: Decimal = Decimal(0)
    own_paid: Decimal | None = None  # None: `paid`

    def __post_init__(self) -> None:
        if self.source not in (PAID_HISTORY, GRANDFATHERED, STAFF):
            raise ValueError(f"not a spend ceiling source: {self.source}")
        if self.num_other_organizations_on_card < 0 or self.spent_by_others < 0:
            raise ValueError("a card's other organisations and their spend are never negative")

    @property
    def room(self) -> Decimal | None:
        """What the organisation itself may spend this month under it (None: no limit): a paid history's ceiling less
        what the card's other organisations spent, rounded up to a whole step (`shared_room_step`), never below zero;
        a ceiling staff set, or the upgrade's floor, is the organisation's own. NOTE: the gateway refuses at the room,
        so a tenant learns from where it is refused what the others spent; to the step, not the cent (before, a
        thief's probes read a customer's spend to the cent: refused at 76.56, admitted at 76.55, so it spent 23.45),
        unless it moves the others' total itself through a second sign-up on the card (README, Payment standing)."""
        if self.amount is None or self.source != PAID_HISTORY:
            return self.amount
        if not self.spent_by_others:
            return self.amount
        step = shared_room_step(self.amount)
        counted = (self.spent_by_others / step).to_integral_value(rounding=ROUND_CEILING) * step
        return max(self.amount - counted, Decimal(0))

    @property
    def is_shared(self) -> bool:
        """Whether other organisations held its card this month: their spend leaves it less (`room`)."""
        return self.num_other_organizations_on_card > 0

    @property
    def paid_by_itself(self) -> Decimal:
        return self.paid if self.own_paid is None else self.own_paid


def shared_room_step(amount: Decimal) -> Decimal:
    """The step in which a shared card's others' spend counts against a ceiling of `amount` (`SpendCeiling.room`):
    `SHARED_ROOM_STEP_PERCENT` of it in cents, at least `SHARED_ROOM_MIN_STEP`."""
    step = (amount * SHARED_ROOM_STEP_PERCENT / 100).quantize(Decimal("0.01"), rounding=ROUND_DOWN)
    return max(step, SHARED_ROOM_MIN_STEP)


def bills_through_stripe() -> bool:
    return bool(hot.STRIPE_SECRET_KEY)


def limit_without_payment_method_applies() -> bool:
    """Whether this installation limits accounts without a payment method at all."""
    return settings.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD > 0 and bills_through_stripe()


def held_without_payment_method(account: BillingAccount) -> bool:
    """Whether the limit without a payment method holds `account` (`limit_without_payment_method`)."""
    if not limit_without_payment_method_applies():
        return False
    if account.is_prepaid or account.payment_method_on_file or account.invoiced_without_card:
        return False
    # a customer made before payment standing, not yet asked (`stripe_sync.observe_payment_method`)
    return not (account.stripe_customer_id and not account.payment_method_observed_ms)


def limit_without_payment_method(account: BillingAccount, *, shared: bool = False,
                                 period: Period | None = None) -> Decimal | None:
    """The limit that applies to `account` for want of a payment method, or None; with `shared`, what it leaves the
    organisation in `period` (this month by default): the limit less what the other organisations of its people spent
    in it while held to it too (`spent_without_card_by_its_people`), never below zero. Where the gateway stops it.

    NOTE: the allowance is a person's, not an organisation's: each organisation a person made (up to
    `MAX_OWNED_ORGANIZATIONS`) had its own, 5 x the allowance a month for one verified mailbox. What a tenant is shown
    (`standing`, the alerts) is the limit itself, as a card's ceiling is (`shown_spend_limit`)."""
    if not held_without_payment_method(account):
        return None
    limit = settings.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD
    if not shared:
        return limit
    return max(limit - spent_without_card_by_its_people(account.organization_id, period), Decimal(0))


def spent_without_card_by_its_people(organization_id: int, period: Period | None = None) -> Decimal:
    """What the other organisations of the organisation's people (its creator, and once handed on its owners from then:
    `organizations.allowance_windows_of_its_people`, closed ones too) spent in `period` (this month by default), each
    in the part of it that was theirs, that the limit without a payment method holds now
    (`held_without_payment_method`): one grouped, indexed read of the ledger for all of them (one more for each
    handed on in `period`).

    NOTE: one that has a card now, is prepaid or invoiced without one spends its own way, and counts for nobody's
    allowance; removing the card counts its month again. The ledger's spend: calls finished (a call still running
    counts once it ends), as of the last write of the limits (`billing.services.refresh_shared_allowances`)."""
    period = period or current_period()
    windows = allowance_windows_of_its_people(organization_id, since=period.start, until=period.end)
    if not windows:
        return Decimal(0)
    held = [account.organization_id for account in BillingAccount.objects.filter(organization_id__in=windows)
            if held_without_payment_method(account)]
    by_window: dict[tuple, list[int]] = defaultdict(list)
    for other_id in held:
        by_window[windows[other_id]].append(other_id)
    # NOTE: one read a part of the month: the whole of it for all but one handed on during it (`holdings_of`)
    return sum((sum(organizations_period_spends(ids, Period(start, end)).values(), Decimal(0))
                for (start, end), ids in by_window.items()), Decimal(0))


def spend_ceiling_applies(account: BillingAccount) -> bool:
    """Whether `account` is held to a spending ceiling: postpaid, invoiced through Stripe, not vouched for by staff."""
    return bills_through_stripe() and not account.is_prepaid and not account.invoiced_without_card


def net_paid(*organization_ids: int) -> Decimal:
    """What the organisations have paid together (USD; one, or those of `trusted_history`): their paid invoices'
    `amount_paid`, less what was refunded of their payments and what is disputed of them and not won (open, or lost:
    the bank took it back), never below zero.

    NOTE: money that came back raises no ceiling: a card that paid $50, had it refunded or charged back, and ran
    on under the ceiling $50 bought was the hole this closes. A dispute staff settled stays out (the organisation
    repaid it outside Stripe, which Stripe does not show): staff set its ceiling if they want it back. A charge both
    refunded and disputed (Stripe refuses to dispute what it refunded in full, not a part) counts out twice: lower,
    never higher, than its money allows."""
    def cents(queryset, field: str) -> int:
        return queryset.filter(organization_id__in=organization_ids, currency="usd").aggregate(
            total=Sum(field))["total"] or 0

    total = (cents(Invoice.objects.filter(status="paid"), "amount_paid") - cents(RefundedCharge.objects, "amount_refunded")
             - cents(Dispute.objects.filter(status__in=HOLDING_DISPUTE_STATUSES), "amount"))
    return Decimal(max(total, 0)) / CENTS_PER_DOLLAR


def held_to_a_ceiling():
    """The accounts a spending ceiling may hold (`spend_ceiling_applies`, but for Stripe's set-up)."""
    return BillingAccount.objects.filter(mode=BillingMode.POSTPAID, invoiced_without_card=False)


def card_holders(fingerprints: Collection[str], period: Period) -> dict[str, set[int]]:
    """The organisations held to a ceiling that had each card in `period`: those with it on file now
    (`BillingAccount.card_fingerprint`: removing a card keeps it) and those that left it during the period
    (`CardHolding.last_seen_at`). Two indexed queries for any number of cards."""
    fingerprints = [fingerprint for fingerprint in fingerprints if fingerprint]
    holders: dict[str, set[int]] = {fingerprint: set() for fingerprint in fingerprints}
    if not fingerprints:
        return holders
    held = held_to_a_ceiling()
    for fingerprint, organization_id in held.filter(card_fingerprint__in=fingerprints).values_list(
            "card_fingerprint", "organization_id"):
        holders[fingerprint].add(organization_id)
    left = CardHolding.objects.filter(fingerprint__in=fingerprints, last_seen_at__gte=period.start,
                                      organization_id__in=held.values("organization_id"))
    for fingerprint, organization_id in left.values_list("fingerprint", "organization_id"):
        holders[fingerprint].add(organization_id)
    return holders


@dataclass(slots=True, frozen=True)
class CardSpend:
    """The month's spend of every organisation that held one card in it (`card_holders`), read once for all of them
    (`card_spend`): each one's ceiling leaves it what the others have not spent."""

    fingerprint: str
    spend: dict[int, Decimal]  # organisation id: its spend this month

    def others(self, organization_id: int) -> list[int]:
        return [other for other in self.spend if other != organization_id]

    def spent_by_others(self, organization_id: int) -> Decimal:
        return sum((spent for other, spent in self.spend.items() if other != organization_id), Decimal(0))


def card_spend(fingerprints: Collection[str], period: Period | None = None, *, spend: bool = True
               ) -> dict[str, CardSpend]:
    """`CardSpend` of each card: who held it in the period (this month's by default) and what each spent (one
    grouped, indexed read of the ledger for all of them, `organizations_period_spends`; not read without `spend`:
    what a tenant is shown needs none, `standing`; nor for a card held by one)."""
    period = period or current_period()
    holders = card_holders(fingerprints, period)
    shared = {pk for ids in holders.values() if len(ids) > 1 for pk in ids}  # a card of one: no others' spend
    spends = organizations_period_spends(shared, period) if spend else {}
    return {fingerprint: CardSpend(fingerprint, {pk: spends.get(pk, Decimal(0)) for pk in ids})
            for fingerprint, ids in holders.items()}


def trusted_history(organization_id: int, others: Collection[int]) -> list[int]:
    """Those of `others` (the organisations of its card) whose paid history counts for the organisation's ceiling:
    those with an active user who is an OWNER of both. NOTE: a customer's second organisation, same owner, keeps its
    trust; a thief's sign-ups, one user, share their own (nothing); a stranger's payments never count, nor do those of
    an organisation where the user is only an admin, member or viewer (before, any shared member: a contractor invited
    as a viewer took the customer's history to its own organisation on the company card)."""
    if not others:
        return []
    owners = Membership.objects.active_owners()
    mine = owners.filter(organization_id=organization_id).values("user_id")
    return sorted(set(owners.filter(organization_id__in=others, user_id__in=mine)
                      .values_list("organization_id", flat=True)))


def spend_ceiling(account: BillingAccount, *, card: CardSpend | None = None, others_spend: bool = True,
                  period: Period | None = None) -> SpendCeiling | None:
    """The organisation's spending ceiling, or None where none applies (`spend_ceiling_applies`): staff's where they
    set one, else the higher of what its paid history gives (`SPEND_CEILINGS` by the `net_paid` of the organisation
    and those of its card one of its owners owns too, `trusted_history`), less what the card's other organisations spent
    this month (`SpendCeiling.room`, `card_spend`; `card`: read already, for the card's every organisation; not read
    without `others_spend`: the room is then the amount, as a tenant is shown it), and the upgrade's floor
    (`grandfathered_spend_ceiling`, `billing/0032`). `period`: the month the card is read in (this one by default).

    NOTE: the floor is not staff's: paying raises a grandfathered organisation as it does any other, once its paid
    history gives more (before, the upgrade's ceiling was staff's, and a growing customer met a 402 at it for good).
    The others' spend is the ledger's when this is read: the gateway has it as of the last refresh of the limits."""
    if not spend_ceiling_applies(account):
        return None
    if account.card_fingerprint and (card is None or card.fingerprint != account.card_fingerprint):
        card = card_spend([account.card_fingerprint], period, spend=others_spend)[account.card_fingerprint]
    others = card.others(account.organization_id) if account.card_fingerprint else []
    spent_by_others = card.spent_by_others(account.organization_id) if account.card_fingerprint else Decimal(0)
    own_paid = net_paid(account.organization_id)
    trusted = trusted_history(account.organization_id, others)
    paid = net_paid(account.organization_id, *trusted) if trusted else own_paid
    shared = {"num_other_organizations_on_card": len(others), "spent_by_others": spent_by_others,
              "own_paid": own_paid if trusted else None}
    if account.staff_lifted_spend_ceiling or account.staff_spend_ceiling is not None:
        return SpendCeiling(account.staff_spend_ceiling, STAFF, paid, **shared)
    history = paid_history_ceiling(paid, **shared)
    floor = account.grandfathered_spend_ceiling
    if floor is None or history.room is None or history.room >= floor:
        return history
    above = [(step, amount) for step, amount in settings.SPEND_CEILINGS if amount is None or amount > floor]
    return SpendCeiling(floor, GRANDFATHERED, paid, *(above[0] if above else (None, None)), **shared)


def paid_history_ceiling(paid: Decimal, **shared) -> SpendCeiling:
    """The ceiling `SPEND_CEILINGS` gives an organisation whose history has paid `paid`, and its next step;
    `shared`: its card's others (`SpendCeiling`)."""
    steps = settings.SPEND_CEILINGS
    reached = [step for step in steps if step[0] <= paid]
    amount = reached[-1][1]  # NOTE: the first step is at 0 paid (`controlplane.env.env_spend_ceilings`)
    if len(reached) == len(steps):
        return SpendCeiling(amount, PAID_HISTORY, paid, **shared)
    next_paid, next_amount = steps[len(reached)]
    return SpendCeiling(amount, PAID_HISTORY, paid, next_paid, next_amount, **shared)


def spend_limit(account: BillingAccount, *, card: CardSpend | None = None, period: Period | None = None) -> SpendLimit:
    """The lowest of the organisation's own cap, its spending ceiling's room (`SpendCeiling.room`) and the limit
    without a payment method (at a tie, the one that a change of the cap would not lift names it): where the gateway
    stops its calls in `period` (this month by default), whose others' spend leaves it its rooms."""
    return limit_of(account, spend_ceiling(account, card=card, period=period), period=period)


def shown_spend_limit(account: BillingAccount, ceiling: SpendCeiling | None) -> SpendLimit:
    """`spend_limit` as the tenant is shown it (`standing`, the alerts): with the ceiling's amount, not the room the
    card's other organisations leave it. NOTE: the room less the amount is the others' spend to the cent."""
    return limit_of(account, ceiling, room=False)


def limit_of(account: BillingAccount, ceiling: SpendCeiling | None, *, room: bool = True,
             period: Period | None = None) -> SpendLimit:
    limit = SpendLimit(account.spend_cap, ORG_CAP)
    amount = None if ceiling is None else ceiling.room if room else ceiling.amount
    if amount is not None and (limit.cap is None or amount <= limit.cap):
        limit = SpendLimit(amount, SPEND_CEILING_STAFF if ceiling.source == STAFF else SPEND_CEILING)
    without_card = limit_without_payment_method(account, shared=room, period=period)
    if without_card is not None and (limit.cap is None or without_card < limit.cap):
        limit = SpendLimit(without_card, PAYMENT_METHOD)
    return limit


def can_pay_now(account: BillingAccount) -> bool:
    """Whether the organisation's invoices from now on are collected: a card on its Stripe customer, or staff's word
    that it pays by bank transfer."""
    return account.payment_method_on_file or account.invoiced_without_card


def unpaid_invoices_without_card(organization_id: int):
    """The organisation's unpaid invoices of Stripe customers deleted since: no card charges them."""
    deleted = DeletedStripeCustomer.objects.filter(organization_id=organization_id).values("stripe_customer_id")
    return Invoice.objects.filter(organization_id=organization_id, status__in=UNPAID_STATUSES,
                                  stripe_customer_id__in=deleted)


def unpaid_invoices_left_without_card(organization_id: int):
    """Those of `unpaid_invoices_without_card` that the deletion left unpaid: neither failed nor marked uncollectible
    before it (the drafts it finalised, and any that first failed after), so only the want of a card failed them."""
    deleted_at = Subquery(DeletedStripeCustomer.objects.filter(stripe_customer_id=OuterRef("stripe_customer_id"))
                          .values("deleted_at")[:1])
    # NOTE: both clocks are Stripe's (events' `created`, in seconds): a failure in the deletion's second is after it.
    return (unpaid_invoices_without_card(organization_id).annotate(customer_deleted_at=deleted_at)
            .exclude(payment_failed_at__lt=F("customer_deleted_at"))
            .exclude(uncollectible_at__lt=F("customer_deleted_at")))


def past_due_since(organization_id: int, now: datetime | None = None) -> datetime | None:
    """Since when the organisation's unpaid invoices stop its inference, or None when none does."""
    if not bills_through_stripe():
        return None
    now = now or timezone.now()
    grace = timedelta(days=settings.PAST_DUE_GRACE_DAYS)
    unpaid = Invoice.objects.filter(organization_id=organization_id, status__in=UNPAID_STATUSES)
    account = BillingAccount.objects.filter(organization_id=organization_id).first()
    if account is not None and can_pay_now(account):
        # NOTE: an invoice the deletion left without a card fails for want of one, whatever the organisation does: it
        # does not hold an organisation that pays (before, its failure ran the grace period, and a paying customer
        # with a new card was held). It is not forgiven: still owed, and it holds again if the card goes. One past
        # due or uncollectible before the deletion holds as ever: a new customer and card do not pay it.
        unpaid = unpaid.exclude(pk__in=unpaid_invoices_left_without_card(organization_id).values("pk"))
    moments = []
    for status, failed_at, updated_at, due, paid in unpaid.values_list(
            "status", "payment_failed_at", "updated_at", "amount_due", "amount_paid"):
        if due - paid <= 0:
            continue
        if status == "uncollectible":
            moments.append(failed_at or updated_at)
        elif failed_at is not None and failed_at + grace <= now:
            moments.append(failed_at + grace)
    return min(moments, default=None)


def disputed_since(organization_id: int) -> datetime | None:
    """Since when the organisation's disputed payments stop its inference, or None when none does."""
    if not bills_through_stripe():
        return None
    holding = Dispute.objects.filter(organization_id=organization_id, status__in=HOLDING_DISPUTE_STATUSES,
                                     hold_lifted_at__isnull=True)
    moments = holding.values_list("disputed_at", "updated_at")
    return min((disputed_at or updated_at for disputed_at, updated_at in moments), default=None)


@dataclass(slots=True, frozen=True)
class Hold:
    """Why and since when every call of an organisation is refused."""

    since: datetime
    reason: str  # DISPUTED or PAST_DUE

    def __post_init__(self) -> None:
        if self.reason not in (DISPUTED, PAST_DUE):
            raise ValueError(f"not a hold reason: {self.reason}")


def hold(organization_id: int, now: datetime | None = None) -> Hold | None:
    """The organisation's hold, or None. A disputed payment names the hold before an unpaid invoice: paying the
    invoice would not lift it."""
    disputed = disputed_since(organization_id)
    if disputed is not None:
        return Hold(disputed, DISPUTED)
    past_due = past_due_since(organization_id, now)
    return Hold(past_due, PAST_DUE) if past_due is not None else None


def hold_reason(account: BillingAccount) -> str:
    """The reason of the account's hold as reviewed last (`services.review_payment_standing`), or empty."""
    if account.past_due_since is None:
        return ""
    return account.hold_reason or PAST_DUE  # NOTE: a hold kept before its reason was stored is an unpaid invoice's


# Payment methods that are not cards but that Stripe gives a fingerprint of the account behind them (the same account:
# the same fingerprint, in every customer), shared as a card is (`card_fingerprint`).
SHARED_METHOD_TYPES = ("sepa_debit", "us_bank_account", "bacs_debit", "au_becs_debit")


def card_fingerprint(customer) -> str:
    """The fingerprint of the card Stripe charges this customer's invoices with (a customer read with
    `invoice_settings.default_payment_method` and `default_source` expanded), or empty: none, or a method Stripe
    gives none (Link: not shared). The default payment method comes first, as Stripe charges it first; a bank debit
    (`SHARED_METHOD_TYPES`) gives its account's fingerprint namespaced by its type (`sepa_debit:...`), so it never
    matches a card's; an older default source is a card (`card` object) or a card source (`source` of type `card`)."""
    method = (customer.get("invoice_settings") or {}).get("default_payment_method")
    if method:
        kind = method.get("type") if isinstance(method, dict) else None
        details = method.get(kind) if isinstance(kind, str) else None
        fingerprint = str(details.get("fingerprint") or "") if isinstance(details, dict) else ""
        if kind == "card" or not fingerprint:
            return fingerprint
        return f"{kind}:{fingerprint}" if kind in SHARED_METHOD_TYPES else ""
    source = customer.get("default_source")
    if not isinstance(source, dict):
        return ""
    if source.get("object") == "card":
        return str(source.get("fingerprint") or "")
    if source.get("object") == "source" and source.get("type") == "card":
        return str((source.get("card") or {}).get("fingerprint") or "")
    return ""


def has_payment_method(customer) -> bool:
    """Whether Stripe will charge this customer's invoices (a Stripe customer object, or its webhook
    JSON): a default payment method, what the Customer Portal sets when a card is added, or a default
    source (older integrations)."""
    return bool((customer.get("invoice_settings") or {}).get("default_payment_method") or customer.get("default_source"))


def standing(account: BillingAccount, *, period: Period | None = None) -> dict:
    """What the billing page and API show of it: the organisation's own figures (`shown_spend_limit`), in `period`
    (this month by default: the page passes the one it shows)."""
    ceiling = spend_ceiling(account, others_spend=False, period=period)
    limit = shown_spend_limit(account, ceiling)
    return {
        "payment_method_on_file": account.payment_method_on_file,
        "limit_without_payment_method": limit_without_payment_method(account),
        "spend_ceiling": ceiling,
        "effective_spend_cap": limit.cap,
        "limit_reason": limit.reason if limit.cap is not None else "",
        "past_due_since": account.past_due_since,
        "hold_reason": hold_reason(account),
        "num_unpaid_invoices_without_card": unpaid_invoices_without_card(account.organization_id).count(),
    }
