"""Stripe, through the official library: customers, subscriptions, Billing Meters, meter events, portal links.

Per-endpoint prices cannot be one Stripe price per token meter, so what Stripe bills is a cost
meter: each rollup's cost in micro-dollars, under one metered price of $0.000001 a unit. Each
organisation's customer gets one subscription to that price when it is first needed. The token
meters stay, for token-level detail.

Only postpaid usage is metered: prepaid usage is paid from credit (`billing.credits`), and its
rollups are never pushed (`UsageRollup.objects.pushable`). Each closed postpaid rollup becomes up to
four meter events (uncached input, cached input and output tokens, and cost) whose `identifier` is
made of the rollup's `push_uid` (what the rollup is: `UsageRollup.push_uid_of`), so a retry after a crash can never
bill twice: Stripe refuses an
identifier it has (`duplicate_meter_event`), and `MeterEventPush` records what was accepted so we do
not even ask again. NOTE: not of the rollup's id, which PostgreSQL hands out again after a restore to a
point in time or a failover to a replica that was behind: a new rollup (another tenant's, maybe) had an
identifier Stripe had taken within the day, was refused as a duplicate, recorded as pushed, never billed; nor random,
which billed twice a rollup lost in such a rewind and made again from the usage still there.
A worker claims a rollup with a conditional update (a lease that a dead worker's successor may take
over), calls Stripe with no database transaction open, and retries 5xx, 429 and timeouts with
exponential backoff and jitter, under idempotency keys that move on after a server error
(`IdempotencyKey`). A run pushes rollups never tried before ahead of those that failed, for a
bounded time, so a few that keep failing never hold up the rest.

A subscription Stripe ends (cancelled in the Dashboard, by Stripe after failed payments, or with its customer
deleted) is forgotten by its webhook (`billing.webhooks`); the next push subscribes the organisation again, starting
where the ended one's invoices stopped (`_invoiced_until`). Usage pushed to a deleted customer that none of its
invoices billed goes again to the next, under new identifiers (`UsageRollup.push_generation`,
`billing.services.push_again`). The Customer Portal that customers are sent to uses the
platform's own configuration, which offers no cancellation, pause or change of plan (`ensure_portal_configuration`).
"""

from __future__ import annotations

import functools
import logging
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import stripe
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Case, F, IntegerField, Q, Value, When

from billing import services, standing
from billing.models import (
    BILLED_METER_EVENT_NAME,
    BILLING_INVOICE_STATUSES,
    WRITTEN_OFF_INVOICE_STATUS,
    BillingAccount,
    BillingMode,
    MeterEventPush,
    StripeMeter,
    UsageRollup,
    voided_after_deletion,
    voided_in_deletions_second,
)
from controlplane.accounts.models import Organization
from controlplane.accounts.services import SYSTEM, Actor, record_audit
from controlplane.clock import DatabaseClock, database_now, database_time_ago
from controlplane.redis_client import held_alone
from controlplane.redis_keys import PUSH_RUN_LOCK_KEY

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 5
MAX_BACKOFF_S = 8.0
# Stripe answers a repeated identifier (sent with a different idempotency key) with one of these.
DUPLICATE_EVENT_CODES = {"duplicate_meter_event", "resource_already_exists"}


@dataclass(slots=True, frozen=True)
class Meter:
    event_name: str
    display_name: str
    rollup_field: str  # the UsageRollup attribute it counts


METERS = (
    Meter("inferplane_input_tokens", "Input tokens", "input_tokens"),
    Meter("inferplane_cached_input_tokens", "Cached input tokens", "cached_tokens"),
    Meter("inferplane_output_tokens", "Output tokens", "completion_tokens"),
    Meter(BILLED_METER_EVENT_NAME, "Usage (micro-dollars)", "cost_micro_dollars"),
)
COST_METER = METERS[-1]
# The one price Stripe bills by: a micro-dollar of cost meter is 0.0001 cent.
USAGE_PRICE_LOOKUP_KEY = "inferplane_usage_cost_usd_monthly"
USAGE_PRICE_UNIT_CENTS = "0.0001"
# A meter event is dated no earlier than this before it is sent. NOTE: Stripe bills an event in the period its
# timestamp falls in, and takes usage for a period that ended only during its invoice's finalization grace (one hour
# by default). An hour dated at its start and pushed ~70 minutes later (its rollup closes 10 minutes after it ends)
# missed the grace whenever a period ended within it, and any usage pushed late (Stripe or the worker down, a held
# rollup released, a journal replayed) missed it by more: billed by no invoice. Dated at most 30 minutes back, every
# event lands in the open period or within the grace of the one that just ended.
LATEST_PERIOD_GRACE = timedelta(minutes=30)
# The platform's Customer Portal configuration (`ensure_portal_configuration`), found by this metadata; a new version
# makes a new one. Customers add and change cards, their billing email and address, and see invoices.
PORTAL_CONFIGURATION_MARK = "inferplane_portal"
PORTAL_CONFIGURATION_VERSION = "1"
PORTAL_FEATURES_OFF = ("subscription_cancel", "subscription_pause", "subscription_update")
PORTAL_FEATURES = {
    "customer_update": {"enabled": True, "allowed_updates": ["email", "address"]},
    "invoice_history": {"enabled": True},
    "payment_method_update": {"enabled": True},
    **{name: {"enabled": False} for name in PORTAL_FEATURES_OFF},
}
# A subscription in one of these states never bills again (Stripe's `status`).
ENDED_SUBSCRIPTION_STATUSES = frozenset({"canceled", "incomplete_expired"})
# Stripe refuses a meter event's `identifier` again "for at least 24 hours". An event not confirmed (Stripe's answer
# to it lost: a timeout, a 5xx after the work) and first sent longer ago than this may be in Stripe and no longer
# refused: sent again, it could bill the customer twice. Its rollup is held for an operator instead.
IDENTIFIER_TRUSTED_FOR = timedelta(hours=23)
# How long one push run goes on claiming rollups. NOTE: under the task's soft time limit
# (`billing.tasks.push_pending_rollups`, 570 s), with room for the rollup in hand to finish.
PUSH_RUN_BUDGET_S = 400.0


class StripeNotConfigured(RuntimeError):
    pass


def is_configured() -> bool:
    return bool(settings.STRIPE_SECRET_KEY)


@functools.lru_cache(maxsize=4)
def _client(secret_key: str, api_base: str | None, timeout_s: float) -> stripe.StripeClient:
    return stripe.StripeClient(
        secret_key,
        base_addresses={"api": api_base} if api_base else None,
        http_client=stripe.RequestsClient(timeout=timeout_s),
        max_network_retries=0,  # NOTE: we retry ourselves, with our own idempotency keys
    )


def stripe_client() -> stripe.StripeClient:
    if not is_configured():
        raise StripeNotConfigured("STRIPE_SECRET_KEY is not set")
    return _client(settings.STRIPE_SECRET_KEY, settings.STRIPE_API_BASE, settings.STRIPE_TIMEOUT_S)


def _random_suffix(_failed: str) -> str:
    return secrets.token_hex(6)


@dataclass(slots=True)
class IdempotencyKey:
    """The idempotency key of one Stripe write: `base`, and a new `suffix` each time one saved a server error.

    NOTE: Stripe saves the first answer to a key once the endpoint has begun, a 500 too, and replays
    it to every retry with that key for at least 24 hours: a write retried under the key that saved a
    server error fails for a day, then runs again once the key is pruned, though a 500 does not say
    the work was not done. So once a key has saved a server error (it comes back with the header
    `Idempotent-Replayed: true`) the write goes on under a new key, and what it might repeat is found
    first: a meter event by its `identifier` (Stripe refuses one it has), a subscription, meter or
    price by looking it up before creating it; only a customer cannot be looked up, and may be left
    behind, empty. Any other failure keeps the key: a first server error (if Stripe saved it, the retry
    comes back replayed; if not, the key is as good as new, and a worker racing on the same write may
    hold it too), a timeout (Stripe may have done the work, and the key fetches its answer), a 429
    (refused before Stripe's idempotency layer).

    `renewed(failed suffix)` returns the next suffix: where a row keeps it (`_generation_key`), it is
    stored there first, so that a later run never goes back to a key that saved a 500, and workers
    racing on the same write move to the same key.
    """

    base: str
    suffix: str = ""
    renewed: Callable[[str], str] = _random_suffix

    @property
    def value(self) -> str:
        return f"{self.base}:{self.suffix}" if self.suffix else self.base

    def renew(self) -> None:
        self.suffix = self.renewed(self.suffix)


def _generation_key(model, pk: int, field: str, base: str, generation: int) -> IdempotencyKey:
    """An `IdempotencyKey` whose suffix is the row's `field` (0: none, the key of code before it)."""

    def renewed(failed: str) -> str:
        failed_generation = int(failed or 0)
        # Conditional: of two workers replayed the same saved error, the second moves nothing further.
        model.objects.filter(pk=pk, **{field: failed_generation}).update(**{field: failed_generation + 1})
        return str(model.objects.values_list(field, flat=True).get(pk=pk) or "")

    return IdempotencyKey(base, str(generation or ""), renewed)


def _is_server_error(exc: stripe.StripeError) -> bool:
    return isinstance(exc, stripe.APIError) and (exc.http_status or 500) >= 500


def _was_replayed(exc: stripe.StripeError) -> bool:
    """Whether Stripe answered with what it saved under the idempotency key before (its documented header)."""
    return any(name.lower() == "idempotent-replayed" and value == "true" for name, value in (exc.headers or {}).items())


def _reused_with_other_parameters(exc: stripe.StripeError) -> bool:
    """Stripe refused a key it saved for a write with other parameters (a 400 `idempotency_error`)."""
    return isinstance(exc, stripe.IdempotencyError) and exc.http_status == 400


def _is_retryable(exc: stripe.StripeError) -> bool:
    if isinstance(exc, stripe.APIConnectionError | stripe.RateLimitError) or _reused_with_other_parameters(exc):
        return True
    if exc.http_status == 409 and getattr(exc.error, "type", None) == "idempotency_error":
        # NOTE: the same key in flight from another worker: its answer is saved once it ends. The library raises
        # this one as a plain APIError (an IdempotencyError only for a 400 or 404), so its type is read.
        return True
    return _is_server_error(exc)


def call_stripe(request, *, what: str, attempts: int = MAX_ATTEMPTS, key: IdempotencyKey | None = None):
    """Run `request(options)`, retrying transient failures: a read with no options, a write with `key`
    as its idempotency key, renewed once it has saved a server error (`IdempotencyKey`)."""
    for attempt in range(1, attempts + 1):
        try:
            return request({"idempotency_key": key.value} if key is not None else {})
        except stripe.StripeError as exc:
            if key is not None and ((_is_server_error(exc) and _was_replayed(exc)) or _reused_with_other_parameters(exc)):
                # NOTE: also a key an earlier run used for this write with other parameters (a meter event's date
                # moves: `event_timestamp`): refused for 24 h, it held the write up as long. Under a new key,
                # what the first try did is found first, as after a saved server error (`IdempotencyKey`).
                key.renew()
            if not _is_retryable(exc) or attempt == attempts:
                raise
            delay_s = min(MAX_BACKOFF_S, settings.STRIPE_RETRY_BASE_DELAY_S * 2 ** (attempt - 1))
            delay_s *= 0.5 + random.random() / 2
            logger.warning("stripe %s failed (%s), attempt %d; retrying in %.2fs", what, exc.__class__.__name__, attempt, delay_s)
            time.sleep(delay_s)


