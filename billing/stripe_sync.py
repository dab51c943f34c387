"""Stripe, through the official library: customers, subscriptions, Billing Meters, meter events, portal links.

Per-endpoint prices cannot be one Stripe price per token meter, so what Stripe bills is a cost
meter: each rollup's cost in micro-dollars, under one metered price of $0.000001 a unit. Each
organisation's customer gets one subscription to that price when it is first needed. The token
meters stay, for token-level detail.

Only postpaid usage is metered: prepaid usage is paid from credit (`billing.credits`), and its
rollups are never pushed (`UsageRollup.objects.pushable`). Each closed postpaid rollup becomes up to
four meter events (uncached input, cached input and output
tokens, and cost) whose `identifier` — also the idempotency key — is derived from the rollup id, so a
retry after a crash can never bill twice: Stripe deduplicates it, and `MeterEventPush` records
what was accepted so we do not even ask again. A worker claims a rollup with a conditional
update (a lease that a dead worker's successor may take over), calls Stripe with no database
transaction open, and retries 5xx, 429 and timeouts with exponential backoff and jitter.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import stripe
from django.conf import settings
from django.db import IntegrityError
from django.db.models import Q
from django.utils import timezone

from billing import services, standing
from billing.models import BillingAccount, BillingMode, MeterEventPush, StripeMeter, UsageRollup
from controlplane.accounts.models import Organization

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
    Meter("inferplane_usage_cost", "Usage (micro-dollars)", "cost_micro_dollars"),
)
COST_METER = METERS[-1]
# The one price Stripe bills by: a micro-dollar of cost meter is 0.0001 cent.
USAGE_PRICE_LOOKUP_KEY = "inferplane_usage_cost_usd_monthly"
USAGE_PRICE_UNIT_CENTS = "0.0001"
# Stripe takes meter event timestamps from the last 35 days only.
MAX_EVENT_AGE = timedelta(days=34)


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


def _is_retryable(exc: stripe.StripeError) -> bool:
    if isinstance(exc, stripe.APIConnectionError | stripe.RateLimitError):
        return True
    return isinstance(exc, stripe.APIError) and (exc.http_status or 500) >= 500


def call_stripe(request, *, what: str, attempts: int = MAX_ATTEMPTS):
    """Run `request()` (which must carry an idempotency key, or only read), retrying transient failures."""
    for attempt in range(1, attempts + 1):
        try:
            return request()
        except stripe.StripeError as exc:
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


def ensure_customer(organization_id: int) -> str:
    """The organisation's Stripe customer id, creating the customer the first time it is needed."""
    account = BillingAccount.objects.for_organization(organization_id)
    if account.stripe_customer_id:
        return account.stripe_customer_id
    organization = Organization.objects.get(pk=organization_id)
    customer = call_stripe(
        lambda: stripe_client().v1.customers.create(
            params={"name": organization.name, "metadata": {"organization_id": str(organization_id), "slug": organization.slug}},
            options={"idempotency_key": f"customer-org-{organization_id}"},
        ),
        what="customer create",
    )
    # NOTE: one statement: a customer we have just made has no payment method, known as of its creation
    # (`billing.standing`); a stored customer with no reading would count as one never read, unlimited.
    BillingAccount.objects.filter(pk=account.pk, stripe_customer_id="").update(
        stripe_customer_id=customer.id, payment_method_observed_ms=(customer.created or 1) * 1000)
    return BillingAccount.objects.values_list("stripe_customer_id", flat=True).get(pk=account.pk)


def observe_payment_method(customer_id: str, *, attempts: int = MAX_ATTEMPTS) -> bool:
    """Read from Stripe whether `customer_id` has a default payment method now, and record it. Stripe's
    `customer.*` webhooks are only the cue: they may arrive late and out of order, the customer as
    read decides (stamped before the read, so an older reading never wins). A customer deleted in
    Stripe has none."""
    observed_ms = time.time_ns() // 1_000_000
    try:
        customer = call_stripe(lambda: stripe_client().v1.customers.retrieve(customer_id), what="customer read",
                               attempts=attempts)
        on_file = standing.has_payment_method(customer.to_dict())
    except stripe.InvalidRequestError as exc:
        if exc.code != "resource_missing":
            raise
        on_file = False
    services.record_payment_method(customer_id, on_file=on_file, observed_ms=observed_ms)
    return on_file


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


