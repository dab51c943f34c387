"""Payment standing: how much an organisation may spend before it can pay, and when an unpaid invoice
stops it. The rules only; `billing.services.review_payment_standing` applies them, and the gateway
enforces them through the organisation's quota counter (`billing.quota.counters.limit_fields`).

On an installation that bills through Stripe (`STRIPE_SECRET_KEY` set):

- **Payment method.** A postpaid organisation whose Stripe customer has no default payment method
  spends at most `SPEND_LIMIT_WITHOUT_PAYMENT_METHOD` a month, whatever cap it sets itself: its usage is
  invoiced after the month, and nothing could collect it. Adding a card in the Customer Portal lifts the
  limit (Stripe's `customer.updated` webhook); removing it puts the limit back. Staff may mark an
  account that pays by bank transfer `invoiced_without_card`. Prepaid accounts spend only credit.
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

Without Stripe, nothing is invoiced, so neither rule applies (caps and credit still do).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db.models import F, OuterRef, Subquery
from django.utils import timezone

from billing.models import BillingAccount, DeletedStripeCustomer, Dispute, Invoice
from controlplane.hot_settings import hot

# Invoice states that still owe money (Stripe's `status`).
UNPAID_STATUSES = ("open", "uncollectible")
# Dispute states that stop the organisation (Stripe's `status`): open (an inquiry, or a chargeback not decided
# yet) and lost. NOTE: a state not named (won, warning_closed, prevented, or one Stripe adds) stops nothing.
HOLDING_DISPUTE_STATUSES = ("warning_needs_response", "warning_under_review", "needs_response", "under_review", "lost")
# The gateway's refusal reasons for a hold (`billing.quota.counters.QuotaExceeded`).
PAST_DUE = "past_due"
DISPUTED = "disputed"


@dataclass(slots=True, frozen=True)
class SpendLimit:
    """The most an organisation may spend this month (None: no limit) and why, as the gateway's
    refusal names it: `org_cap` (its own cap) or `payment_method` (the limit without one)."""

    cap: Decimal | None
    reason: str


def bills_through_stripe() -> bool:
    return bool(hot.STRIPE_SECRET_KEY)


def limit_without_payment_method_applies() -> bool:
    """Whether this installation limits accounts without a payment method at all."""
    return settings.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD > 0 and bills_through_stripe()


def limit_without_payment_method(account: BillingAccount) -> Decimal | None:
    """The limit that applies to `account` for want of a payment method, or None."""
    limit = settings.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD
    if not limit_without_payment_method_applies():
        return None
    if account.is_prepaid or account.payment_method_on_file or account.invoiced_without_card:
        return None
    if account.stripe_customer_id and not account.payment_method_observed_ms:
        return None  # a customer made before payment standing, not yet asked (`stripe_sync.observe_payment_method`)
    return limit


def spend_limit(account: BillingAccount) -> SpendLimit:
    """The lower of the organisation's own cap and the limit without a payment method."""
    own = account.spend_cap
    limit = limit_without_payment_method(account)
    if limit is not None and (own is None or limit < own):
        return SpendLimit(limit, "payment_method")
    return SpendLimit(own, "org_cap")


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


def has_payment_method(customer) -> bool:
    """Whether Stripe will charge this customer's invoices (a Stripe customer object, or its webhook
    JSON): a default payment method, what the Customer Portal sets when a card is added, or a default
    source (older integrations)."""
    return bool((customer.get("invoice_settings") or {}).get("default_payment_method") or customer.get("default_source"))


def standing(account: BillingAccount) -> dict:
    """What the billing page and API show of it."""
    limit = spend_limit(account)
    return {
        "payment_method_on_file": account.payment_method_on_file,
        "limit_without_payment_method": limit_without_payment_method(account),
        "effective_spend_cap": limit.cap,
        "past_due_since": account.past_due_since,
        "hold_reason": hold_reason(account),
        "num_unpaid_invoices_without_card": unpaid_invoices_without_card(account.organization_id).count(),
    }