# --- customers and meters ---------------------------------------------------------------------------

def _store_once(account: BillingAccount, field: str, stripe_id: str) -> str:
    """Store a Stripe id in the account's empty `field`; when two workers raced, the first one stored
    wins (a conditional update) and is what both return."""
    BillingAccount.objects.filter(pk=account.pk, **{field: ""}).update(**{field: stripe_id})
    return BillingAccount.objects.values_list(field, flat=True).get(pk=account.pk)


def _account_key(account: BillingAccount, base: str) -> IdempotencyKey:
    generation = BillingAccount.objects.values_list("stripe_key_generation", flat=True).get(pk=account.pk)
    return _generation_key(BillingAccount, account.pk, "stripe_key_generation", base, generation)


def ensure_customer(organization_id: int) -> str:
    """The organisation's Stripe customer id, creating the customer the first time it is needed.

    A customer cannot be looked up reliably (Stripe's search lags): after a server error that had
    created one anyway, the next try creates another, and the first stays behind, empty, never billed.
    """
    account = BillingAccount.objects.for_organization(organization_id)
    if account.stripe_customer_id:
        return account.stripe_customer_id
    organization = Organization.objects.get(pk=organization_id)
    customer = call_stripe(
        lambda options: stripe_client().v1.customers.create(
            params={"name": organization.name, "metadata": {"organization_id": str(organization_id), "slug": organization.slug}},
            options=options,
        ),
        what="customer create", key=_account_key(account, f"customer-org-{organization_id}"),
    )
    # NOTE: one statement: a customer we have just made has no payment method, known as of its creation
    # (`billing.standing`); a stored customer with no reading would count as one never read, unlimited.
    BillingAccount.objects.filter(pk=account.pk, stripe_customer_id="").update(
        stripe_customer_id=customer.id, payment_method_observed_ms=(customer.created or 1) * 1000)
    return BillingAccount.objects.values_list("stripe_customer_id", flat=True).get(pk=account.pk)


# The customer read with what its card's fingerprint is on (`billing.standing.card_fingerprint`).
CUSTOMER_EXPAND = ["invoice_settings.default_payment_method", "default_source"]


def observe_payment_method(customer_id: str, *, attempts: int = MAX_ATTEMPTS) -> bool:
    """Read from Stripe whether `customer_id` has a default payment method now, and its card's fingerprint, and
    record them. Stripe's `customer.*` webhooks are only the cue: they may arrive late and out of order, the customer
    as read decides (stamped before the read, so an older reading never wins). A customer deleted in
    Stripe has none."""
    observed_ms = time.time_ns() // 1_000_000
    fingerprint = ""
    try:
        customer = call_stripe(lambda options: stripe_client().v1.customers.retrieve(
            customer_id, params={"expand": CUSTOMER_EXPAND}, options=options), what="customer read", attempts=attempts)
        on_file = standing.has_payment_method(customer.to_dict())
        fingerprint = standing.card_fingerprint(customer.to_dict())
    except stripe.InvalidRequestError as exc:
        if exc.code != "resource_missing":
            raise
        on_file = False
    services.record_payment_method(customer_id, on_file=on_file, observed_ms=observed_ms, card_fingerprint=fingerprint)
    return on_file


def charge_payer(charge_id: str, *, attempts: int = MAX_ATTEMPTS) -> tuple[str, str]:
    """The customer and invoice ids of Stripe's charge `charge_id` (each empty when it has none), as Stripe has
    it: a dispute names only its charge. ("", "") for a charge Stripe does not know. Charges carry no `invoice`
    since API version 2025-03-31; an older one's is taken when there."""
    try:
        charge = call_stripe(lambda options: stripe_client().v1.charges.retrieve(charge_id, options=options),
                             what="charge read", attempts=attempts).to_dict()
    except stripe.InvalidRequestError as exc:
        if exc.code != "resource_missing":
            raise
        return "", ""
    return reference_id(charge.get("customer")), reference_id(charge.get("invoice"))


@dataclass(slots=True, frozen=True)
class DeletedCustomerInvoices:
    """What Stripe's invoices of a customer just deleted settle, its drafts finalised (`deleted_customer_invoices`)."""

    invoiced_until: datetime | None  # the latest end of the periods they settle: billed, or written off; None: none
    # (start, end, quantity, invoice id) of those that bill their period: Stripe's seconds, and what they billed in
    # units of the billed meter (`billing.models.BILLED_METER_EVENT_NAME`), None where it is not final (a draft still
    # advancing) or not known (`usage_quantity`).
    # And whether it is final: a draft Stripe still advances (quantity None until its webhook says it) is not.
    billed_periods: list[tuple[int, int, int | None, str, bool]] | None  # None: not read
    written_off: list[str]  # the ids of the void ones voided a second before the deletion: staff write-offs
    # (invoice id, start, end) of the void ones Stripe's clock cannot order against the deletion
    # (`billing.models.voided_in_deletions_second`): their usage is held for an operator.
    voided_in_its_second: list[tuple[str, int, int]] = field(default_factory=list)


def deleted_customer_invoices(customer_id: str, *, deleted_at: datetime,
                              attempts: int = MAX_ATTEMPTS) -> DeletedCustomerInvoices:
    """What Stripe's invoices of `customer_id`, deleted at `deleted_at` (the deletion event's `created`), settle, once
    its drafts are finalised: those that bill the usage of their period (`billing.models.BILLING_INVOICE_STATUSES`),
    and the void ones voided before the deletion (`status_transitions.voided_at`): a live customer's void is a
    staff write-off; one voided in the deletion's own second is neither known billed nor written off: its usage is held
    for an operator (`voided_in_its_second`). NOTE: the invoices read here, after the deletion, and not void then were
    voided after it if voided since, whatever the second (`billed_periods`' ids) (`billing.models.WRITTEN_OFF_INVOICE_STATUS`). Before, a void one counted as billing nothing
    whenever it was voided, and the usage staff had forgiven went to the next customer. One voided after the deletion
    settles nothing (no card charges it): its usage goes again (`billing.services.push_again_voided`). Read for a
    customer just deleted (`billing.webhooks`): its invoices' own webhooks may come after its deletion's, and the usage
    they settle must not go again to the next customer.

    NOTE: Stripe keeps a deleted customer's invoices (it cancels its subscriptions, without a final invoice, and
    voids nothing), and a subscription's draft cannot be deleted, only finalised: Stripe finalises it itself an hour
    after making it (`auto_advance`), with the usage of its period. Counted as billing nothing, as before, its usage
    went again to the next customer and was billed twice. So each draft is finalised now: it bills its period, and no
    usage of that period goes again. A draft Stripe refuses to finalise counts as it is read then: billed if Stripe
    still advances it itself, else not (logged). Each finalised one's quantity of the usage price (`usage_quantity`) is
    what it billed of the events Stripe received before the deletion: which of those received in the deletion's own
    second it dropped (`billing.services._pushed_uninvoiced`)."""
    usage_price_id = StripeMeter.objects.filter(event_name=COST_METER.event_name).values_list(
        "stripe_price_id", flat=True).first() or ""
    invoices = call_stripe(
        lambda options: stripe_client().v1.invoices.list(params={"customer": customer_id, "limit": 100}, options=options),
        what="invoice list", attempts=attempts)
    ends, billed_periods, written_off, voided_in_its_second = [], [], [], []
    for invoice in invoices.auto_paging_iter():
        if invoice.status == "draft":
            invoice = _finalized(invoice.id, attempts=attempts)
        if _bills_its_period(invoice) and invoice.period_end:
            ends.append(invoice.period_end)
            final = invoice.status in BILLING_INVOICE_STATUSES
            billed_periods.append((invoice.period_start, invoice.period_end,
                                   usage_quantity(invoice.to_dict(), attempts=attempts, usage_price_id=usage_price_id)
                                   if final else None, invoice.id, final))
        elif invoice.status == WRITTEN_OFF_INVOICE_STATUS and not voided_after_deletion(_voided_at(invoice), deleted_at):
            # NOTE: one of the deletion's own second settles its period too, but is no write-off by rule: held.
            if voided_in_deletions_second(_voided_at(invoice), deleted_at):
                if invoice.period_start is not None and invoice.period_end:
                    voided_in_its_second.append((invoice.id, invoice.period_start, invoice.period_end))
            else:
                written_off.append(invoice.id)
            if invoice.period_end:
                ends.append(invoice.period_end)
        elif invoice.status == "draft":
            logger.warning("the draft invoice %s of the deleted customer %s cannot be finalised and is not advanced "
                           "by Stripe: the usage of its period goes again to the next customer", invoice.id, customer_id)
    return DeletedCustomerInvoices(datetime.fromtimestamp(max(ends), tz=UTC) if ends else None, billed_periods,
                                   written_off, voided_in_its_second)


def usage_quantity(invoice: dict, *, attempts: int, usage_price_id: str | None = None) -> int | None:
    """What Stripe's `invoice` (a dict) billed of the usage price's meter (`usage_price_id`, the one kept if not given):
    the quantities of its lines of that price, all of them (`usage_price_lines`). None where that cannot be told: the
    price not known, a line whose price cannot be told, or a usage line whose quantity Stripe does not say.

    NOTE: not every line's quantity, as before: a line of another price (a one-off invoice item, a second price staff
    put on the subscription) is in units of something else, and the events of the deletion's own second it made
    too many could not be placed (billed by no customer); nor only the lines the invoice shows (its first 10): with
    the usage price's line among the others, what it billed was too little, and events Stripe had billed were taken
    for dropped and billed again to the next customer."""
    if usage_price_id is None:
        usage_price_id = StripeMeter.objects.filter(event_name=COST_METER.event_name).values_list(
            "stripe_price_id", flat=True).first() or ""
    if not usage_price_id:
        return None
    lines = usage_price_lines(invoice, usage_price_id, attempts=attempts)
    if lines is None or any(line.get("quantity") is None for line in lines):
        logger.warning("the invoice %s has a line whose price or quantity cannot be told: what it billed of the usage "
                       "price is not known", invoice.get("id"))
        return None
    return sum(line["quantity"] for line in lines)


