"""Spend alerts: an email to owners and admins at 50, 80 and 100% of the monthly cap, once each per
period, again for a limit of one kind only once the spend passes a threshold of it (`_alerted_at_this_spend`); and one when an unpaid invoice or a disputed payment stops inference (`billing.standing`)."""

from __future__ import annotations

import logging
from datetime import timedelta
from decimal import Decimal

from django.conf import settings
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.db.models import DateTimeField, Exists, ExpressionWrapper, OuterRef, Q
from django.db.models.functions import Now
from django.urls import reverse
from django.utils import timezone
from redis.exceptions import RedisError

from billing import standing
from billing.ledger import period_spend
from billing.models import BillingAccount, BillingMode, SpendAlert, UsageRecord
from billing.periods import current_period, period_containing
from billing.quota.counters import limit_reached
from billing.standing import (
    PAYMENT_METHOD,
    SPEND_CEILING,
    SPEND_CEILING_STAFF,
    SpendLimit,
    bills_through_stripe,
    card_spend,
    shown_spend_limit,
    spend_ceiling,
    spend_ceiling_applies,
)
from controlplane.accounts.models import Membership, Role
from controlplane.clock import database_now
from controlplane.text import one_line

logger = logging.getLogger(__name__)

THRESHOLDS_PERCENT = (50, 80, 100)
REACHED_ALERT_AFTER = THRESHOLDS_PERCENT[-2]  # a refusal at the limit counts as 100 % past this one
# An alert claimed and not sent this long ago was left by a worker that died: well past the task's hard time limit
# (`billing.tasks.check_spend_alerts`), so the worker that claimed it is gone.
CLAIM_LEFT_AFTER = timedelta(minutes=5)


def check_spend_alerts(organization_id: int, *, now=None) -> list[int]:
    """Send the alerts the period's spend has crossed and not yet sent. Returns the thresholds sent now.
    The cap is where calls stop: the organisation's own, or the lower limit without a payment method
    (`billing.standing`)."""
    account = BillingAccount.objects.filter(organization_id=organization_id).select_related("organization").first()
    if account is None:
        return []
    # NOTE: one month for all of it, read once (PostgreSQL's clock, or the beat's `now`): the card's holders too. Before,
    # each read the clock anew, a query or two per organisation of the beat, and the holders of one month were judged
    # beside the spend of the next at a month's edge.
    period = period_containing(now) if now is not None else current_period()
    card = (card_spend([account.card_fingerprint], period, spend=False)[account.card_fingerprint]
            if account.card_fingerprint and spend_ceiling_applies(account) else None)
    # NOTE: the organisation's own spend against the limit it is shown (a card's ceiling's amount, not the room its
    # other organisations leave it): their spend is theirs, and mailed here it was another tenant's, to the cent.
    ceiling = spend_ceiling(account, card=card, others_spend=False)
    limit = shown_spend_limit(account, ceiling)
    if not limit.cap:
        return []
    spend = period_spend(organization_id, period)
    crossed = [t for t in THRESHOLDS_PERCENT if spend * 100 >= limit.cap * t]
    # NOTE: "reached" on a refusal only once the spend is past the alert before it: one oversized call refused at a
    # low spend (its worst case alone past the cap) stops nothing else, and mailing every owner "calls are refused"
    # would be untrue for the calls that still fit.
    if (crossed and crossed[-1] == REACHED_ALERT_AFTER and 100 not in crossed
            and _refused_at_limit(organization_id, period.key, limit.reason)):
        crossed.append(100)
    if not crossed:
        return []
    sent_now = []
    for threshold in crossed:
        alert = _claim(organization_id, period.start, threshold, spend, limit)
        if alert is None:
            continue
        try:
            _send(account, limit, threshold, spend, shared=ceiling is not None and ceiling.is_shared)
        except Exception:
            SpendAlert.objects.filter(pk=alert.pk).delete()  # unclaimed, so the next run tries again
            raise
        SpendAlert.objects.filter(pk=alert.pk).update(sent_at=timezone.now())
        sent_now.append(threshold)
    return sent_now


