"""A closed organisation's Stripe subscription ends once its last usage is billed (`end_subscription_after_close`).

The platform's one price is metered, so a closed organisation's live subscription would go on making an invoice every
month (of nothing) and Stripe's dunning mails would go on reaching people who left. It is cancelled at once with
`invoice_now` (Stripe then makes a final invoice of the usage it has not invoiced yet, the meter events it has received
dated up to the cancellation) and no proration (`prorate` false: there is no fixed fee to credit back) — but only once
everything recorded up to the close is in Stripe: a meter event Stripe receives after the cancellation is billed by no
invoice of that subscription.

Settled means, by PostgreSQL's clock (`controlplane.clock`), as the close is stamped:
- the close is `settle_after_close()` old: its own hour's rollup has closed (`billing.rollups.close_delay`) and a
  call admitted before it has settled or its reservation expired (`INFERPLANE_RESERVATION_TTL_S`);
- a rollup run started since then (`RollupCursor.recorded_since`), so every usage row recorded by then is rolled up;
- none of its rollups is open, or closed and not yet in Stripe (one held for an operator holds the subscription too:
  the hold says why, the cancellation waits for the operator, and an ERROR line and an audit event name the
  organisation, once per hold: `_tell_held`);
- its last rollup reached Stripe over `METER_EVENTS_SETTLE` ago (Stripe aggregates meter events asynchronously).
The caller adds what billing cannot see (`endpoints.closing.end_closed_subscriptions`: a cancelled batch whose lines
still run).

Usage recorded later still (a gateway that was partitioned replays its journal hours later) is not dropped: its rollup
is pushed as any other, the push subscribes the organisation again from where the cancelled subscription's invoices
stopped (`stripe_sync.ensure_subscription`, `_invoiced_until`), and once that settles this cancels the new one in turn,
with its own final invoice: billed once, on one more invoice, each subscription cancelled once.

Pushes of the organisation's rollups are held back from just before it is judged settled until the subscription is
forgotten (`BillingAccount.subscription_ending_at`, `stripe_sync.push_rollup`; the database refuses their claims,
billing/0041, so a worker of the release before the mark holds back too), and it is judged again under that mark: a rollup made meanwhile goes to the next subscription, never to this one within seconds of (or after) its final
invoice.

Twice-safe: one run at a time (`endpoints.closing`), each subscription read before it is cancelled (one Stripe ended
already is only forgotten), and a cancellation whose answer was lost is found by reading it again (Stripe takes no
idempotency key on a DELETE: a second one is refused, never done twice). Stripe down: nothing changes here, the next
run tries again.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

import stripe
from django.conf import settings
from django.db.models import Max

from billing import rollups, services, stripe_sync
from billing.models import BillingAccount, RollupCursor, UsageRollup
from controlplane.accounts.models import AuditEvent, Organization
from controlplane.accounts.services import SYSTEM, record_audit
from controlplane.clock import DatabaseClock, database_now

logger = logging.getLogger(__name__)

# How long after the last meter event pushed the subscription is cancelled: Stripe aggregates meter events
# asynchronously, and an event not aggregated yet when the final invoice is made is billed by no invoice.
METER_EVENTS_SETTLE = timedelta(minutes=10)


# Why a closed organisation's subscription waits on a rollup held for an operator (`unsettled_reason`), and the audit
# action that tells it, once per hold (`_tell_held`).
HELD_FOR_AN_OPERATOR = "a rollup is held for an operator (usage rollups, push held at): the final invoice waits for it"
HELD_AUDIT_ACTION = "billing.subscription_end_held"


def settle_after_close() -> timedelta:
    """How long after a close its last usage may still be recorded: the close's hour until its rollup closes, and the
    longest a call admitted before the close holds its reservation."""
    return rollups.close_delay() + timedelta(seconds=settings.BILLING_RESERVATION_TTL_S)


def closed_with_subscription():
    """The ids of closed organisations whose account still holds a Stripe subscription."""
    return (BillingAccount.objects.filter(organization__closed_at__isnull=False).exclude(stripe_subscription_id="")
            .order_by("organization_id").values_list("organization_id", flat=True))


def unsettled_reason(organization_id: int, *, now: datetime | None = None) -> str | None:
    """Why the closed organisation's last usage may not all be in Stripe yet; None once it is (see the module's note)."""
    now = now or database_now()
    closed_at = Organization.objects.values_list("closed_at", flat=True).get(pk=organization_id)
    if closed_at is None:
        return "open"
    settled_at = closed_at + settle_after_close()
    if now < settled_at:
        return f"calls and rollups of the close settle until {settled_at:%Y-%m-%d %H:%M} UTC"
    recorded_since = RollupCursor.objects.filter(id=1).values_list("recorded_since", flat=True).first()
    if recorded_since is None or recorded_since < settled_at:
        return "no rollup run has started since the close settled"
    rollups_of = UsageRollup.objects.filter(organization_id=organization_id)
    if rollups_of.filter(closed_at__isnull=True).exists():
        return "a rollup is still open"
    if rollups_of.pushable().filter(push_held_at__isnull=False).exists():
        return HELD_FOR_AN_OPERATOR
    if rollups_of.pushable().exists():
        return "a rollup is not in Stripe yet (its push under way, or failing)"
    last_pushed_at = rollups_of.filter(pushed_at__isnull=False).order_by("-pushed_at").values_list(
        "pushed_at", flat=True).first()
    if last_pushed_at is not None and now - last_pushed_at < METER_EVENTS_SETTLE:
        return "Stripe is still aggregating the last meter events"
    return None


def end_subscription_after_close(organization_id: int) -> bool:
    """Cancel the closed organisation's subscription, billing what it has not invoiced, once its last usage is in
    Stripe (`unsettled_reason`). True if this call ended it (cancelled it, or found it ended and forgot it).

    NOTE: pushes are held back from the moment it is judged settled until it is forgotten (`subscription_ending_at`,
    set before it is judged, and judged again after: `stripe_sync.push_rollup` reads it after its claim). Judged
    once, with pushes going on, a rollup made meanwhile (late rows' adjustment, a journal replayed) went to the
    subscription seconds before its final invoice (not aggregated by Stripe yet: billed by none) or after it (to a
    subscription cancelled and not yet forgotten: billed by none, and marked pushed). Held back, it goes to the next
    subscription once this one is forgotten, on one more final invoice. A run that stopped midway (Stripe down, the
    worker killed) leaves the mark: the next one reads the subscription and either ends it or takes the mark off."""
    if not stripe_sync.is_configured():
        return False
    subscription_id, ending_at = BillingAccount.objects.values_list(
        "stripe_subscription_id", "subscription_ending_at").get(organization_id=organization_id)
    if not subscription_id:
        return False
    if ending_at is None and (reason := unsettled_reason(organization_id)) is not None:
        if reason == HELD_FOR_AN_OPERATOR:
            _tell_held(organization_id, subscription_id)
        return False
    this_subscription = BillingAccount.objects.filter(organization_id=organization_id,
                                                      stripe_subscription_id=subscription_id)
    if not this_subscription.filter(subscription_ending_at__isnull=True).update(subscription_ending_at=DatabaseClock()):
        if not this_subscription.exists():
            return False  # forgotten meanwhile (its webhook)
    cancelled = False
    if not _ended(subscription_id):
        if unsettled_reason(organization_id) is not None:
            # NOTE: a push that claimed a rollup before the mark was set: it goes on, and the next run waits for it
            this_subscription.update(subscription_ending_at=None)
            return False
        try:
            stripe_sync.call_stripe(
                lambda options: stripe_sync.stripe_client().v1.subscriptions.cancel(
                    subscription_id, params={"invoice_now": True, "prorate": False}, options=options),
                what="subscription cancel", key=stripe_sync.IdempotencyKey(f"subscription-cancel-{subscription_id}"))
        except stripe.InvalidRequestError:
            # NOTE: a try whose answer was lost (a timeout) cancelled it, and the retry was refused: not an error
            if not _ended(subscription_id):
                raise
        cancelled = True
    account = services.record_subscription_ended(subscription_id)
    organization = Organization.objects.get(pk=organization_id)
    record_audit(SYSTEM, organization, "billing.subscription_cancel_after_close", account,
                 subscription=subscription_id, cancelled_here=cancelled)
    logger.info("subscription %s of closed organisation %s ended (cancelled here: %s)", subscription_id,
                organization_id, cancelled)
    return True


def _tell_held(organization_id: int, subscription_id: str) -> None:
    """An ERROR log line naming the closed organisation whose subscription waits on its rollups held for an operator,
    and an audit event, once per hold: again only once a rollup is held anew (its `push_held_at` after the last one
    told, both PostgreSQL's clock).

    NOTE: the held rollups' own line and gauge (`billing.held_rollups`) say nothing of the close: before, the
    subscription of a closed organisation stayed live for as long as nobody looked, silently (its dunning mails and
    empty invoices with it). It is never cancelled early: a held rollup's usage is what its final invoice bills."""
    held = UsageRollup.objects.pushable().filter(organization_id=organization_id, push_held_at__isnull=False)
    latest_hold = held.aggregate(latest=Max("push_held_at"))["latest"]
    if latest_hold is None or AuditEvent.objects.filter(organization_id=organization_id, action=HELD_AUDIT_ACTION,
                                                        created_at__gte=latest_hold).exists():
        return
    rollup_ids = list(held.order_by("pk").values_list("pk", flat=True))
    organization = Organization.objects.get(pk=organization_id)
    logger.error("the Stripe subscription %s of closed organisation %s (%s) is not cancelled: its usage rollups %s are "
                 "held for an operator, and its final invoice must bill them. Decide them in the admin (usage "
                 "rollups, push held at); the cancellation follows", subscription_id, organization_id,
                 organization.slug, rollup_ids)
    record_audit(SYSTEM, organization, HELD_AUDIT_ACTION, None, subscription=subscription_id, rollups=rollup_ids)


def _ended(subscription_id: str) -> bool:
    subscription = stripe_sync.call_stripe(
        lambda _options: stripe_sync.stripe_client().v1.subscriptions.retrieve(subscription_id),
        what="subscription read")
    return subscription.status in stripe_sync.ENDED_SUBSCRIPTION_STATUSES