def usage_price_lines(invoice: dict, usage_price_id: str, *, attempts: int, subscription=None) -> list[dict] | None:
    """The lines of Stripe's `invoice` (a dict) that bill the usage price (`usage_price_id`), all of them
    (`invoice_lines`); None where a line's price cannot be told.

    A line's price is the one it states (`price_of`); where it states none (its `pricing` or `pricing.price_details`
    is null: Stripe's API allows both, and gives pricing of other kinds, rate cards, as another `pricing.type`), its
    `parent` says what made it: a subscription item, whose price the subscription says (`subscription`, read from
    Stripe when needed and not given), or an invoice item, whose price is one-time (Stripe refuses a recurring price for
    an invoice item), so it never bills a meter. NOTE: before, such a line was skipped: with the usage line priced so,
    an ended subscription counted as having invoiced nothing, and the next one, started at its start, billed its usage
    twice; and what a deleted customer's invoice billed was not known."""
    item_prices = None
    found = []
    for line in invoice_lines(invoice, attempts=attempts):
        price_id = price_of(line)
        if not price_id:
            parent = line.get("parent") or {}
            if parent.get("type") == "invoice_item_details" or line.get("type") == "invoiceitem":
                continue
            item_id = ((parent.get("subscription_item_details") or {}).get("subscription_item")
                       or reference_id(line.get("subscription_item")))
            if item_id and item_prices is None:
                if subscription is None:
                    subscription = _subscription_of(invoice, line, attempts=attempts)
                item_prices = {} if subscription is None else _item_prices(subscription, attempts=attempts)
            price_id = (item_prices or {}).get(item_id or "", "")
            if not price_id:
                logger.warning("the invoice %s has a line (%s) whose price Stripe does not say", invoice.get("id"),
                               line.get("id"))
                return None
        if price_id == usage_price_id:
            found.append(line)
    return found


def _item_prices(subscription: dict, *, attempts: int) -> dict[str, str]:
    """The price of each item of Stripe's `subscription` (a dict), by item id: all of them, read page by page where it
    shows only some (its first 10, `items.has_more`). NOTE: before, only those shown: a line of an item past them could
    not be placed, and the next subscription was never made. An item deleted since (a price swapped) is in no list,
    and Stripe answers 404 for it: its lines cannot be placed (`UNKNOWN_LINES_HOLD_AFTER`)."""
    items = subscription.get("items") or {}
    prices = {item["id"]: reference_id(item["price"]) for item in items.get("data") or []}
    if items.get("has_more"):
        listed = call_stripe(lambda options: stripe_client().v1.subscription_items.list(
            params={"subscription": subscription["id"], "limit": 100}, options=options),
            what="subscription items read", attempts=attempts)
        prices |= {item["id"]: reference_id(item["price"])
                   for item in (listed_item.to_dict() for listed_item in listed.auto_paging_iter())}
    return prices


def _subscription_of(invoice: dict, line: dict, *, attempts: int):
    """The subscription (a dict) that made `line` of `invoice`, read from Stripe; None if neither names one."""
    subscription_id = (((line.get("parent") or {}).get("subscription_item_details") or {}).get("subscription")
                       or (((invoice.get("parent") or {}).get("subscription_details") or {}).get("subscription"))
                       or reference_id(invoice.get("subscription")))
    if not subscription_id:
        return None
    return call_stripe(lambda options: stripe_client().v1.subscriptions.retrieve(subscription_id, options=options),
                       what="subscription read", attempts=attempts).to_dict()


def invoice_lines(invoice: dict, *, attempts: int) -> list[dict]:
    """All the lines of Stripe's `invoice` (as a dict: a webhook's, or `to_dict()`): those it shows (the first 10), and
    the rest read page by page (`lines.has_more`), each page retried as other reads."""
    lines = list((invoice.get("lines") or {}).get("data") or [])
    more = bool((invoice.get("lines") or {}).get("has_more")) and bool(lines)
    while more:
        page = call_stripe(lambda options, after=lines[-1]["id"]: stripe_client().v1.invoices.line_items.list(
            invoice["id"], params={"limit": 100, "starting_after": after}, options=options),
            what="invoice lines read", attempts=attempts)
        lines += [line.to_dict() for line in page.data]
        more = page.has_more and bool(page.data)
    return lines


def price_of(line: dict) -> str:
    """The id of the price of Stripe's invoice `line`, "" where Stripe does not say it."""
    # NOTE: `pricing.price_details.price`, or `price` as API versions before 2025-03-31 show it (an object).
    return reference_id(((line.get("pricing") or {}).get("price_details") or {}).get("price") or line.get("price"))


def _voided_at(invoice) -> datetime | None:
    """When Stripe voided `invoice` (`status_transitions.voided_at`), None if not told."""
    voided_at = (invoice.to_dict().get("status_transitions") or {}).get("voided_at")
    return datetime.fromtimestamp(voided_at, tz=UTC) if voided_at else None


def customer_billed_periods(customer_id: str, *, attempts: int = MAX_ATTEMPTS) -> list[tuple[datetime, datetime]]:
    """The periods (start, end) of Stripe's invoices of `customer_id` that bill the usage of their period
    (`_bills_its_period`), as Stripe has them now. Read for a deleted customer one of whose invoices was voided
    (`billing.webhooks`): the usage of the void one's period goes again unless another of its invoices bills it
    (`billing.services.push_again_voided`); that invoice's own webhook may not have come yet."""
    invoices = call_stripe(
        lambda options: stripe_client().v1.invoices.list(params={"customer": customer_id, "limit": 100}, options=options),
        what="invoice list", attempts=attempts)
    return [(datetime.fromtimestamp(invoice.period_start, tz=UTC), datetime.fromtimestamp(invoice.period_end, tz=UTC))
            for invoice in invoices.auto_paging_iter()
            if _bills_its_period(invoice) and invoice.period_start is not None and invoice.period_end]


def _finalized(invoice_id: str, *, attempts: int):
    """The invoice once finalised, or as Stripe has it if it refuses (finalised already, say).

    NOTE: no idempotency key: finalising again what is finalised is refused, and the invoice read instead. Under a
    key, a server error Stripe saved would be replayed to every later delivery of the webhook for a day."""
    try:
        return call_stripe(lambda options: stripe_client().v1.invoices.finalize_invoice(invoice_id, options=options),
                           what="invoice finalize", attempts=attempts)
    except stripe.InvalidRequestError as exc:
        logger.info("stripe did not finalise invoice %s (%s); read as it is", invoice_id, exc.code)
        return call_stripe(lambda options: stripe_client().v1.invoices.retrieve(invoice_id, options=options),
                           what="invoice read", attempts=attempts)


def reference_id(reference) -> str:
    """A Stripe reference's id, whether the object is expanded or not."""
    return (reference.get("id") if isinstance(reference, dict) else reference) or ""


def observe_unknown_payment_methods(*, limit: int = 10) -> int:
    """`observe_payment_method` for postpaid customers never read (made before payment standing), a few
    per run, one try each: a customer Stripe cannot answer for now is asked again at the next run."""
    unknown = BillingAccount.objects.filter(mode=BillingMode.POSTPAID, payment_method_observed_ms=0).exclude(
        stripe_customer_id="").order_by("?").values_list("stripe_customer_id", flat=True)[:limit]
    num_observed = 0
    for customer_id in unknown:
        try:
            observe_payment_method(customer_id, attempts=1)
            num_observed += 1
        except Exception:
            logger.exception("could not read the Stripe customer %s; the next run asks again", customer_id)
    return num_observed


def observe_card_fingerprints() -> tuple[int, list[str]]:
    """`observe_payment_method` for every postpaid customer with a payment method on file, so that organisations
    sharing a card share its month now, not at their next reading. Every one, not only those with no fingerprint: a
    pod of the version before `billing/0034`, during the deploy, recorded a change of card without its fingerprint
    (the old one kept). Returns how many were read and the customers that could not be (logged; the others are still
    read). Safe to run again: a reading older than the one recorded changes nothing."""
    unread = (BillingAccount.objects.filter(mode=BillingMode.POSTPAID, payment_method_on_file=True)
              .exclude(stripe_customer_id="").order_by("pk").values_list("stripe_customer_id", flat=True))
    num_read, failed = 0, []
    for customer_id in unread.iterator():
        try:
            observe_payment_method(customer_id)
            num_read += 1
        except Exception:
            logger.exception("could not read the Stripe customer %s's card", customer_id)
            failed.append(customer_id)
    return num_read, failed


def _find_or_create(find, create, *, key: IdempotencyKey, what: str):
    """What `find()` (a read) finds, or else `create(options)` under `key`. After a server error the create
    goes on under a new key and may have been done already (`IdempotencyKey`): each try looks first."""
    found = call_stripe(lambda options: find(), what=f"{what} lookup")
    if found is not None:
        return found

    def find_else_create(options):
        found = find() if key.suffix else None
        return found if found is not None else create(options)

    return call_stripe(find_else_create, what=what, key=key)


def _active_meter(event_name: str):
    meters = stripe_client().v1.billing.meters.list(params={"status": "active", "limit": 100})
    return next((meter for meter in meters.data if meter.event_name == event_name), None)


def ensure_meters() -> dict[str, str]:
    """event name -> Stripe meter id: found in Stripe (a database restored, or a second environment),
    else created, the first time."""
    known = dict(StripeMeter.objects.values_list("event_name", "stripe_meter_id"))
    for meter in METERS:
        if meter.event_name in known:
            continue
        found = _find_or_create(
            lambda meter=meter: _active_meter(meter.event_name),
            lambda options, meter=meter: stripe_client().v1.billing.meters.create(
                params={
                    "display_name": meter.display_name,
                    "event_name": meter.event_name,
                    "default_aggregation": {"formula": "sum"},
                    "customer_mapping": {"type": "by_id", "event_payload_key": "stripe_customer_id"},
                    "value_settings": {"event_payload_key": "value"},
                },
                options=options,
            ),
            key=IdempotencyKey(f"meter-{meter.event_name}"), what="meter create",
        )
        try:
            StripeMeter.objects.get_or_create(event_name=meter.event_name, defaults={"stripe_meter_id": found.id})
        except IntegrityError:  # another worker stored it first: the same meter (found, or the same idempotency key)
            pass
        known[meter.event_name] = found.id
    return known


def _usage_price():
    found = stripe_client().v1.prices.list(params={"lookup_keys": [USAGE_PRICE_LOOKUP_KEY], "limit": 1})
    return found.data[0] if found.data else None


def ensure_usage_price() -> str:
    """The id of the metered price on the cost meter: found by its lookup key, else created once."""
    meter_ids = ensure_meters()
    stored = StripeMeter.objects.filter(event_name=COST_METER.event_name).values_list("stripe_price_id", flat=True).first()
    if stored:
        return stored
    price_id = _find_or_create(
        _usage_price,
        lambda options: stripe_client().v1.prices.create(
            params={
                "currency": "usd",
                "unit_amount_decimal": USAGE_PRICE_UNIT_CENTS,
                "recurring": {"interval": "month", "usage_type": "metered", "meter": meter_ids[COST_METER.event_name]},
                "product_data": {"name": "Inferplane inference"},
                "lookup_key": USAGE_PRICE_LOOKUP_KEY,
                "nickname": "Usage, per micro-dollar",
            },
            options=options,
        ),
        key=IdempotencyKey(f"price-{USAGE_PRICE_LOOKUP_KEY}"), what="price create",
    ).id
    StripeMeter.objects.filter(event_name=COST_METER.event_name, stripe_price_id="").update(stripe_price_id=price_id)
    return price_id