def ensure_meters() -> dict[str, str]:
    """event name -> Stripe meter id, creating the meters the first time."""
    known = dict(StripeMeter.objects.values_list("event_name", "stripe_meter_id"))
    for meter in METERS:
        if meter.event_name in known:
            continue
        created = call_stripe(
            lambda meter=meter: stripe_client().v1.billing.meters.create(
                params={
                    "display_name": meter.display_name,
                    "event_name": meter.event_name,
                    "default_aggregation": {"formula": "sum"},
                    "customer_mapping": {"type": "by_id", "event_payload_key": "stripe_customer_id"},
                    "value_settings": {"event_payload_key": "value"},
                },
                options={"idempotency_key": f"meter-{meter.event_name}"},
            ),
            what="meter create",
        )
        try:
            StripeMeter.objects.get_or_create(event_name=meter.event_name, defaults={"stripe_meter_id": created.id})
        except IntegrityError:  # another worker stored it first: same meter (same idempotency key)
            pass
        known[meter.event_name] = created.id
    return known


def ensure_usage_price() -> str:
    """The id of the metered price on the cost meter: found by its lookup key, else created once."""
    meter_ids = ensure_meters()
    stored = StripeMeter.objects.filter(event_name=COST_METER.event_name).values_list("stripe_price_id", flat=True).first()
    if stored:
        return stored
    found = call_stripe(
        lambda: stripe_client().v1.prices.list(params={"lookup_keys": [USAGE_PRICE_LOOKUP_KEY], "limit": 1}),
        what="price lookup",
    )
    if found.data:
        price_id = found.data[0].id
    else:
        price_id = call_stripe(
            lambda: stripe_client().v1.prices.create(
                params={
                    "currency": "usd",
                    "unit_amount_decimal": USAGE_PRICE_UNIT_CENTS,
                    "recurring": {"interval": "month", "usage_type": "metered", "meter": meter_ids[COST_METER.event_name]},
                    "product_data": {"name": "Inferplane inference"},
                    "lookup_key": USAGE_PRICE_LOOKUP_KEY,
                    "nickname": "Usage, per micro-dollar",
                },
                options={"idempotency_key": f"price-{USAGE_PRICE_LOOKUP_KEY}"},
            ),
            what="price create",
        ).id
    StripeMeter.objects.filter(event_name=COST_METER.event_name, stripe_price_id="").update(stripe_price_id=price_id)
    return price_id


def ensure_subscription(organization_id: int) -> str:
    """The organisation's subscription to the usage price, created once, with its customer.

    Two workers may race here: both send the same idempotency key, so Stripe creates one
    subscription, and the first conditional update stores it.
    """
    account = BillingAccount.objects.for_organization(organization_id)
    if account.stripe_subscription_id:
        return account.stripe_subscription_id
    customer_id = ensure_customer(organization_id)
    price_id = ensure_usage_price()
    params = {"customer": customer_id, "items": [{"price": price_id}], "metadata": {"organization_id": str(organization_id)}}
    oldest_hour = (UsageRollup.objects.filter(organization_id=organization_id, billing_mode=BillingMode.POSTPAID)
                   .order_by("hour_start").values_list("hour_start", flat=True).first())
    if oldest_hour is not None:
        # Usage rolled up before the subscription existed is billed only if the subscription starts
        # before it. NOTE: the day, not the second, so that a retry from another worker sends the
        # same parameters with the same idempotency key, as Stripe requires.
        oldest_event_at = datetime.fromtimestamp(event_timestamp(oldest_hour), tz=UTC)
        params["backdate_start_date"] = int(oldest_event_at.replace(hour=0, minute=0, second=0, microsecond=0).timestamp())
    subscription = call_stripe(
        lambda: stripe_client().v1.subscriptions.create(
            params=params, options={"idempotency_key": f"subscription-org-{organization_id}"}
        ),
        what="subscription create",
    )
    return _store_once(account, "stripe_subscription_id", subscription.id)


