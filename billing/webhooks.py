"""Stripe webhooks: verified by signature, applied once per event id, mirroring invoices (all their lines), disputed
and refunded payments and whether a customer has a payment method (`billing.standing`), and forgetting subscriptions
and customers that Stripe ended (`billing.services.record_subscription_ended`, `record_customer_deleted`).

The Stripe webhook endpoint must send: invoice.*, customer.created, customer.updated, customer.deleted,
customer.subscription.updated, customer.subscription.deleted, charge.dispute.* and charge.refunded."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

import stripe
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing import services, stripe_sync
from billing.models import (
    BILLING_INVOICE_STATUSES,
    BillingAccount,
    DeletedStripeCustomer,
    Dispute,
    Invoice,
    InvoiceLine,
    RefundedCharge,
    StripeEvent,
)

logger = logging.getLogger(__name__)

INVOICE_EVENTS = {
    "invoice.created", "invoice.updated", "invoice.finalized", "invoice.paid",
    "invoice.payment_succeeded", "invoice.payment_failed", "invoice.marked_uncollectible", "invoice.voided",
}
CUSTOMER_EVENTS = {"customer.created", "customer.updated"}
SUBSCRIPTION_EVENTS = {"customer.subscription.updated", "customer.subscription.deleted"}
DISPUTE_EVENTS = {
    "charge.dispute.created", "charge.dispute.updated", "charge.dispute.closed", "charge.dispute.funds_withdrawn",
    "charge.dispute.funds_reinstated",
}
# A charge refunded, in part or in full (its `amount_refunded` is the running total): its paid history lowered.
REFUND_EVENTS = {"charge.refunded"}
# Dispute states that end it: at the same second as one of them, an event that says it is open is the older.
CLOSED_DISPUTE_STATUSES = ("won", "lost", "warning_closed", "prevented")
# Invoice states (Stripe's `status`) in the order Stripe moves through them: at the same second, an event that says a
# lower one is the older (a retry's invoice.updated and its invoice.paid share a second; so may a marked_uncollectible
# and the invoice.paid or invoice.voided that ended it). Stripe never leaves paid or void; it leaves uncollectible
# only for them, so an uncollectible invoice paid a later second is paid. A state not named ranks as draft.
INVOICE_STATUS_RANKS = {"draft": 0, "open": 0, "uncollectible": 1, "paid": 2, "void": 2}


class InvalidWebhook(ValueError):
    """The payload is not a genuine Stripe event (bad or missing signature, not JSON)."""


def handle_stripe_webhook(payload: bytes, signature: str | None) -> bool:
    """Verify and apply one webhook. True if applied now, False if this event id was seen before."""
    if not settings.STRIPE_WEBHOOK_SECRET:
        raise InvalidWebhook("STRIPE_WEBHOOK_SECRET is not set: every webhook is refused")
    try:
        stripe.Webhook.construct_event(payload, signature, settings.STRIPE_WEBHOOK_SECRET)
    except (ValueError, stripe.SignatureVerificationError) as exc:
        raise InvalidWebhook(str(exc)) from None
    event = json.loads(payload)
    if event["type"] in CUSTOMER_EVENTS:
        # The customer as Stripe has it now decides, not the event (they arrive late and out of order);
        # read with no transaction open. If Stripe cannot answer, this webhook fails and Stripe sends it again.
        customer_id = event["data"]["object"].get("id") or "-"
        seen = StripeEvent.objects.filter(stripe_event_id=event["id"]).exists()
        if not seen and BillingAccount.objects.filter(stripe_customer_id=customer_id).exists():
            stripe_sync.observe_payment_method(customer_id, attempts=1)
    payer = ("", "")
    if event["type"] in DISPUTE_EVENTS:
        payer = _dispute_payer(event)
    billed_periods = lines = final_quantity = None
    if event["type"] in INVOICE_EVENTS:
        billed_periods = _void_invoice_billed_periods(event)
        lines = _invoice_lines(event)
        final_quantity = _late_final_quantity(event)
    deleted_invoices = None
    if event["type"] == "customer.deleted":
        deleted_invoices = _deleted_customer_invoices(event)
    with transaction.atomic():
        _, created = StripeEvent.objects.get_or_create(stripe_event_id=event["id"], defaults={"type": event["type"]})
        if not created:
            return False
        if event["type"] in INVOICE_EVENTS:
            invoice = mirror_invoice(event["data"]["object"], event_type=event["type"], event_created=event.get("created", 0),
                                     lines=lines)
            if invoice is not None:
                services.push_again_voided(invoice, billed_periods=billed_periods)
                if invoice.status in BILLING_INVOICE_STATUSES:  # final: its quantity decides, or else the operator
                    services.decide_held_by_final_invoice(invoice.stripe_customer_id, invoice.stripe_invoice_id,
                                                          final_quantity)
                organization_id = invoice.organization_id
                if invoice.status == "paid":  # its spending ceiling may rise (`billing.standing.net_paid`)
                    services.paid_history_changed(organization_id)
                else:
                    transaction.on_commit(lambda: services.review_payment_standing(organization_id), robust=True)
        elif event["type"] in DISPUTE_EVENTS:
            dispute = mirror_dispute(event["data"]["object"], payer=payer, event_created=event.get("created", 0))
            if dispute is not None:
                services.paid_history_changed(dispute.organization_id)
        elif event["type"] in REFUND_EVENTS:
            refunded = mirror_refund(event["data"]["object"])
            if refunded is not None:
                services.paid_history_changed(refunded.organization_id)
        elif event["type"] in SUBSCRIPTION_EVENTS:
            # NOTE: an ended subscription is final, so the event itself is enough, in whatever order it comes.
            subscription = event["data"]["object"]
            if event["type"] == "customer.subscription.deleted" or (
                    subscription.get("status") in stripe_sync.ENDED_SUBSCRIPTION_STATUSES):
                services.record_subscription_ended(subscription["id"])
        elif event["type"] == "customer.deleted":
            found = deleted_invoices or stripe_sync.DeletedCustomerInvoices(None, None, [])
            services.record_customer_deleted(
                event["data"]["object"]["id"], invoiced_until=found.invoiced_until, billed_periods=found.billed_periods,
                written_off=found.written_off, voided_in_its_second=found.voided_in_its_second,
                deleted_at=_moment(event.get("created")))
    return True


def _moment(epoch: int | None) -> datetime | None:
    return datetime.fromtimestamp(epoch, tz=UTC) if epoch else None


def mirror_invoice(data: dict, *, event_type: str, event_created: int, lines: list[dict] | None = None) -> Invoice | None:
    """Mirror the invoice of an `invoice.*` event with its `lines`, all of them (`_invoice_lines`; None: those `data`
    shows), in place of those mirrored before."""
    # NOTE: an invoice already mirrored is found by its own id first: once its customer was deleted in Stripe (the
    # account's customer id cleared), its later events (paid, voided, uncollectible) were dropped, and an invoice left
    # open with a failed payment held its organisation for ever. Only a new invoice needs the account.
    # A new invoice of a customer deleted since is its organisation's all the same (`DeletedStripeCustomer`): its
    # webhook may come after the deletion's, and was dropped.
    invoice = Invoice.objects.select_for_update().filter(stripe_invoice_id=data["id"]).first()
    organization_id = None if invoice is not None else _organization_of_customer(data.get("customer") or "-")
    if invoice is None and organization_id is None:
        logger.warning("stripe invoice %s for unknown customer %s", data.get("id"), data.get("customer"))
        return None
    status = data.get("status") or "draft"
    if invoice is not None and (invoice.stripe_event_created > event_created or (
            invoice.stripe_event_created == event_created
            and INVOICE_STATUS_RANKS.get(status, 0) < INVOICE_STATUS_RANKS.get(invoice.status, 0))):
        # An older event arriving late never overwrites newer state, but a failure it reports still
        # dates the grace period (`billing.standing`) unless the invoice is paid by now: a paid invoice
        # is never reopened, so a failure reported after the payment is one from before it.
        failed_at = _moment(event_created)
        if event_type == "invoice.payment_failed" and invoice.status != "paid" and failed_at and (
                invoice.payment_failed_at is None or failed_at < invoice.payment_failed_at):
            invoice.payment_failed_at = failed_at
            invoice.save(update_fields=["payment_failed_at"])
        return invoice
    invoice = invoice or Invoice(organization_id=organization_id, stripe_invoice_id=data["id"])
    invoice.stripe_customer_id = stripe_sync.reference_id(data.get("customer")) or invoice.stripe_customer_id
    invoice.number = data.get("number") or ""
    invoice.status = status
    invoice.currency = data.get("currency") or "usd"
    invoice.amount_due = data.get("amount_due") or 0
    invoice.amount_paid = data.get("amount_paid") or 0
    invoice.period_start = _moment(data.get("period_start"))
    invoice.period_end = _moment(data.get("period_end"))
    invoice.hosted_invoice_url = data.get("hosted_invoice_url") or ""
    invoice.stripe_event_created = event_created
    # NOTE: the first failure starts the grace period (`billing.standing`); Stripe's retries, and attempts
    # with a card that fails again, never restart it. Only a paid invoice clears it.
    if event_type == "invoice.payment_failed":
        invoice.payment_failed_at = invoice.payment_failed_at or _moment(event_created) or timezone.now()
    elif invoice.status == "paid":
        invoice.payment_failed_at = None
    if invoice.status == "uncollectible":
        invoice.uncollectible_at = invoice.uncollectible_at or _moment(event_created) or timezone.now()
    # NOTE: Stripe's own time of the void, not the event's: a void's webhook may come after its customer's deletion's,
    # and a void before the deletion is a write-off all the same (`services.push_again_voided`).
    invoice.voided_at = ((_moment((data.get("status_transitions") or {}).get("voided_at")) or invoice.voided_at)
                         if status == "void" else None)
    invoice.save()
    if lines is None:
        lines = (data.get("lines") or {}).get("data") or []
    invoice.lines.all().delete()
    # NOTE: once per line id (`invoice_line_unique`), were a line both shown and read.
    InvoiceLine.objects.bulk_create([
        InvoiceLine(invoice=invoice, stripe_line_id=line["id"], description=(line.get("description") or "")[:500],
                    quantity=line.get("quantity"), amount=line.get("amount") or 0)
        for line in {line["id"]: line for line in lines}.values()
    ])
    return invoice


def _organization_of_customer(customer_id: str) -> int | None:
    """The organisation whose Stripe customer `customer_id` is, or was until Stripe deleted it; None if none."""
    return (BillingAccount.objects.filter(stripe_customer_id=customer_id).values_list("organization_id", flat=True).first()
            or DeletedStripeCustomer.objects.filter(stripe_customer_id=customer_id)
            .values_list("organization_id", flat=True).first())


def _dispute_payer(event: dict) -> tuple[str, str]:
    """The customer and invoice ids that a new dispute's charge was paid by, read from Stripe with no transaction
    open (a dispute names only its charge); ("", "") when it need not be read: the event was applied before, or
    the dispute is mirrored already (its organisation is known). If Stripe cannot answer, this webhook fails and
    Stripe sends it again."""
    data = event["data"]["object"]
    charge_id = stripe_sync.reference_id(data.get("charge"))
    if not charge_id or not stripe_sync.is_configured():
        return "", ""
    if (StripeEvent.objects.filter(stripe_event_id=event["id"]).exists()
            or Dispute.objects.filter(stripe_dispute_id=data.get("id") or "-").exists()):
        return "", ""
    return stripe_sync.charge_payer(charge_id, attempts=1)


def _deleted_customer_invoices(event: dict) -> stripe_sync.DeletedCustomerInvoices | None:
    """What Stripe's invoices of the deleted customer settle, its drafts finalised (`stripe_sync.
    deleted_customer_invoices`), read with no transaction open; None when it need not be read: the event was applied
    before, or the customer is not an account's. If Stripe cannot answer, this webhook fails and Stripe sends it
    again."""
    customer_id = event["data"]["object"].get("id") or "-"
    if (not stripe_sync.is_configured() or StripeEvent.objects.filter(stripe_event_id=event["id"]).exists()
            or not BillingAccount.objects.filter(stripe_customer_id=customer_id).exists()):
        return None
    return stripe_sync.deleted_customer_invoices(customer_id, deleted_at=_moment(event.get("created")) or timezone.now(),
                                                 attempts=1)


def _invoice_lines(event: dict) -> list[dict] | None:
    """All the lines of the event's invoice (`stripe_sync.invoice_lines`), read with no transaction open when the
    webhook shows only some (its first 10, `lines.has_more`); None when nothing need be read: it shows them all, Stripe
    not configured, or the event applied before. Before, only the lines shown were mirrored. If Stripe cannot answer,
    this webhook fails and Stripe sends it again."""
    data = event["data"]["object"]
    if (not (data.get("lines") or {}).get("has_more") or not stripe_sync.is_configured()
            or StripeEvent.objects.filter(stripe_event_id=event["id"]).exists()):
        return None
    return stripe_sync.invoice_lines(data, attempts=1)


def _late_final_quantity(event: dict) -> int | None:
    """What the event's invoice, of a customer Stripe deleted, billed of the usage price (`stripe_sync.usage_quantity`),
    read with no transaction open, when it is final now and was not when the deletion read it (a draft Stripe advances
    itself): the events of the deletion's second held for want of it are decided by it
    (`services.decide_held_by_final_invoice`). None when nothing need be read: another invoice, not final, known
    already, Stripe not configured, or the event applied before. If Stripe cannot answer, this webhook fails and Stripe
    sends it again."""
    data = event["data"]["object"]
    customer_id = stripe_sync.reference_id(data.get("customer")) or "-"
    if data.get("status") not in BILLING_INVOICE_STATUSES or not stripe_sync.is_configured():
        return None
    deleted = DeletedStripeCustomer.objects.filter(stripe_customer_id=customer_id).first()
    if deleted is None or not any(period[3:4] == [data.get("id")] and period[2] is None
                                  for period in deleted.billed_periods):
        return None
    if StripeEvent.objects.filter(stripe_event_id=event["id"]).exists():
        return None
    return stripe_sync.usage_quantity(data, attempts=1)


def _void_invoice_billed_periods(event: dict) -> list[tuple[datetime, datetime]] | None:
    """For a void invoice of a customer Stripe deleted (`DeletedStripeCustomer`), the periods its other invoices bill
    (`stripe_sync.customer_billed_periods`), read with no transaction open, so that the usage of the void one's period
    goes again to the next customer unless they bill it (`services.push_again_voided`); None when nothing need be
    read: another invoice, a live customer's (written off: `billing.models.WRITTEN_OFF_INVOICE_STATUS`), Stripe not
    configured, or the event applied before. If Stripe cannot answer, this webhook fails and Stripe sends it again."""
    data = event["data"]["object"]
    customer_id = stripe_sync.reference_id(data.get("customer")) or "-"
    if (data.get("status") != "void" or not stripe_sync.is_configured()
            or not DeletedStripeCustomer.objects.filter(stripe_customer_id=customer_id).exists()
            or StripeEvent.objects.filter(stripe_event_id=event["id"]).exists()):
        return None
    return stripe_sync.customer_billed_periods(customer_id, attempts=1)


def mirror_dispute(data: dict, *, payer: tuple[str, str], event_created: int) -> Dispute | None:
    """Mirror the dispute of a `charge.dispute.*` event. A dispute already mirrored is found by its own id; a new
    one's organisation by its charge's customer (`payer`), the account's or one Stripe deleted since
    (`DeletedStripeCustomer`), or else its charge's invoice. One whose organisation is not known (a charge of another
    product on the same Stripe account, say) is logged and left.

    NOTE: before, only the account's customer: a chargeback of a payment by a customer deleted since was dropped,
    and held nobody."""
    dispute = Dispute.objects.filter(stripe_dispute_id=data["id"]).first()
    if dispute is None:
        customer_id, invoice_id = payer
        by_invoice = Invoice.objects.filter(stripe_invoice_id=invoice_id or "-")
        organization_id = (_organization_of_customer(customer_id or "-")
                           or by_invoice.values_list("organization_id", flat=True).first())
        if organization_id is None:
            logger.warning("stripe dispute %s of charge %s for unknown customer %s", data.get("id"), data.get("charge"),
                           customer_id or "(none)")
            return None
        # NOTE: two events of a new dispute may arrive together: the row is made once, then both take its lock.
        dispute, _ = Dispute.objects.get_or_create(
            stripe_dispute_id=data["id"],
            defaults={"organization_id": organization_id, "status": data.get("status") or ""})
    dispute = Dispute.objects.select_for_update().get(pk=dispute.pk)
    status = data.get("status") or ""
    if dispute.stripe_event_created > event_created or (
            dispute.stripe_event_created == event_created and dispute.status in CLOSED_DISPUTE_STATUSES
            and status not in CLOSED_DISPUTE_STATUSES):
        return dispute  # an older event arriving late never overwrites newer state
    dispute.stripe_charge_id = stripe_sync.reference_id(data.get("charge"))
    dispute.status = status
    dispute.reason = data.get("reason") or ""
    dispute.currency = data.get("currency") or "usd"
    dispute.amount = data.get("amount") or 0
    dispute.disputed_at = _moment(data.get("created")) or dispute.disputed_at or _moment(event_created)
    dispute.stripe_event_created = event_created
    dispute.save()
    return dispute


def mirror_refund(data: dict) -> RefundedCharge | None:
    """Mirror what is refunded of the charge of a `charge.refunded` event (its `amount_refunded`, all its refunds so
    far, kept only where larger than recorded: `RefundedCharge.raise_refunded`); the charge's row where that changed
    it. Its organisation is its customer's, the account's or one Stripe deleted since; a charge of no known customer
    is logged and left.

    NOTE: a refund that fails after (`refund.failed`) sends no `charge.refunded`: the charge stays counted as
    refunded, which keeps its organisation's ceiling lower, never higher, than its money allows."""
    refunded = RefundedCharge.objects.select_for_update().filter(stripe_charge_id=data["id"]).first()
    if refunded is None:
        organization_id = _organization_of_customer(stripe_sync.reference_id(data.get("customer")) or "-")
        if organization_id is None:
            logger.warning("stripe refund of charge %s for unknown customer %s", data.get("id"), data.get("customer"))
            return None
        refunded, _ = RefundedCharge.objects.get_or_create(stripe_charge_id=data["id"],
                                                           defaults={"organization_id": organization_id})
        refunded = RefundedCharge.objects.select_for_update().get(pk=refunded.pk)
    if not refunded.raise_refunded(data.get("amount_refunded") or 0, data.get("currency") or "usd"):
        return None  # nothing new: an older event arriving late, or one seen before
    return refunded