def _refused_at_limit(organization_id: int, period_key: str, reason: str) -> bool:
    """A call was refused for the limit (`counters.limit_reached`): it is reached though the spend stops short of it
    (a call is refused when its worst case no longer fits). NOTE: by the spend alone, the 100 % alert never went out
    while every call was refused. Redis unreadable: judged by the spend alone."""
    try:
        return limit_reached(organization_id, period_key, reason)
    except RedisError:
        logger.warning("spend alerts: organisation %s's refusals at its limit are not readable now", organization_id)
        return False


def _claim(organization_id: int, period_start, threshold: int, spend: Decimal, limit: SpendLimit) -> SpendAlert | None:
    """The alert's row, claimed by this run to send it; None when it was sent or another run is sending it, or when
    this threshold alerted in the period, for a limit of this one's kind, at a spend already at or past its share of
    this one (`_alerted_at_this_spend`).
    A ceiling that rose in the month warns again at 50, 80 and 100 % of the new one, once the spend reaches them (before,
    the first limit's claims stood for the month and nobody was warned before the higher one).

    NOTE: the unique row is the claim (one per threshold, period, limit and the limit's kind: `SpendAlert`'s
    constraint): whoever inserts it sends; a rerun finds it and skips. A claim left unsent for
    `CLAIM_LEFT_AFTER` (its worker was killed between the claim and the email: SIGKILL, OOM, the task's hard time
    limit, where no except clause runs) is taken again by a conditional update, its `created_at` the new claim's
    time: the alert was never sent otherwise. At least once: a worker killed after the mail went and before `sent_at`
    was written sends it twice.

    NOTE: a claim's time is PostgreSQL's clock, at its making and its judging: runs go to any worker, and one whose
    clock ran minutes ahead of the claimer's took a claim made a moment before as left, and sent the alert twice."""
    spend_cap = limit.cap
    left_before = ExpressionWrapper(Now() - CLAIM_LEFT_AFTER, output_field=DateTimeField())
    try:
        with transaction.atomic():
            # NOTE: the account's row lock orders runs that judge one threshold at two caps (the cap changed between
            # them), so that one of them sees the other's claim.
            BillingAccount.objects.select_for_update().filter(organization_id=organization_id).first()
            if _alerted_at_this_spend(organization_id, period_start, threshold, limit, left_before):
                return None
            return SpendAlert.objects.create(organization_id=organization_id, period_start=period_start,
                                             threshold_percent=threshold, spend=spend, spend_cap=spend_cap,
                                             limit_reason=limit.reason, created_at=Now())
    except IntegrityError:
        pass
    claim = {"organization_id": organization_id, "period_start": period_start, "threshold_percent": threshold,
             "spend_cap": spend_cap, "limit_reason": limit.reason}
    left = SpendAlert.objects.filter(**claim, sent_at__isnull=True, created_at__lt=left_before)
    if left.update(created_at=Now(), spend=spend) != 1:
        return None
    return SpendAlert.objects.get(**claim)


def _alerted_at_this_spend(organization_id: int, period_start, threshold: int, limit: SpendLimit, left_before) -> bool:
    """Whether `threshold` alerted in the period (sent, or being sent) for a limit of `limit`'s kind at a spend at or
    above `threshold` % of `limit`: the spend has not passed that point since, so an alert now would tell nothing new.

    NOTE: claims were one per distinct cap: an admin setting its cap again and again at or below the spend mailed
    every owner and admin 50, 80 and 100 % for each value. Now a threshold alerts again in a period only once the spend
    has grown past its share of the cap of the moment since it last alerted: a cap lowered under the spend alerts
    nothing new, a cap raised warns again when the spend reaches it.

    NOTE: alerts of the limit's own kind only (`SpendAlert.limit_reason`): each kind's mail says what stops calls and
    what to do. Judged against alerts of any kind, an organisation that had reached its own cap and raised it, then
    was held by staff to a ceiling under its spend (or lost its card), had its calls refused and no mail saying so,
    nor what to do (a review's finding). An alert made before the kind was kept (`billing/0038`), or by a pod of the
    release before, has none and counts for no kind: at most one alert more."""
    return SpendAlert.objects.filter(
        Q(sent_at__isnull=False) | Q(created_at__gte=left_before), organization_id=organization_id,
        period_start=period_start, threshold_percent=threshold, limit_reason=limit.reason,
        spend__gte=limit.cap * threshold / 100).exists()