def ensure_subscription(organization_id: int) -> str:
    """The organisation's subscription to the usage price, created when none is live, with its customer.

    Each try lists the customer's subscriptions to the price first, and takes a live one: a create
    that Stripe did although it answered an error, or another worker's, is never made twice. Two
    workers racing send the same idempotency key besides (`BillingAccount.stripe_key_generation`), and
    the first conditional update stores the subscription. A subscription that Stripe ended is
    forgotten by its webhook (`billing.services.record_subscription_ended`); the next one starts where
    its invoices stopped (`_invoiced_until`), so that usage is billed once: not again, and not never.
    """
    account = BillingAccount.objects.for_organization(organization_id)
    if account.stripe_subscription_id:
        return account.stripe_subscription_id
    customer_id = ensure_customer(organization_id)
    price_id = ensure_usage_price()
    oldest_hour = (UsageRollup.objects.filter(organization_id=organization_id, billing_mode=BillingMode.POSTPAID)
                   .order_by("hour_start").values_list("hour_start", flat=True).first())

    def find_else_create(options):
        subscriptions = stripe_client().v1.subscriptions.list(
            params={"customer": customer_id, "price": price_id, "status": "all", "limit": 100}).data
        live = [subscription for subscription in subscriptions if subscription.status not in ENDED_SUBSCRIPTION_STATUSES]
        if live:
            return live[0]  # the newest: Stripe lists newest first
        params = {"customer": customer_id, "items": [{"price": price_id}], "metadata": {"organization_id": str(organization_id)}}
        invoiced_until = max((_invoiced_until(subscription, price_id) for subscription in subscriptions), default=0)
        if invoiced_until:
            # After an ended subscription, from where its invoices stopped (`_invoiced_until`): what it invoiced is
            # not billed twice, and what it did not is billed. NOTE: not from the day of the usage pushed now, as
            # before: a subscription that ended before midnight and was replaced after it left the usage sent to it
            # between its end and midnight (its webhook late) billed by no invoice.
            params["backdate_start_date"] = invoiced_until
        elif oldest_hour is not None:
            # Usage rolled up before the subscription existed is billed only if the subscription starts
            # before it. NOTE: the day, not the second, so that a retry from another worker sends the
            # same parameters with the same idempotency key, as Stripe requires.
            oldest_event_at = datetime.fromtimestamp(event_timestamp(oldest_hour), tz=UTC)
            params["backdate_start_date"] = int(oldest_event_at.replace(hour=0, minute=0, second=0, microsecond=0)
                                                .timestamp())
        return stripe_client().v1.subscriptions.create(params=params, options=options)

    subscription = call_stripe(find_else_create, what="subscription create",
                               key=_account_key(account, f"subscription-org-{organization_id}"))
    # NOTE: with its start, in one conditional update: when two workers raced, the first stored wins whole. No run is
    # ending a subscription just stored: a mark left by one that ended the one before (`_subscription_ending`) goes.
    BillingAccount.objects.filter(pk=account.pk, stripe_subscription_id="").update(
        stripe_subscription_id=subscription.id,
        stripe_subscription_started_at=datetime.fromtimestamp(subscription.start_date, tz=UTC),
        subscription_ending_at=None)
    return BillingAccount.objects.values_list("stripe_subscription_id", flat=True).get(pk=account.pk)


def _invoiced_until(subscription, usage_price_id: str) -> int:
    """Up to when the ended `subscription`'s usage is invoiced: where the next subscription starts, so that each
    meter event is billed by one invoice, neither by none nor by two.

    One that ended at the end of its period (cancelled at the period's end) bills that period's usage in a final
    invoice then, as Stripe documents: up to its end, whether that invoice is made yet or not, and void or not (a void
    one of a live customer is written off: `billing.models.WRITTEN_OFF_INVOICE_STATUS`). One that ended within its
    period (cancelled at once in the Dashboard or the API, or by Stripe after failed payments) bills what it had not
    invoiced only if it was cancelled with `invoice_now`, which defaults to false (Stripe makes that invoice with the
    cancellation); without it, Stripe discards that usage. So its invoices are read, and it is invoiced up to the
    latest end of the periods of the usage price's lines (`usage_price_id`), all of them (`usage_price_lines`: a line
    that states no price is placed by the subscription item or invoice item that made it), of those
    that settle their period (`_settles_its_period`: they bill it, or are written off), or, with none, its start (a
    backdated subscription ended before its first invoice). Before, the next subscription always started at the ended
    one's end: the usage of the ended period was billed by no invoice.

    NOTE: a line's period that ends after the subscription does (a first invoice's line for the period ahead) bills
    no usage of it, and is not counted. Nor is a line of another price: a one-off invoice item's period is the moment
    it was made, and one made after the period's usage started the next subscription then, the usage in between
    billed by no invoice; nor only the lines an invoice shows (its first 10), which may not hold the usage line at all.
    Each read is tried once (`attempts=1`): it runs within the subscription's create, which `call_stripe` retries whole.
    """
    ended_at = subscription.ended_at or 0
    if subscription.status not in ENDED_SUBSCRIPTION_STATUSES or not ended_at:
        return 0
    period_ends = [item.current_period_end for item in subscription["items"].data]
    if subscription.cancel_at_period_end or (period_ends and ended_at >= max(period_ends)):
        return ended_at
    invoices = stripe_client().v1.invoices.list(params={"subscription": subscription.id, "limit": 100}).data
    ends = []
    for invoice in invoices:
        if not _settles_its_period(invoice):
            continue
        lines = usage_price_lines(invoice.to_dict(), usage_price_id, attempts=1, subscription=subscription.to_dict())
        if lines is None:  # NOTE: a guess either way bills usage twice or never: the push fails, visibly, and retries
            raise UnknownInvoiceLines(f"invoice {invoice.id} has a line whose price cannot be told: where its "
                                      f"subscription {subscription.id}'s invoices stopped is not known")
        ends += [line["period"]["end"] for line in lines if line["period"]["end"] <= ended_at]
    return max(ends, default=subscription.start_date)


class UnknownInvoiceLines(Exception):
    """An ended subscription's invoice has a line whose price Stripe does not say, nor its parent
    (`usage_price_lines`): the next subscription is not made until it can be told."""


def _settles_its_period(invoice) -> bool:
    """Whether Stripe's `invoice` of a live customer settles the usage of its period: it bills it
    (`_bills_its_period`), or is void, written off (`billing.models.WRITTEN_OFF_INVOICE_STATUS`). A deleted customer's
    void invoice settles nothing: its usage goes again (`billing.services.push_again_voided`)."""
    return _bills_its_period(invoice) or invoice.status == WRITTEN_OFF_INVOICE_STATUS


def _bills_its_period(invoice) -> bool:
    """Whether Stripe's `invoice` bills the usage of its period: finalised and not void
    (`billing.models.BILLING_INVOICE_STATUSES`), or a draft that Stripe finalises itself an hour after making it
    (`auto_advance`), with that usage."""
    return invoice.status in BILLING_INVOICE_STATUSES or (
        invoice.status == "draft" and bool(invoice.to_dict().get("auto_advance")))


# --- pushing rollups ---------------------------------------------------------------------------------

def event_timestamp(hour_start, subscription_started_at=None) -> int:
    """When Stripe is told usage happened: the hour, or if it began over `LATEST_PERIOD_GRACE` ago, that long ago;
    never before the subscription it is pushed to began (`subscription_started_at`, when known).

    NOTE: a subscription bills the meter events dated within its own time. Usage of an hour before a cancelled
    subscription ended, pushed only after (its rollup closed late, or its push failed until then), went to the
    next subscription dated before that one's start (the old one's end), and the old one's final invoice was
    already made: billed by neither. Dated from the new start, it is on the new subscription's first invoice.

    NOTE: `LATEST_PERIOD_GRACE` back by PostgreSQL's clock (`database_now`), not the worker's: one 40 minutes ahead
    dated its events 10 minutes into Stripe's future, past the 5 minutes Stripe takes, and every push it made was
    refused; one behind dated a late push back past the grace of a period that ended, billed by no invoice
    (`tests/billing/test_push_claim_clock.py`)."""
    earliest = database_now() - LATEST_PERIOD_GRACE
    if subscription_started_at is not None:
        earliest = max(earliest, subscription_started_at)
    return int(max(hour_start, earliest).timestamp())


def meter_event_identifier(rollup: UsageRollup, event_name: str) -> str:
    """The `identifier` of the rollup's event for `event_name`: made of its `push_uid`, or of its id for a
    rollup made before it had one (`billing/0016`: its events may be in Stripe under that identifier already), and of
    its `push_generation` from 1 on (its events pushed again, to a new customer: `billing.services.push_again`)."""
    generation = f"-g{rollup.push_generation}" if rollup.push_generation else ""
    return f"rollup-{rollup.push_uid or rollup.pk}{generation}-{event_name.removeprefix('inferplane_')}"


def _claimable():
    """Rollups to push that no live push holds: unclaimed, or claimed over `BILLING_CLAIM_TIMEOUT_S` ago.

    NOTE: a claim is stamped and judged by PostgreSQL's clock, never a worker's: a worker 10 minutes ahead took a
    rollup another was pushing (its events sent by two at once), and a claim by one 10 minutes behind read as stale to
    every other at once."""
    stale = database_time_ago(settings.BILLING_CLAIM_TIMEOUT_S)
    return UsageRollup.objects.pushable().filter(push_held_at__isnull=True).filter(
        Q(push_claimed_at__isnull=True) | Q(push_claimed_at__lt=stale))


def claim_rollup(rollup_id: int) -> bool:
    """Take the rollup for pushing; True only for the one worker that wins it. None wins it while its organisation's
    subscription is being cancelled (`_subscription_ending`): the database refuses the claim (billing/0041)."""
    return _claimable().filter(pk=rollup_id).update(push_claimed_at=DatabaseClock()) == 1


def _unconfirmed(rollup: UsageRollup) -> list[Meter]:
    """The meters of `rollup` with a value whose event of its push generation Stripe has not confirmed
    (`MeterEventPush`). A value may be negative (an adjustment that lowers a closed hour: `billing.rollups`): Stripe
    takes negative meter events and sums them with the rest of the period, reporting a negative total as 0."""
    identifiers = [meter_event_identifier(rollup, meter.event_name) for meter in METERS]
    done = set(MeterEventPush.objects.filter(rollup=rollup, identifier__in=identifiers).values_list("event_name", flat=True))
    return [meter for meter in METERS if getattr(rollup, meter.rollup_field) != 0 and meter.event_name not in done]


def _subscription_ending(organization_id: int) -> bool:
    """Whether a run is cancelling the organisation's subscription after its close (`billing.closed_subscriptions`):
    its rollups wait until it is forgotten, then go to the next subscription.

    NOTE: read after the rollup's claim, which the run's second judgement sees: either that judgement sees the rollup
    claimed and not pushed (and waits for it), or this sees the run's mark. Read before the claim, a push that passed
    it and claimed a rollup just made, after the judgement, went to the subscription being cancelled.
    NOTE: only while the account still holds a subscription: a run marks only one it holds, and forgetting it takes
    the mark too, but a forget by a pod of the release before billing/0040 did not; that mark held every push of the
    organisation for good, no run ever coming back to an organisation without a subscription.
    NOTE: the database refuses a claim under the mark too (billing/0041's trigger, the same condition): a push of the
    release before billing/0040, which never calls this, takes no rollup then; this read catches a claim taken just
    before the mark."""
    return (BillingAccount.objects.filter(organization_id=organization_id, subscription_ending_at__isnull=False)
            .exclude(stripe_subscription_id="").exists())