# --- pushing rollups ---------------------------------------------------------------------------------

def event_timestamp(hour_start) -> int:
    """When Stripe is told usage happened: the hour, or for older late usage the oldest time it takes."""
    return int(max(hour_start, timezone.now() - MAX_EVENT_AGE).timestamp())


def meter_event_identifier(rollup_id: int, event_name: str) -> str:
    return f"rollup-{rollup_id}-{event_name.removeprefix('inferplane_')}"


def _claimable(now):
    stale = now - timedelta(seconds=settings.BILLING_CLAIM_TIMEOUT_S)
    return UsageRollup.objects.pushable().filter(Q(push_claimed_at__isnull=True) | Q(push_claimed_at__lt=stale))


def claim_rollup(rollup_id: int) -> bool:
    """Take the rollup for pushing; True only for the one worker that wins it."""
    now = timezone.now()
    return _claimable(now).filter(pk=rollup_id).update(push_claimed_at=now) == 1


def push_rollup(rollup_id: int) -> bool:
    """Push one closed rollup's meter events; True if this call finished it."""
    if not claim_rollup(rollup_id):
        return False
    rollup = UsageRollup.objects.get(pk=rollup_id)
    try:
        customer_id = ensure_customer(rollup.organization_id)
        ensure_subscription(rollup.organization_id)  # also creates the meters and the price
        done = set(MeterEventPush.objects.filter(rollup=rollup).values_list("event_name", flat=True))
        timestamp = event_timestamp(rollup.hour_start)
        for meter in METERS:
            value = getattr(rollup, meter.rollup_field)
            if value <= 0 or meter.event_name in done:
                continue
            _push_meter_event(rollup, meter, value, customer_id, timestamp)
    except Exception as exc:
        UsageRollup.objects.filter(pk=rollup_id).update(push_claimed_at=None, push_error=str(exc)[:300])
        raise
    return UsageRollup.objects.filter(pk=rollup_id, pushed_at__isnull=True).update(
        pushed_at=timezone.now(), push_claimed_at=None, push_error=""
    ) == 1


def _push_meter_event(rollup: UsageRollup, meter: Meter, value: int, customer_id: str, timestamp: int) -> None:
    identifier = meter_event_identifier(rollup.pk, meter.event_name)
    try:
        call_stripe(
            lambda: stripe_client().v1.billing.meter_events.create(
                params={
                    "event_name": meter.event_name,
                    "identifier": identifier,
                    "timestamp": timestamp,
                    "payload": {"stripe_customer_id": customer_id, "value": str(value)},
                },
                options={"idempotency_key": identifier},
            ),
            what="meter event",
        )
    except stripe.InvalidRequestError as exc:
        if exc.code not in DUPLICATE_EVENT_CODES:
            raise
        logger.info("stripe already has meter event %s", identifier)
    MeterEventPush.objects.get_or_create(
        identifier=identifier, defaults={"rollup": rollup, "event_name": meter.event_name, "value": value}
    )


def push_pending_rollups(*, limit: int = 500) -> int:
    """Push every closed rollup not yet pushed (oldest first). Returns how many this call finished."""
    if not is_configured():
        logger.info("billing sync off: STRIPE_SECRET_KEY is not set")
        return 0
    rollup_ids = list(_claimable(timezone.now()).order_by("hour_start", "sequence").values_list("pk", flat=True)[:limit])
    num_pushed = 0
    for rollup_id in rollup_ids:
        try:
            num_pushed += push_rollup(rollup_id)
        except stripe.StripeError:
            logger.exception("could not push rollup %s; the next run retries it", rollup_id)
    return num_pushed


# --- links for the console ----------------------------------------------------------------------------

def create_portal_link(organization_id: int, *, return_url: str) -> str:
    """A Stripe Customer Portal session where the organisation adds a payment method and sees invoices."""
    customer_id = ensure_customer(organization_id)
    session = call_stripe(
        lambda: stripe_client().v1.billing_portal.sessions.create(
            params={"customer": customer_id, "return_url": return_url}
        ),
        what="portal session",
    )
    return session.url
