"""Refunds Stripe made before we mirrored `charge.refunded` (`billing.webhooks.mirror_refund`), read back from Stripe.

Stripe does not send old events again when an event type is added to the webhook endpoint, and a pod of the code
before the spending ceilings stored such an event's id and dropped it: a payment refunded then would raise its
organisation's spending ceiling for good (`billing.standing.net_paid`). `manage.py backfill_refunds` lists the charges
of every customer we know (the accounts' and those Stripe deleted) and records what each has refunded; run it after
the deploy, once the endpoint sends `charge.refunded`. Safe to run again: a charge's refunds are a running total, and
only a larger one than recorded changes anything."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.db import transaction

from billing import services, stripe_sync
from billing.models import BillingAccount, DeletedStripeCustomer, RefundedCharge

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class RefundBackfill:
    num_customers: int  # customers whose charges were read
    num_charges_recorded: int  # charges whose refunds were new or larger than recorded
    organization_ids: tuple[int, ...]  # the organisations whose paid history fell (marked `limits_stale`)


def backfill_refunds(*, attempts: int = stripe_sync.MAX_ATTEMPTS) -> RefundBackfill:
    """Read every known customer's charges from Stripe and record what each refunded (`record_refunded_charge`)."""
    customers = list(BillingAccount.objects.exclude(stripe_customer_id="").values_list("stripe_customer_id",
                                                                                       "organization_id"))
    customers += list(DeletedStripeCustomer.objects.values_list("stripe_customer_id", "organization_id"))
    num_recorded, organization_ids = 0, set()
    for customer_id, organization_id in customers:
        charges = stripe_sync.call_stripe(
            lambda options, customer_id=customer_id: stripe_sync.stripe_client().v1.charges.list(
                params={"customer": customer_id, "limit": 100}, options=options),
            what="charge list", attempts=attempts)
        for charge in charges.auto_paging_iter():
            if record_refunded_charge(organization_id, charge.to_dict()):
                num_recorded += 1
                organization_ids.add(organization_id)
    return RefundBackfill(len(customers), num_recorded, tuple(sorted(organization_ids)))


def record_refunded_charge(organization_id: int, charge: dict) -> bool:
    """Record what Stripe's `charge` (as read now) has refunded, for `organization_id`; whether that changed anything.

    NOTE: a charge's `amount_refunded` only adds up, so the larger of it and what is recorded is the truth: a newer
    webhook's (`mirror_refund`) is never lowered, and a lost one's is made good. `stripe_event_created` is left as it
    is, so that every later event still applies."""
    amount = charge.get("amount_refunded") or 0
    if amount <= 0:
        return False
    with transaction.atomic():
        RefundedCharge.objects.get_or_create(stripe_charge_id=charge["id"],
                                             defaults={"organization_id": organization_id})
        refunded = RefundedCharge.objects.select_for_update().get(stripe_charge_id=charge["id"])
        if refunded.amount_refunded >= amount:
            return False
        refunded.amount_refunded = amount
        refunded.currency = charge.get("currency") or "usd"
        refunded.save(update_fields=["amount_refunded", "currency"])
        services.paid_history_changed(refunded.organization_id)
    logger.info("refund of charge %s recorded from Stripe: %s %s", charge["id"], amount, refunded.currency)
    return True