def push_rollup(rollup_id: int) -> bool:
    """Push one closed rollup's meter events; True if this call finished it.

    Events go one by one in `METERS` order and a push stops at the first that fails, so at most one event of a
    rollup was ever sent without an answer: the first unconfirmed one, first sent at `push_first_tried_at`. Once
    that is over `IDENTIFIER_TRUSTED_FOR` ago, the rollup is held for an operator (`hold_for_review`). An event
    Stripe refused outright, every time it was sent, has no such clock (`_push_meter_event`)."""
    if not claim_rollup(rollup_id):
        return False
    rollup = UsageRollup.objects.get(pk=rollup_id)
    if _subscription_ending(rollup.organization_id):
        UsageRollup.objects.filter(pk=rollup_id).update(push_claimed_at=None)
        logger.info("rollup %s waits: its organisation's subscription is being cancelled after its close", rollup_id)
        return False
    try:
        due = _unconfirmed(rollup)
        # NOTE: the first try's age by PostgreSQL's clock, as it was stamped (`_push_meter_event`): by the worker's, one
        # 3 h behind sent again an event first sent 25 h before, which Stripe no longer has to refuse
        if (due and rollup.push_first_tried_at is not None
                and database_now() - rollup.push_first_tried_at > IDENTIFIER_TRUSTED_FOR):
            hold_for_review(rollup, due[0])
            return False
        customer_id = ensure_customer(rollup.organization_id)
        subscription_id = ensure_subscription(rollup.organization_id)  # also creates the meters and the price
        started_at = _subscription_start(rollup.organization_id, subscription_id)
        timestamp = event_timestamp(rollup.hour_start, started_at)
        generation = rollup.push_key_generation
        for meter in due:
            generation = _push_meter_event(rollup, meter, getattr(rollup, meter.rollup_field), customer_id, timestamp,
                                           generation)
    except HeldAsDuplicate:
        return False
    except Exception as exc:
        UsageRollup.objects.filter(pk=rollup_id).update(push_claimed_at=None, push_error=str(exc)[:300])
        raise
    with transaction.atomic():
        # NOTE: under the account's lock, which `services.record_customer_deleted` takes first: either it sees the
        # events recorded above, or this sees the customer gone, and the events it took go again unless the deleted
        # customer's invoices bill them, as the deletion decides for those it sees (`push_again_uninvoiced`). Before,
        # they went again whatever: usage its finalised invoice billed was billed by the next customer too.
        current = BillingAccount.objects.select_for_update().filter(organization_id=rollup.organization_id)
        this_push = UsageRollup.objects.filter(pk=rollup_id, push_generation=rollup.push_generation)
        if (current.values_list("stripe_customer_id", flat=True).first() != customer_id
                and services.push_again_uninvoiced(this_push, customer_id)):
            return False
        # NOTE: failures for unknown invoice lines count in a row (`_count_unknown_lines`): a push that got through
        # starts the count again.
        return this_push.filter(pushed_at__isnull=True).update(
            pushed_at=DatabaseClock(), push_claimed_at=None, push_error="", num_unknown_lines_failures=0) == 1


def hold_for_review(rollup: UsageRollup, unknown: Meter) -> None:
    """Stop pushing `rollup` until an operator says whether Stripe has its event `unknown` (`release_held`,
    `confirm_held`: the admin's actions on usage rollups, after a look at the customer's meter events in Stripe)."""
    identifier = meter_event_identifier(rollup, unknown.event_name)
    logger.error("rollup %s held: its meter event %s (value %s) was first sent at %s and Stripe's answer never came; "
                 "sent again past Stripe's duplicate window it could bill twice. Look for it in Stripe, then release "
                 "or confirm the rollup in the admin", rollup.pk, identifier, getattr(rollup, unknown.rollup_field),
                 rollup.push_first_tried_at)
    UsageRollup.objects.filter(pk=rollup.pk).update(
        push_claimed_at=None, push_held_at=DatabaseClock(),
        push_error=f"held: is {identifier} in Stripe? unanswered since {rollup.push_first_tried_at:%Y-%m-%d %H:%M} UTC"[:300])


class HeldAsDuplicate(Exception):
    """Stripe refused a meter event as a duplicate of one this database never sent (`hold_duplicate`)."""


def hold_duplicate(rollup: UsageRollup, meter: Meter) -> None:
    """Stop pushing `rollup`: Stripe refused its event for `meter` as a duplicate, yet this database remembers no
    earlier try of it (`_push_meter_event`). The database went back in time (a point-in-time restore, a failover to a
    replica that was behind) past a push of the rollup, which was made again since, from the usage there now; what
    Stripe holds under its identifiers is what was sent then, which may be less (rows of the hour that reached the
    ledger again after the rewind). Its `push_error` names its events not recorded yet and their values: an operator
    compares them with Stripe's, then confirms the rollup (`confirm_held`: the same; every event named is recorded as
    accepted) or cancels its events in Stripe and sends it under new identifiers (`send_held_as_new`: Stripe has less,
    within `METER_EVENT_CANCEL_WINDOW` of its hour's end: `held_past_cancel_window`), or sends the difference between
    the ledger's values and Stripe's, either way, negative ones included (`send_held_difference`).

    NOTE: before, the refusal was recorded as Stripe accepting the rollup's value and the rollup marked pushed: what it
    held beyond the events of before the rewind was billed by nobody (the rollups sum to the ledger, so no adjustment
    ever came)."""
    values = ", ".join(f"{due.event_name.removeprefix('inferplane_')} {getattr(rollup, due.rollup_field)}"
                       for due in _unconfirmed(rollup))
    events = meter_event_identifier(rollup, "*")
    logger.error("rollup %s held: Stripe refused its meter event %s as a duplicate of one this database has no record "
                 "of sending (restored or failed over past its push?). Compare %s with Stripe's %s, then confirm the "
                 "rollup, cancel its events in Stripe and send it as new (within a day of its hour's end), or send "
                 "the difference (Stripe's values as they are, negative ones too), in the admin",
                 rollup.pk, meter_event_identifier(rollup, meter.event_name), values, events)
    error = f"held: {events} {_DUPLICATE_HOLD}: does Stripe have {values}?"[:300]
    UsageRollup.objects.filter(pk=rollup.pk).update(push_claimed_at=None, push_held_at=DatabaseClock(), push_error=error)
    # NOTE: audited as the unknown-lines hold is (`_count_unknown_lines`): before, only the log line and `push_held_at`
    # told of it, and a rewind holding dozens of rollups was easy to miss.
    record_audit(SYSTEM, Organization.objects.get(pk=rollup.organization_id), "billing.push_held_duplicate", None,
                 rollups=[rollup.pk], reason=error)


# Stripe cancels a meter event (a meter event adjustment) only within this long of receiving it.
METER_EVENT_CANCEL_WINDOW = timedelta(hours=24)
# How long a rollup's hour is: Stripe receives its events no earlier than its `hour_start` and this.
ROLLUP_HOUR = timedelta(hours=1)
_DUPLICATE_HOLD = "refused as a duplicate of a send this database does not remember"


def held_as_duplicate(rollups):
    """Those of `rollups` held as duplicates (`hold_duplicate`) and not pushed since."""
    return rollups.filter(push_held_at__isnull=False, pushed_at__isnull=True, push_error__contains=_DUPLICATE_HOLD)


def held_past_cancel_window(rollups, *, now: datetime | None = None):
    """Those of `rollups` held as duplicates (`hold_duplicate`) whose events in Stripe may no longer be cancelled:
    Stripe received them no earlier than their rollup's hour ended (`hour_start` + `ROLLUP_HOUR`), and that is over
    `METER_EVENT_CANCEL_WINDOW` ago.

    NOTE: not the hold's time (`push_held_at`), as before: Stripe received them at the push before the database went
    back, hours or days before the hold, so the window may have closed long before a day after the hold. The end of
    the hour is a lower bound of the receipt: the window is certainly open only before it is a day old.

    NOTE: a day by PostgreSQL's clock (`database_now`), not the web pod's: one 30 minutes behind sent as new a rollup
    whose window had closed 10 minutes before."""
    return held_as_duplicate(rollups).filter(
        hour_start__lte=(now or database_now()) - METER_EVENT_CANCEL_WINDOW - ROLLUP_HOUR)


def _not_in_difference(rollups):
    """Those of `rollups` no "send the difference" has begun on (`difference_started_at`): what such a run sends, or
    may have sent, is in no record yet, and sending it as new, again, or confirming it billed that twice or never."""
    return rollups.filter(difference_started_at__isnull=True)


def send_held_as_new(rollups, *, actor: Actor = SYSTEM) -> int:
    """Push these rollups, held as duplicates (`hold_duplicate`), again from the start under new identifiers
    (`services.push_again`), once an operator has cancelled their events in Stripe (a meter event adjustment, within
    `METER_EVENT_CANCEL_WINDOW` of Stripe's receipt): Stripe held less than them. Returns how many.

    NOTE: never one whose hour ended longer ago than that window (`held_past_cancel_window`): its events in Stripe may
    no longer be cancelled, and its whole value sent again billed what Stripe had twice; nor one a "send the
    difference" has begun on (`_not_in_difference`). Stripe's part of such a rollup stays; the rest goes as its
    difference (`send_held_difference`). Audited (`billing.held_usage_sent_as_new`), by the operator as `actor`."""
    now = database_now()

    def due(candidates):
        return _not_in_difference(held_as_duplicate(candidates)).exclude(
            pk__in=held_past_cancel_window(candidates, now=now).values("pk"))

    return _decide_held_by_operator(actor, "billing.held_usage_sent_as_new", due(rollups),
                                    lambda rollup: services.push_again(due(UsageRollup.objects.filter(pk=rollup.pk))))


def _decide_held_by_operator(actor: Actor, action: str, candidates, decide) -> int:
    """`decide` (a rollup → 1 if it changed it, else 0: its own conditional update) each of `candidates`, audited as
    `action` with the rollups it changed, one event per organisation, in one transaction with the changes. Returns how
    many it changed.

    NOTE: an operator's "Stripe has it" or "send it again" decides what a customer is billed; before, only the Django
    admin's own history (its `LogEntry`) said who decided it, and a call from elsewhere left no trace."""
    decided: dict[int, list[int]] = {}
    with transaction.atomic():
        for rollup in candidates.order_by("pk"):
            if decide(rollup):
                decided.setdefault(rollup.organization_id, []).append(rollup.pk)
        for organization in Organization.objects.filter(pk__in=list(decided)).order_by("pk"):
            record_audit(actor, organization, action, None, rollups=decided[organization.pk])
    return sum(len(pks) for pks in decided.values())


DIFFERENCE_AUDIT_ACTION = "billing.push_held_difference"


class DifferenceRefused(ValueError):
    """`send_held_difference` sent nothing: its message says why and what to do instead."""


def difference_identifier(rollup: UsageRollup, event_name: str) -> str:
    """The `identifier` of the event that sends what Stripe lacks of `rollup`'s event for `event_name`
    (`send_held_difference`): `rollup-<uuid>[-g<n>]-difference-<meter>`, never one of a push's."""
    return meter_event_identifier(rollup, f"difference-{event_name.removeprefix('inferplane_')}")


