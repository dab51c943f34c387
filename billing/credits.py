"""Prepaid credit: grants with an amount and an expiry, drawn down by usage, soonest expiry first."""

from __future__ import annotations

import logging
from datetime import datetime
from decimal import Decimal

from django.db import connection, transaction
from django.utils import timezone

from billing.ledger import undrawn_prepaid_usage
from billing.models import BillingAccount, CreditGrant, credit_returns, credit_shares
from billing.quota.counters import refresh_limits
from controlplane.accounts.services import Actor, record_audit

logger = logging.getLogger(__name__)


def grant_credits(actor: Actor, organization, *, amount: Decimal, expires_at: datetime | None = None,
                  note: str = "", granted_at: datetime | None = None) -> CreditGrant:
    if amount <= 0:
        raise ValueError("a credit grant must be positive")
    with transaction.atomic():
        grant = CreditGrant.objects.create(
            organization=organization, amount=amount, expires_at=expires_at, note=note,
            granted_at=granted_at or timezone.now(),
        )
        record_audit(actor, organization, "billing.grant_credits", grant, amount=str(amount),
                     expires_at=expires_at.isoformat() if expires_at else None)
        # NOTE: with the grant, until `refresh_limits` has dropped Redis's credit figure (`billing.services`).
        account = BillingAccount.objects.for_organization(organization.pk)
        BillingAccount.objects.filter(pk=account.pk).update(limits_stale=True)
    refresh_limits(account)
    return grant


def draw_due_credits() -> int:
    """Draw credit for every account whose prepaid usage changed since its last draw (`credit_draw_due`, set with the
    rollups), each on its own: one that fails stays due for the next run. Returns how many were drawn."""
    num_drawn = 0
    for organization_id in BillingAccount.objects.filter(credit_draw_due=True).values_list("organization_id", flat=True):
        try:
            draw_credits(organization_id)
        except Exception:  # noqa: BLE001 - one account's failure must not leave the others undrawn
            logger.exception("drawing the credit of organisation %s failed; the next run draws it", organization_id)
            continue
        num_drawn += 1
    return num_drawn


def draw_credits(organization_id: int, *, now: datetime | None = None) -> Decimal:
    """Draw the ledger's prepaid spend not yet drawn from the grants it was made under (`billing.models.credit_shares`:
    each part of it from the grants not expired when it started, soonest expiry first).

    Only usage rows written in prepaid mode draw credit (postpaid rows are metered to Stripe).
    Idempotent: the account remembers how much of the prepaid ledger it has drawn, and from when on the database's
    clock its rows are new (`ledger.undrawn_prepaid_usage`). The gateway never settles more than it reserved against
    the credit left, so spend beyond it can only come from a grant expiring while a request ran; it is drawn as
    nothing. Returns the amount taken from grants now.

    Less in the ledger than drawn (a superseding row cheaper than the row it replaced: `billing.rollups`) gives the
    difference back (`_give_back`; returned negative), once: `credit_drawn` goes down by what was given back.
    """
    now = now or timezone.now()
    with transaction.atomic():
        account = BillingAccount.objects.select_for_update().for_organization(organization_id)
        with connection.cursor() as cursor:
            cursor.execute("SELECT now()")
            drawn_at = cursor.fetchone()[0]
        BillingAccount.objects.filter(pk=account.pk).update(credit_draw_due=False, credit_drawn_at=drawn_at)
        # NOTE: the amount and its parts in one statement: read in two, a row committed between them was in the
        # parts alone, the newest, and pushed out an older row not drawn yet (dated at the draw: paid twice).
        undrawn, usage = undrawn_prepaid_usage(account)
        if undrawn < 0:
            given_back = _give_back(organization_id, -undrawn, usage, now=now)
            BillingAccount.objects.filter(pk=account.pk).update(credit_drawn=account.credit_drawn - given_back)
            return -given_back
        if undrawn == 0:
            return Decimal(0)
        grants = list(CreditGrant.objects.paying_for(organization_id, since=usage[0][0], now=now).select_for_update())
        shares = credit_shares(grants, usage)
        for grant in grants:
            if grant.pk in shares:
                CreditGrant.objects.filter(pk=grant.pk).update(consumed=grant.consumed + shares[grant.pk])
        BillingAccount.objects.filter(pk=account.pk).update(credit_drawn=account.credit_drawn + undrawn)
    # The Redis figure already counted this spend; it stays right. A new figure comes from the grants.
    return sum(shares.values(), Decimal(0))


def _give_back(organization_id: int, amount: Decimal, overcharge: list[tuple[datetime, Decimal]], *,
               now: datetime) -> Decimal:
    """Give `amount` of drawn credit back to the organisation's grants, under the account's lock (`draw_credits`): each
    part of `overcharge` (when it began and by how much: `ledger.undrawn_prepaid_usage`) to the grants it was drawn
    from, latest expiry first, within what each has consumed (`billing.models.credit_returns`); what they do not hold
    (usage dated at a draw rather than at its start paid by a grant made later) to the grants active now that have
    paid for usage, latest expiry first too. Returns what was given back.

    NOTE: a grant that paid and has expired since takes its share back: that credit expired unused, as it would have
    had the usage been priced right when drawn (the customer gains no credit that outlives what paid). What no grant
    holds (the usage was drawn as nothing: `credit_shares`) is not given back: it stays drawn beyond the ledger, and
    the next usage's draw takes that much less (`undrawn_prepaid_usage` nets it)."""
    since = overcharge[0][0] if overcharge else now
    grants = list(CreditGrant.objects.paying_for(organization_id, since=since, now=now).filter(consumed__gt=0)
                  .select_for_update())
    returns = credit_returns(grants, overcharge)
    left = amount - sum(returns.values(), Decimal(0))
    for grant in reversed(grants):
        if left <= 0:
            break
        if grant.is_active(now):
            share = min(left, grant.consumed - returns.get(grant.pk, Decimal(0)))
            if share > 0:
                returns[grant.pk] = returns.get(grant.pk, Decimal(0)) + share
                left -= share
    for grant in grants:
        if grant.pk in returns:
            CreditGrant.objects.filter(pk=grant.pk).update(consumed=grant.consumed - returns[grant.pk])
    return sum(returns.values(), Decimal(0))
