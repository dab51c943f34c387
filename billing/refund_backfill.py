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

import stripe
from django.db import transaction

from billing import services, stripe_sync
from billing.models import BillingAccount, DeletedStripeCustomer, RefundedCharge

logger = logging.getLogger(__name__)


PAGE_SIZE = 100  # charges per page, Stripe's most


@dataclass(slots=True, frozen=True)
class RefundBackfill:
    num_customers: int  # customers whose charges were read
    num_charges_recorded: int  # charges whose refunds were new or larger than recorded
    organization_ids: tuple[int, ...]  # the organisations whose paid history fell (marked `limits_stale`)
    failed_customer_ids: tuple[str, ...] = ()  # customers whose charges could not all be read (logged): run again


def backfill_refunds(*, attempts: int = stripe_sync.MAX_ATTEMPTS) -> RefundBackfill:
    """Read every known customer's charges from Stripe and record what each refunded (`record_refunded_charge`).

    NOTE: one customer that fails (a 5xx past the retries, or one Stripe no longer knows) is logged and reported, and
    the others are still read: an unordered list stopped at it would leave every customer after it unread."""
    customers = list(BillingAccount.objects.exclude(stripe_customer_id="").values_list("stripe_customer_id",
                                                                                       "organization_id"))
    customers += list(DeletedStripeCustomer.objects.values_list("stripe_customer_id", "organization_id"))
    num_recorded, organization_ids, failed = 0, set(), []
    for customer_id, organization_id in customers:
        try:
            for charge in _charges(customer_id, attempts=attempts):
                if record_refunded_charge(organization_id, charge):
                    num_recorded += 1
                    organization_ids.add(organization_id)
        except stripe.StripeError:
            logger.exception("charges of stripe customer %s (organisation %s) could not be read", customer_id,
                             organization_id)
            failed.append(customer_id)
    return RefundBackfill(len(customers) - len(failed), num_recorded, tuple(sorted(organization_ids)), tuple(failed))


def _charges(customer_id: str, *, attempts: int):
    """The customer's charges as Stripe lists them (dicts), each page read with `call_stripe`'s retries."""
    after = None
    while True:
        params = {"customer": customer_id, "limit": PAGE_SIZE} | ({"starting_after": after} if after else {})
        page = stripe_sync.call_stripe(
            lambda options, params=params: stripe_sync.stripe_client().v1.charges.list(params=params, options=options),
            what="charge list", attempts=attempts)
        charges = [charge.to_dict() for charge in page.data]
        yield from charges
        if not page.has_more or not charges:
            return
        after = charges[-1]["id"]


def record_refunded_charge(organization_id: int, charge: dict) -> bool:
    """Record what Stripe's `charge` (as read now) has refunded, for `organization_id`; whether that changed anything.

    The rule is `RefundedCharge.raise_refunded`'s, as for a webhook's (`mirror_refund`)."""
    amount = charge.get("amount_refunded") or 0
    if amount <= 0:
        return False
    with transaction.atomic():
        RefundedCharge.objects.get_or_create(stripe_charge_id=charge["id"],
                                             defaults={"organization_id": organization_id})
        refunded = RefundedCharge.objects.select_for_update().get(stripe_charge_id=charge["id"])
        if not refunded.raise_refunded(amount, charge.get("currency") or "usd"):
            return False
        services.paid_history_changed(refunded.organization_id)
    logger.info("refund of charge %s recorded from Stripe: %s %s", charge["id"], amount, refunded.currency)
    return True