# The largest value, either way, of a meter event this database records (`MeterEventPush.value`, a bigint).
MAX_METER_EVENT_VALUE = 2**63 - 1


def held_difference_meters(rollup: UsageRollup) -> list[Meter]:
    """The meters an operator reads Stripe's value of for a rollup held as a duplicate: those its hold names
    (`hold_duplicate`: its events not recorded as accepted)."""
    return _unconfirmed(rollup)


@dataclass(slots=True, frozen=True)
class _Difference:
    """What a "send the difference" sends (`UsageRollup.difference_pending`), fixed by its first run."""

    stripe_has: dict[str, int]  # event name -> Stripe's value, as the operator entered it
    customer_id: str  # the customer Stripe's events are on, and the difference goes to
    timestamp: int  # the events' date (`event_timestamp`): the same parameters under the same idempotency keys


def send_held_difference(actor, rollup_id: int, stripe_has: dict[str, int], *, stripe_customer_id: str,
                         pending_in_stripe: bool | None = None) -> int:
    """Staff: bill what Stripe lacks of a rollup held as a duplicate (`hold_duplicate`), or take back what it has
    beyond the ledger, once an operator has read, in Stripe, the value of each event its hold names (`stripe_has`:
    event name -> value; 0 for one Stripe does not have) and the customer they are on (`stripe_customer_id`). For
    each meter, ours less Stripe's, where not 0, goes as one new meter event (`difference_identifier`, the same on
    every run: Stripe refuses it twice, and one recorded is not sent again), Stripe's own events are recorded as
    accepted at Stripe's values (`MeterEventPush`), the rollup is marked pushed, and it is audited
    (`DIFFERENCE_AUDIT_ACTION`). Returns 1, or 0 when another run marked it first.
    Values are signed both ways: an adjustment rollup's are negative where it lowers a meter (`billing.rollups`), and
    so is what Stripe has of it; Stripe holding more than the ledger sends a negative difference, a meter event that
    Stripe takes and sums with the period like an adjustment's (`push_pending_rollups`).

    The first run claims the rollup under its row lock and commits what it sends (`UsageRollup.difference_started_at`,
    `difference_pending`) before calling Stripe: "send as new", "send it again" and "confirm" refuse it from then on,
    and every later run sends the same (other values are refused). One run sends at a time, and "abandon" waits for
    it (`_claim_difference`). Events go one by one and a run stops at the first
    that fails, so at most one (the first not recorded) may be in Stripe without a record. A run again within
    `IDENTIFIER_TRUSTED_FOR` of the claim sends it again (Stripe refuses its identifier if it has it); later Stripe may
    not, and the run is refused until the operator says whether Stripe has that event (`pending_in_stripe`: True, it
    is recorded as sent; False, it is sent again, under a claim begun anew).

    For a rollup whose events in Stripe can no longer be cancelled (`held_past_cancel_window`), or any whose events an
    operator would rather not cancel. Raises `DifferenceRefused`, sending nothing, for a rollup not held as a duplicate,
    a value missing or not a whole number, or Stripe's events on a customer that is not the organisation's now (they
    were billed, or not, by that customer's invoices: the difference sent to today's is billed by nobody, or by
    another). A Stripe failure raises as it is; what was sent is recorded, and running it again sends only the rest.

    NOTE: before, a negative value and one above ours were refused, the latter with advice to issue a credit note in
    Stripe for the excess, then confirm: a negative adjustment held after a rewind (its values below 0, Stripe's too)
    had no way out past the cancel window but "confirm", which recorded the ledger's values as Stripe's (a late row's
    usage billed by nobody); and an excess went to a credit note by hand, outside the meters, where a negative meter
    event now takes it back in the customer's open period, as an adjustment's does (`tests/billing/test_held_negative_difference.py`)."""
    customer_id = BillingAccount.objects.for_organization(
        UsageRollup.objects.values_list("organization_id", flat=True).get(pk=rollup_id)).stripe_customer_id
    if not customer_id:
        raise DifferenceRefused("the organisation has no Stripe customer: Stripe's events of this rollup are on one it "
                                "no longer has; nothing sent")
    subscription_id = ensure_subscription(
        UsageRollup.objects.values_list("organization_id", flat=True).get(pk=rollup_id))
    rollup, due, difference, sending_since = _claim_difference(rollup_id, stripe_has, stripe_customer_id.strip(),
                                                               customer_id, subscription_id, pending_in_stripe)
    ours = {meter.event_name: getattr(rollup, meter.rollup_field) for meter in due}
    sent = set(MeterEventPush.objects.filter(
        identifier__in=[difference_identifier(rollup, name) for name in ours]).values_list("identifier", flat=True))
    try:
        for meter in due:
            value = ours[meter.event_name] - difference.stripe_has[meter.event_name]
            if value != 0 and difference_identifier(rollup, meter.event_name) not in sent:
                # NOTE: each event only while this run still holds the claim (`_claim_difference`), renewed by a
                # conditional update: once another run took it over (this one's stale) none is sent, and nothing
                # more is recorded or marked by this run.
                renewed = database_now()
                if not UsageRollup.objects.filter(pk=rollup.pk, push_claimed_at=sending_since,
                                                  difference_started_at__isnull=False).update(push_claimed_at=renewed):
                    return 0
                sending_since = renewed
                _send_difference(rollup, meter, value, difference.customer_id, difference.timestamp)
    except BaseException:
        UsageRollup.objects.filter(pk=rollup.pk, push_claimed_at=sending_since).update(push_claimed_at=None)
        raise
    with transaction.atomic():
        BillingAccount.objects.select_for_update().filter(organization_id=rollup.organization_id).first()
        marked = held_as_duplicate(UsageRollup.objects.filter(pk=rollup.pk, difference_started_at__isnull=False)).update(
            pushed_at=DatabaseClock(), push_held_at=None, push_claimed_at=None, push_first_tried_at=None, push_error="",
            num_unknown_lines_failures=0, difference_started_at=None, difference_pending=None)
        if not marked:  # NOTE: nothing recorded of a rollup another run marked (it recorded its own)
            return 0
        for meter in due:
            if difference.stripe_has[meter.event_name] != 0:
                MeterEventPush.objects.get_or_create(
                    identifier=meter_event_identifier(rollup, meter.event_name),
                    defaults={"rollup": rollup, "event_name": meter.event_name,
                              "value": difference.stripe_has[meter.event_name],
                              "push_generation": rollup.push_generation, "stripe_customer_id": difference.customer_id})
        record_audit(actor, Organization.objects.get(pk=rollup.organization_id), DIFFERENCE_AUDIT_ACTION, None,
                     rollups=[rollup.pk], stripe_has=difference.stripe_has, stripe_customer_id=difference.customer_id,
                     sent={name: value - difference.stripe_has[name] for name, value in ours.items()})
    return marked


def _claim_difference(rollup_id: int, stripe_has: dict[str, int], stripe_customer_id: str, customer_id: str,
                      subscription_id: str, pending_in_stripe: bool | None
                      ) -> tuple[UsageRollup, list[Meter], _Difference, datetime]:
    """Claim the rollup for `send_held_difference`, in a transaction of its own under its row lock, committed before
    any of its events is sent; the rollup, its meters, what the run sends (fixed by the first run) and the moment this
    run's claim to send was taken (`push_claimed_at`, unused while a rollup is held). Raises `DifferenceRefused`.

    NOTE: one run sends at a time, and "abandon" (`abandon_held_difference`) is refused while one does: before, a run
    sending (its lost event truthfully answered "not in Stripe") and an abandon answered the same at the same moment
    both went through, and the run's event was in Stripe and recorded after the claim was cleared (the next run, with
    other values, took it for its own). A run that died holds it at most `BILLING_CLAIM_TIMEOUT_S`."""
    with transaction.atomic():
        rollup = held_as_duplicate(UsageRollup.objects.select_for_update().filter(pk=rollup_id)).first()
        if rollup is None:
            raise DifferenceRefused(f"rollup {rollup_id} is not held as a duplicate (sent, confirmed or released "
                                    "since?)")
        # NOTE: the claim's and the run's start by PostgreSQL's clock, as the ordinary push's claim (`_claimable`):
        # by the web pod's, one `BILLING_CLAIM_TIMEOUT_S` ahead took over (or abandoned) a run sending at that moment,
        # and one 3 h behind read a run begun 25 h before as 22 h old and sent its unanswered event again.
        now = database_now()
        _refuse_while_sending(rollup, now)
        due = held_difference_meters(rollup)
        ours = {meter.event_name: getattr(rollup, meter.rollup_field) for meter in due}
        missing = [name for name, value in ours.items() if type(stripe_has.get(name)) is not int
                   or max(abs(stripe_has[name]), abs(value - stripe_has[name])) > MAX_METER_EVENT_VALUE]
        if missing:
            raise DifferenceRefused(f"Stripe's value of {', '.join(missing)} is missing, not a whole number, or it "
                                    f"or its difference from the ledger's is beyond ±{MAX_METER_EVENT_VALUE}")
        entered = {name: stripe_has[name] for name in ours}
        if any(entered.values()) and stripe_customer_id != customer_id:
            raise DifferenceRefused(
                f"Stripe's events of this rollup are on the customer {stripe_customer_id or '(none entered)'}, and the "
                f"organisation's customer is {customer_id}: the difference would go to another customer than the "
                "events it completes, billed by neither's invoices as one. Nothing sent; settle it in Stripe by hand")
        recorded_on = set(MeterEventPush.objects.filter(rollup=rollup, push_generation=rollup.push_generation)
                          .exclude(stripe_customer_id="").values_list("stripe_customer_id", flat=True))
        if recorded_on - {customer_id}:
            raise DifferenceRefused(f"this rollup's events were sent to the customer {', '.join(sorted(recorded_on))}, "
                                    f"not the organisation's now ({customer_id}): nothing sent; settle it in Stripe")
        if rollup.difference_started_at is None:
            difference = _Difference(entered, customer_id, event_timestamp(
                rollup.hour_start, _subscription_start(rollup.organization_id, subscription_id)))
            UsageRollup.objects.filter(pk=rollup.pk).update(
                difference_started_at=now, push_claimed_at=now,
                difference_pending={"stripe_has": difference.stripe_has, "customer_id": customer_id,
                                    "timestamp": difference.timestamp})
            return rollup, due, difference, now
        difference = _Difference(**rollup.difference_pending)
        if entered != difference.stripe_has or difference.customer_id != customer_id:
            raise DifferenceRefused(
                f"a run begun at {rollup.difference_started_at:%Y-%m-%d %H:%M} UTC sends the difference from Stripe's "
                f"values {difference.stripe_has} to the customer {difference.customer_id}, and may have sent some of "
                "it: enter the same values (what a difference sends is fixed once begun); nothing sent")
        unanswered = _first_unrecorded_difference(rollup, due, difference)
        if unanswered is not None and now - rollup.difference_started_at > IDENTIFIER_TRUSTED_FOR:
            identifier, value, meter = unanswered
            if pending_in_stripe is None:
                raise DifferenceRefused(
                    f"a run begun at {rollup.difference_started_at:%Y-%m-%d %H:%M} UTC may have sent {identifier} "
                    f"(value {value}) without recording Stripe's answer, and Stripe may no longer refuse it as a "
                    "duplicate (a day on): look it up in Stripe, then say whether Stripe has it; nothing sent")
            if pending_in_stripe:
                _record_accepted(rollup, meter, identifier, value, difference.customer_id, difference.timestamp, None)
            # NOTE: the clock begins anew: the next event sent is first sent now.
            UsageRollup.objects.filter(pk=rollup.pk).update(difference_started_at=now)
        UsageRollup.objects.filter(pk=rollup.pk).update(push_claimed_at=now)
        return rollup, due, difference, now