def _recipients(organization) -> list[str]:
    """The owners' and admins' addresses."""
    return list(
        Membership.objects.filter(organization=organization, role__in=[Role.OWNER, Role.ADMIN])
        .exclude(user__email="").values_list("user__email", flat=True)
    )


def send_hold(account: BillingAccount) -> None:
    """Tell owners and admins that an unpaid invoice or a disputed payment has stopped their inference
    (`billing.standing.hold_reason`)."""
    organization = account.organization
    recipients = _recipients(organization)
    if not recipients:
        return
    billing_page = f"{settings.PUBLIC_URL}{reverse('console:billing')}"
    if standing.hold_reason(account) == standing.DISPUTED:
        send_mail(
            f"{one_line(organization.name)}: inference is stopped because a payment is disputed",
            "A payment of your organisation was disputed with the card's bank (a chargeback), so inference calls are "
            "refused (HTTP 402). Your endpoints, keys and data are kept.\n\n"
            "If the dispute was made in error, ask the card's bank to withdraw it: calls resume when it closes in our "
            "favour. Otherwise contact us to settle the payment: we lift the hold once it is settled.\n\n"
            f"Billing page: {billing_page}\n",
            None, recipients,
        )
        return
    send_mail(
        f"{one_line(organization.name)}: inference is stopped until an unpaid invoice is paid",
        "A payment for one of your invoices failed and the invoice is still unpaid, so inference calls are "
        "refused (HTTP 402). Your endpoints, keys and data are kept.\n\n"
        f"Pay the invoice from the billing page: {billing_page}\n",
        None, recipients,
    )


def _send(account: BillingAccount, limit: SpendLimit, threshold: int, spend: Decimal, *, shared: bool) -> None:
    organization = account.organization
    recipients = _recipients(organization)
    if not recipients:
        return
    what, remedy, noun, lift = {
        PAYMENT_METHOD: ("the monthly limit of accounts without a payment method", "a payment method is added", "limit",
                         " Add a payment method to lift it."),
        SPEND_CEILING: ("its monthly spending ceiling for its payment history",
                        "invoices are paid or support raises it", "ceiling",
                        " It rises as invoices are paid; contact support to raise it sooner."),
        SPEND_CEILING_STAFF: ("the monthly spending ceiling Inferplane staff set for it", "support changes it", "ceiling",
                              " It was set by Inferplane staff: contact support to change it."),
    }.get(limit.reason, ("its monthly spend cap", "the cap is raised", "cap", ""))
    if threshold >= 100:
        subject = f"{one_line(organization.name)} reached {what}"
        consequence = f"Inference calls are refused (HTTP 402) until {remedy} or the month ends."
    else:
        subject = f"{one_line(organization.name)} used {threshold}% of {what}"
        consequence = "Calls are refused once it is reached." + lift
    if shared and limit.reason == SPEND_CEILING:
        consequence += (" The ceiling is shared with other organisations using the same card: what they spend this "
                        "month counts against it too, so calls may be refused sooner.")
    body = (
        f"Spend this month: ${spend:.2f} of a ${limit.cap:.2f} {noun}.\n{consequence}\n\n"
        f"Billing settings: {settings.PUBLIC_URL}{reverse('console:billing')}\n"
    )
    send_mail(subject, body, None, recipients)


def check_all_spend_alerts() -> int:
    num_sent = 0
    # NOTE: "this month" read once for the beat (PostgreSQL's clock), not once more per organisation
    now = database_now()
    capped = Q(spend_cap__gt=0)
    if bills_through_stripe():
        # NOTE: of the (many) postpaid accounts held to the limit without a card or to a spending ceiling
        # (`billing.standing`), only those that spent this month.
        spent = UsageRecord.objects.filter(organization_id=OuterRef("organization_id"),
                                           finished_at__gte=period_containing(now).start)
        capped |= Q(Exists(spent), mode=BillingMode.POSTPAID, invoiced_without_card=False)
    for organization_id in BillingAccount.objects.filter(capped).values_list("organization_id", flat=True):
        try:
            num_sent += len(check_spend_alerts(organization_id, now=now))
        except Exception:
            logger.exception("spend alerts failed for organisation %s", organization_id)
    return num_sent