def _refuse_while_sending(rollup: UsageRollup, now: datetime) -> None:
    """`DifferenceRefused` while a run of `rollup`'s difference holds its claim to send (`_claim_difference`), unless
    that run has been silent for `BILLING_CLAIM_TIMEOUT_S` (it died). Under the rollup's row lock; `now` is PostgreSQL's
    clock (`database_now`), as the claim is stamped."""
    if rollup.push_claimed_at is not None and now - rollup.push_claimed_at < timedelta(
            seconds=settings.BILLING_CLAIM_TIMEOUT_S):
        raise DifferenceRefused(
            f"a run of this rollup's difference is sending it now (since {rollup.push_claimed_at:%H:%M:%S} UTC): "
            f"nothing changed; look at the rollup again once it ends (a run that died holds it at most "
            f"{settings.BILLING_CLAIM_TIMEOUT_S:g} s)")


ABANDON_DIFFERENCE_AUDIT_ACTION = "billing.abandon_held_difference"


def abandon_held_difference(actor, rollup_id: int, *, difference_in_stripe: bool | None = None) -> int:
    """Staff: clear a "send the difference" begun on a rollup held as a duplicate that cannot be finished (begun with
    a value entered wrong, or its organisation's customer changed since): its claim (`difference_started_at`,
    `difference_pending`) goes, audited (`ABANDON_DIFFERENCE_AUDIT_ACTION`), and the rollup stays held as before the
    run began, for any held action again ("send the difference" with the right values, confirm, release, send as
    new). Returns 1, or 0 when none is begun on it (finished or abandoned since).

    NOTE: only where no difference event was sent: a difference event's identifier is the same whatever its value
    (`difference_identifier`), so one in Stripe would be taken, by the next run, as having sent that run's value.
    Raises `DifferenceRefused` where one is recorded, and where one may be in Stripe without its answer recorded (a
    run stops at the first that fails: `_first_unrecorded_difference`) until the operator, having looked it up in
    Stripe, says it is not (`difference_in_stripe` False)."""
    with transaction.atomic():
        rollup = UsageRollup.objects.select_for_update().filter(pk=rollup_id, difference_started_at__isnull=False,
                                                                 pushed_at__isnull=True).first()
        if rollup is None:
            return 0
        _refuse_while_sending(rollup, database_now())  # NOTE: one winner, a run or this (`_claim_difference`)
        recorded = sorted(MeterEventPush.objects.filter(identifier__in=[
            difference_identifier(rollup, meter.event_name) for meter in METERS]).values_list("identifier", flat=True))
        if recorded:
            raise DifferenceRefused(f"Stripe has this rollup's difference event {', '.join(recorded)}: the difference "
                                    "cannot be abandoned; finish it (the same values again)")
        unanswered = _first_unrecorded_difference(rollup, held_difference_meters(rollup),
                                                  _Difference(**rollup.difference_pending))
        if unanswered is not None and difference_in_stripe is not False:
            identifier, value, _meter = unanswered
            if difference_in_stripe is None:
                raise DifferenceRefused(
                    f"the run begun at {rollup.difference_started_at:%Y-%m-%d %H:%M} UTC may have sent {identifier} "
                    f"(value {value}) without recording Stripe's answer: look it up in Stripe, then say whether "
                    "Stripe has it; nothing changed")
            raise DifferenceRefused(f"Stripe has {identifier}: the difference cannot be abandoned; finish it (the "
                                    "same values again, answering that Stripe has it)")
        UsageRollup.objects.filter(pk=rollup.pk).update(difference_started_at=None, difference_pending=None,
                                                        push_claimed_at=None)
        record_audit(actor, Organization.objects.get(pk=rollup.organization_id), ABANDON_DIFFERENCE_AUDIT_ACTION,
                     None, rollups=[rollup.pk], begun_at=rollup.difference_started_at.isoformat(),
                     abandoned=rollup.difference_pending, difference_in_stripe=difference_in_stripe)
    return 1


def _first_unrecorded_difference(rollup: UsageRollup, due: list[Meter],
                                 difference: _Difference) -> tuple[str, int, Meter] | None:
    """(identifier, value, meter) of the first difference event of `rollup` with a value and no record: the one a run
    may have sent without its answer recorded (a run sends them in order and stops at the first that fails)."""
    for meter in due:
        value = getattr(rollup, meter.rollup_field) - difference.stripe_has[meter.event_name]
        identifier = difference_identifier(rollup, meter.event_name)
        if value != 0 and not MeterEventPush.objects.filter(identifier=identifier).exists():
            return identifier, value, meter
    return None


def _send_difference(rollup: UsageRollup, meter: Meter, value: int, customer_id: str, timestamp: int) -> None:
    """Send one difference event (`send_held_difference`) and record it. Stripe refusing its identifier as a duplicate
    says an earlier run sent it (with the same value: a difference's values are fixed once begun): recorded as
    accepted, not sent again."""
    identifier = difference_identifier(rollup, meter.event_name)
    created = None
    try:
        created = call_stripe(
            lambda options: stripe_client().v1.billing.meter_events.create(
                params=_meter_event_params(meter, identifier, value, customer_id, timestamp), options=options),
            what="meter event (difference)", key=IdempotencyKey(identifier)).to_dict().get("created")
    except stripe.InvalidRequestError as exc:
        if exc.code not in DUPLICATE_EVENT_CODES:
            raise
        logger.info("stripe already has meter event %s", identifier)
    _record_accepted(rollup, meter, identifier, value, customer_id, timestamp, created)


def release_held(rollups, *, actor: Actor = SYSTEM) -> int:
    """Push these held rollups on: Stripe does not have the event each was held for (it is sent again, its
    duplicate window begins anew). Never one a "send the difference" has begun on (`_not_in_difference`). Audited
    (`billing.held_usage_released`), by the operator as `actor`."""

    def held(candidates):
        return _not_in_difference(candidates).filter(push_held_at__isnull=False, pushed_at__isnull=True)

    return _decide_held_by_operator(actor, "billing.held_usage_released", held(rollups), lambda rollup: held(
        UsageRollup.objects.filter(pk=rollup.pk)).update(push_held_at=None, push_first_tried_at=None, push_error="",
                                                          num_unknown_lines_failures=0))


def confirm_held(rollups, *, actor: Actor = SYSTEM) -> int:
    """Push these held rollups on: Stripe has the event each was held for (recorded as accepted; the rollup's
    later events, never sent, go at the next push). Only a rollup held for want of Stripe's answer to an event
    (`hold_for_review`: its `push_error` names that event's identifier); one held for an invoice line whose price
    cannot be told (`_count_unknown_lines`) sent nothing to confirm, and is skipped (`release_held` retries it).

    NOTE: before, such a rollup was confirmed too: a meter event Stripe never received was recorded as accepted (its
    usage billed by nobody), and its failure counter, kept, held it again after one more run.

    Audited (`billing.held_usage_confirmed`), by the operator as `actor`: what it records as in Stripe is billed by
    nothing else."""
    return _decide_held_by_operator(actor, "billing.held_usage_confirmed", _not_in_difference(rollups).filter(
        push_held_at__isnull=False, pushed_at__isnull=True, num_unknown_lines_failures__lt=UNKNOWN_LINES_HOLD_AFTER),
        _confirm_held_rollup)


def _confirm_held_rollup(rollup: UsageRollup) -> int:
    """`confirm_held` of one rollup: 1 if it confirmed it, else 0."""
    due = _unconfirmed(rollup)
    duplicate = _DUPLICATE_HOLD in rollup.push_error  # `hold_duplicate`: every event it names
    if due and not duplicate and meter_event_identifier(rollup, due[0].event_name) not in rollup.push_error:
        return 0  # not held for an answer to this event: nothing of it is known to be in Stripe
    for meter in due if duplicate else due[:1]:
        MeterEventPush.objects.get_or_create(
            identifier=meter_event_identifier(rollup, meter.event_name),
            defaults={"rollup": rollup, "event_name": meter.event_name, "value": getattr(rollup, meter.rollup_field),
                      "push_generation": rollup.push_generation,
                      "stripe_customer_id": BillingAccount.objects.filter(organization_id=rollup.organization_id)
                      .values_list("stripe_customer_id", flat=True).first() or ""})
    return _not_in_difference(UsageRollup.objects.filter(pk=rollup.pk, push_held_at__isnull=False)).update(
        push_held_at=None, push_first_tried_at=None, push_error="", num_unknown_lines_failures=0)


def _subscription_start(organization_id: int, subscription_id: str) -> datetime | None:
    """When the organisation's subscription began: as stored with it, or, for one stored before its start was kept
    (`billing/0009`), read from Stripe once and stored (only while it is still the account's subscription)."""
    started_at = BillingAccount.objects.values_list("stripe_subscription_started_at", flat=True).get(
        organization_id=organization_id, stripe_subscription_id=subscription_id)
    if started_at is None:
        subscription = call_stripe(lambda _options: stripe_client().v1.subscriptions.retrieve(subscription_id),
                                   what="subscription read")
        started_at = datetime.fromtimestamp(subscription.start_date, tz=UTC)
        BillingAccount.objects.filter(organization_id=organization_id, stripe_subscription_id=subscription_id,
                                      stripe_subscription_started_at__isnull=True).update(
            stripe_subscription_started_at=started_at)
    return started_at


def _push_meter_event(rollup: UsageRollup, meter: Meter, value: int, customer_id: str, timestamp: int,
                      generation: int) -> int:
    """Send one meter event under the rollup's key `generation`; returns the generation it ended at.

    NOTE: the `identifier` never changes, whatever the idempotency key: it is what keeps an event Stripe
    recorded despite a server error from counting twice (Stripe refuses it, for at least 24 h).

    The rollup's `push_first_tried_at` is set before the event is first sent (a worker may die before its answer)
    and cleared once Stripe confirms it. NOTE: also cleared when this call started it and Stripe refused every try
    outright (`_refused_outright`): nothing of the event is in Stripe, so there is no answer to wait for. Before,
    such a refusal ran the clock as a lost answer does, and a key rolled or revoked over a weekend held every rollup
    for an operator. An earlier try's clock stays, whatever Stripe answers now: that try may be in Stripe.
    """
    identifier = meter_event_identifier(rollup, meter.event_name)
    key = _generation_key(UsageRollup, rollup.pk, "push_key_generation", identifier, generation)
    first_tried_at = database_now()
    started_clock = UsageRollup.objects.filter(pk=rollup.pk, push_first_tried_at__isnull=True).update(
        push_first_tried_at=first_tried_at) == 1
    refusals: list[bool] = []  # for each try that failed: whether Stripe refused it outright
    # For each try that failed: whether it did nothing in Stripe (refused outright, or its key refused as another
    # request's: sent before with other parameters, or in use by a try that started after this call's clock).
    did_nothing: list[bool] = []

    def send(options):
        try:
            return stripe_client().v1.billing.meter_events.create(
                params=_meter_event_params(meter, identifier, value, customer_id, timestamp), options=options)
        except BaseException as exc:
            refusals.append(isinstance(exc, stripe.StripeError) and _refused_outright(exc))
            did_nothing.append(refusals[-1] or isinstance(exc, stripe.IdempotencyError))
            raise

    created = None  # when Stripe received it, as it answers: unknown when it refuses it as a duplicate
    try:
        created = call_stripe(send, what="meter event", key=key).to_dict().get("created")
    except stripe.StripeError as exc:
        if not (isinstance(exc, stripe.InvalidRequestError) and exc.code in DUPLICATE_EVENT_CODES):
            if started_clock and all(refusals):
                UsageRollup.objects.filter(pk=rollup.pk, push_first_tried_at=first_tried_at).update(
                    push_first_tried_at=None)
            raise
        if started_clock and all(did_nothing[:-1]):
            # NOTE: no earlier try is recorded, nor did one of this call's reach Stripe: not a try of ours whose answer
            # was lost. (A key Stripe refused as sent before with other parameters says the same: an earlier push of
            # this rollup's event, of other content, that this database does not remember.)
            hold_duplicate(rollup, meter)
            raise HeldAsDuplicate(identifier) from exc
        logger.info("stripe already has meter event %s", identifier)
    _record_accepted(rollup, meter, identifier, value, customer_id, timestamp, created)
    UsageRollup.objects.filter(pk=rollup.pk).update(push_first_tried_at=None)  # confirmed: the next one's clock
    return int(key.suffix or 0)


def _meter_event_params(meter: Meter, identifier: str, value: int, customer_id: str, timestamp: int) -> dict:
    return {"event_name": meter.event_name, "identifier": identifier, "timestamp": timestamp,
            "payload": {"stripe_customer_id": customer_id, "value": str(value)}}


def _record_accepted(rollup: UsageRollup, meter: Meter, identifier: str, value: int, customer_id: str, timestamp: int,
                     created: int | None) -> None:
    """Record the meter event `identifier` as in Stripe (`MeterEventPush`), received at `created` (Stripe's clock; None:
    refused as a duplicate, when is not known)."""
    MeterEventPush.objects.get_or_create(
        identifier=identifier, defaults={"rollup": rollup, "event_name": meter.event_name, "value": value,
                                         "stripe_customer_id": customer_id, "push_generation": rollup.push_generation,
                                         "event_at": datetime.fromtimestamp(timestamp, tz=UTC),
                                         "stripe_created_at": datetime.fromtimestamp(created, tz=UTC) if created else None})


def _refused_outright(exc: stripe.StripeError) -> bool:
    """Whether Stripe answered that it did nothing with the request: its key refused (401, 403), the request refused
    as invalid (a 4xx other than the refusal of a duplicate identifier, which says Stripe has the event, or an
    idempotency error, which replays or refuses another try's request), or rate limited (429, before any work)."""
    if isinstance(exc, stripe.AuthenticationError | stripe.PermissionError | stripe.RateLimitError):
        return True
    return (isinstance(exc, stripe.InvalidRequestError) and (exc.http_status or 500) < 500
            and exc.code not in DUPLICATE_EVENT_CODES)


def push_pending_rollups(*, limit: int = 500, budget_s: float = PUSH_RUN_BUDGET_S) -> int:
    """Push closed rollups not yet pushed: those that never failed first, then those that did, oldest first
    in each, claiming no more once `budget_s` has passed (the rest wait for the next run). Returns how
    many this call finished.

    NOTE: a rollup that keeps failing costs a run its retries (seconds each): failed ones last, and the
    budget, keep them from holding up the others, or from running the task into its time limit.
    """
    if not is_configured():
        logger.info("billing sync off: STRIPE_SECRET_KEY is not set")
        return 0
    # NOTE: one run at a time. With Stripe down, each run spent its whole budget failing (~55 s of retries a
    # rollup), a new one began every minute beside it, and together they held every slot of the scheduler's
    # workers: autoscaler ticks and sweeps expired in the queue, wakes and reconciles waited behind them.
    # NOTE: the run's lock lasts `BILLING_PUSH_RUN_LOCK_S` (30 s) unless renewed, every third of that while the run
    # lives; not the task's whole time limit: a worker killed mid-run held it that long (10 minutes), and no push ran
    # meanwhile; now at most this long.
    with held_alone(PUSH_RUN_LOCK_KEY, settings.BILLING_PUSH_RUN_LOCK_S, renewed=True) as held:
        if not held:
            logger.info("a push run is still going; this one leaves the rollups to it")
            return 0
        return _push_claimable(limit=limit, budget_s=budget_s)


def _push_claimable(*, limit: int, budget_s: float) -> int:
    started = time.monotonic()
    failed_before = Case(When(push_error="", then=Value(0)), default=Value(1), output_field=IntegerField())
    rollup_ids = list(_claimable().order_by(failed_before, "hour_start", "sequence")
                      .values_list("pk", flat=True)[:limit])
    num_pushed = 0
    for index, rollup_id in enumerate(rollup_ids):
        if time.monotonic() - started > budget_s:
            logger.warning("push run out of time after %d rollups; the next run pushes the %d left",
                           index, len(rollup_ids) - index)
            break
        try:
            num_pushed += push_rollup(rollup_id)
        except (stripe.AuthenticationError, stripe.PermissionError):
            # NOTE: the key, not the rollup: every other rollup would be refused the same way, a call each, every
            # minute. The next run tries again with the key it is configured with then.
            logger.exception("Stripe refused the API key pushing rollup %s; this run pushes no more", rollup_id)
            break
        except UnknownInvoiceLines as exc:
            _count_unknown_lines(rollup_id, exc)
        except stripe.StripeError:
            logger.exception("could not push rollup %s; the next run retries it", rollup_id)
    return num_pushed


# Push runs (a minute apart) a rollup may fail for an invoice line whose price cannot be told before it is held.
UNKNOWN_LINES_HOLD_AFTER = 10


def _count_unknown_lines(rollup_id: int, exc: UnknownInvoiceLines) -> None:
    """One more push run that `rollup_id` failed for an ended subscription's invoice line whose price cannot be told
    (`UnknownInvoiceLines`); the `UNKNOWN_LINES_HOLD_AFTER`th holds it for an operator: `push_held_at`, its
    `push_error` says why, an ERROR log line and an audit event; the usage rollups' admin list (filter "push held
    at") shows it, and "send it again" (`release_held`) retries it once Stripe can tell. NOTE: before, it failed
    every run for ever, with only an ERROR line per rollup per run (an item deleted since, say, by a price swap)."""
    UsageRollup.objects.filter(pk=rollup_id).update(num_unknown_lines_failures=F("num_unknown_lines_failures") + 1)
    held = UsageRollup.objects.filter(pk=rollup_id, push_held_at__isnull=True, pushed_at__isnull=True,
                                      num_unknown_lines_failures__gte=UNKNOWN_LINES_HOLD_AFTER).update(
        push_held_at=DatabaseClock(), push_claimed_at=None,
        push_error=f"held for an operator after {UNKNOWN_LINES_HOLD_AFTER} runs: {exc}"[:300])
    if not held:
        logger.exception("could not push rollup %s; the next run retries it", rollup_id)
        return
    organization_id = UsageRollup.objects.values_list("organization_id", flat=True).get(pk=rollup_id)
    logger.error("rollup %s held after %d push runs: %s; look in Stripe, then send it again in the admin (usage "
                 "rollups, push held at)", rollup_id, UNKNOWN_LINES_HOLD_AFTER, exc)
    record_audit(SYSTEM, Organization.objects.get(pk=organization_id), "billing.push_held_unknown_invoice_lines",
                 None, rollups=[rollup_id], reason=str(exc)[:300])


# --- links for the console ----------------------------------------------------------------------------

def create_portal_link(organization_id: int, *, return_url: str) -> str:
    """A Stripe Customer Portal session where the organisation adds a payment method and sees invoices, with the
    platform's own configuration (`ensure_portal_configuration`)."""
    customer_id = ensure_customer(organization_id)
    configuration_id = ensure_portal_configuration()
    session = call_stripe(
        lambda options: stripe_client().v1.billing_portal.sessions.create(
            params={"customer": customer_id, "configuration": configuration_id, "return_url": return_url},
            options=options,
        ),
        what="portal session",
    )
    return session.url


def _portal_configuration():
    # NOTE: inactive ones too: one deactivated in the Dashboard is made active again (`ensure_portal_configuration`);
    # looked for among the active ones only, it was created again under the same idempotency key, whose answer (the
    # inactive configuration) Stripe replays for a day, and every portal session was refused meanwhile.
    configurations = stripe_client().v1.billing_portal.configurations.list(params={"limit": 100})
    return next((configuration for configuration in configurations.data
                 if (configuration.to_dict().get("metadata") or {}).get(PORTAL_CONFIGURATION_MARK)
                 == PORTAL_CONFIGURATION_VERSION), None)


def ensure_portal_configuration() -> str:
    """The id of the platform's Customer Portal configuration: found in Stripe by its metadata, else created once;
    set back if a feature it keeps off was turned on (in the Dashboard).

    NOTE: a session without one uses the account's default configuration, whatever the Dashboard says there: a
    cancellation at once (`subscription_cancel.mode`, which a portal never makes with `invoice_now`) discarded the
    period's usage, and a pause could void its invoices. The subscription is how usage is billed, made again at the
    next push, so the portal offers neither, nor a change of plan; an organisation stops by using nothing more.
    """
    configuration = _find_or_create(
        _portal_configuration,
        lambda options: stripe_client().v1.billing_portal.configurations.create(
            params={"name": "Inferplane", "features": PORTAL_FEATURES,
                    "metadata": {PORTAL_CONFIGURATION_MARK: PORTAL_CONFIGURATION_VERSION}},
            options=options,
        ),
        key=IdempotencyKey(f"portal-configuration-{PORTAL_CONFIGURATION_VERSION}"), what="portal configuration create",
    )
    features = configuration.to_dict().get("features") or {}
    offered = [name for name in PORTAL_FEATURES_OFF if (features.get(name) or {}).get("enabled")]
    inactive = not configuration.to_dict().get("active", True)
    if offered or inactive:
        logger.warning("the Customer Portal configuration %s %s; set back", configuration.id,
                       "was deactivated" if inactive else "offered " + ", ".join(offered))
        params = {"active": True, "features": {name: PORTAL_FEATURES[name] for name in PORTAL_FEATURES_OFF}}
        # NOTE: a key of its own each time: a key used before would replay the earlier answer for a day.
        configuration = call_stripe(
            lambda options: stripe_client().v1.billing_portal.configurations.update(
                configuration.id, params=params, options=options),
            what="portal configuration update", key=IdempotencyKey(f"portal-configuration-off-{secrets.token_hex(8)}"))
    return configuration.id
