"""Prepaid credit: grants with an amount and an expiry, drawn down by usage, soonest expiry first."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from django.db import connection, transaction
from django.db.models import Q

from billing.ledger import undrawn_prepaid_usage
from billing.models import BillingAccount, CreditDraw, CreditGrant, CreditKind, credit_draw
from billing.quota.counters import refresh_limits
from controlplane.accounts.models import lock_organizations
from controlplane.accounts.services import Actor, ensure_open, record_audit
from controlplane.clock import database_now

logger = logging.getLogger(__name__)


def grant_credits(actor: Actor, organization, *, amount: Decimal, expires_at: datetime | None = None,
                  note: str = "", granted_at: datetime | None = None,
                  kind: str = CreditKind.PURCHASED) -> CreditGrant:
    """Raises `OrganizationClosed` for a closed organisation: credit there is nobody's to use, and purchased credit
    would be kept by nobody (a close refunds none: `endpoints.closing.credit_refusal`)."""
    if amount <= 0:
        raise ValueError("a credit grant must be positive")
    with transaction.atomic():
        # NOTE: under the organisation's row lock, which its close holds while it judges the credit left: a grant
        # either committed first (and holds the close) or waits for it and is refused here. Before, one made while the
        # close ran, or after it, left purchased credit on a closed organisation.
        lock_organizations([organization.pk])
        ensure_open(organization.pk, "organization")
        grant = CreditGrant.objects.create(
            organization=organization, amount=amount, expires_at=expires_at, note=note, kind=kind,
            # NOTE: by PostgreSQL's clock, as the credit figure judges it (`rebuild.credit_available`): by a web pod's
            # 10 minutes ahead, a top-up was refused (402) for 10 minutes
            granted_at=granted_at or database_now(),
        )
        record_audit(actor, organization, "billing.grant_credits", grant, amount=str(amount), kind=kind,
                     expires_at=expires_at.isoformat() if expires_at else None)
        # NOTE: with the grant, until `refresh_limits` has dropped Redis's credit figure (`billing.services`).
        account = BillingAccount.objects.for_organization(organization.pk)
        BillingAccount.objects.filter(pk=account.pk).update(limits_stale=True)
    refresh_limits(account)
    return grant


@dataclass(slots=True, frozen=True)
class RemainingCredit:
    """What the organisation's active grants hold, by kind (USD), as drawn so far (usage not drawn yet is not off it)."""

    purchased: Decimal
    promotional: Decimal


def _not_ended(grants, now: datetime):
    """Those of `grants` not expired at `now`, whether they started or start later (`granted_at` ahead)."""
    return grants.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))


def remaining_credit(organization_id: int, *, now: datetime | None = None) -> RemainingCredit:
    """The credit the organisation's grants not expired now (PostgreSQL's clock, as they are stamped) hold, by kind:
    those that start later too. NOTE: before, only those active now: a close went through while purchased credit was
    still to come (a grant dated ahead), and a promotional one dated ahead was not forfeited."""
    now = now or database_now()
    left = {CreditKind.PURCHASED: Decimal(0), CreditKind.PROMOTIONAL: Decimal(0)}
    for grant in _not_ended(CreditGrant.objects.filter(organization_id=organization_id), now):
        left[grant.kind] = left.get(grant.kind, Decimal(0)) + grant.remaining
    return RemainingCredit(purchased=left[CreditKind.PURCHASED], promotional=left[CreditKind.PROMOTIONAL])


def forfeit_promotional_credit(actor: Actor, organization, *, now: datetime) -> Decimal:
    """End the organisation's active promotional grants at `now` (its close): what they held is forfeited, audited
    with its amount. Usage begun before `now` is still drawn from them (`CreditGrantQuerySet.paying_for`)."""
    grants = list(_not_ended(CreditGrant.objects.filter(organization=organization, kind=CreditKind.PROMOTIONAL), now)
                  .select_for_update())
    forfeited = sum((grant.remaining for grant in grants), Decimal(0))
    CreditGrant.objects.filter(pk__in=[grant.pk for grant in grants]).update(expires_at=now)
    if grants:
        record_audit(actor, organization, "billing.forfeit_promotional_credit", None, amount=str(forfeited),
                     grants=[grant.pk for grant in grants])
        # NOTE: Redis's credit figure dropped, as a refund's is (`end_refunded_grants`): kept, the gateway went on
        # admitting the organisation's calls against the forfeited amount (a key or session still cached, a batch's
        # lines), drawn from no grant (`credit_unpaid`): free compute. Once the close commits (`refresh_limits`).
        account = BillingAccount.objects.for_organization(organization.pk)
        BillingAccount.objects.filter(pk=account.pk).update(limits_stale=True)
        refresh_limits(account)
    return forfeited


def end_refunded_grants(actor: Actor, grants) -> Decimal:
    """End `grants` now (PostgreSQL's clock) because support refunded what they held (in Stripe, by hand): their
    remaining credit no longer pays for anything, audited with its amount per grant. Returns the total ended.

    NOTE: their organisations' usage already in the ledger is drawn first (`draw_credits`): before, what a grant held
    was read as drawn so far, and usage recorded but not drawn yet (the draw follows the rollups, each minute) was then
    drawn from the grant just ended (it began before the end): support refunded it, and the customer had it for free.
    Only calls still running at the end are drawn from it later (at most a reservation's worth each)."""
    for organization_id in sorted({grant.organization_id for grant in grants}):
        draw_credits(organization_id)
    now = database_now()
    total = Decimal(0)
    with transaction.atomic():
        for grant in _not_ended(CreditGrant.objects.filter(pk__in=[grant.pk for grant in grants]), now).select_for_update():
            CreditGrant.objects.filter(pk=grant.pk).update(expires_at=now)
            total += grant.remaining
            record_audit(actor, grant.organization, "billing.credit_refunded", grant, amount=str(grant.remaining),
                         kind=grant.kind)
            BillingAccount.objects.filter(organization_id=grant.organization_id).update(limits_stale=True)
    for organization_id in {grant.organization_id for grant in grants}:
        refresh_limits(BillingAccount.objects.for_organization(organization_id))
    return total


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
    """Draw the ledger's prepaid spend not yet drawn from the grants it was made under, and give back the overcharges
    made since the last draw (a superseding row cheaper than the row it replaced: `billing.rollups`) to the grants
    that paid for them: both in one transaction under the account's lock, apart (`billing.models.credit_draw`: the
    overcharges first, each to the grants it was drawn from, latest expiry first; then each part of the usage from the
    grants not expired when it started, soonest expiry first).

    Only usage rows written in prepaid mode draw credit (postpaid rows are metered to Stripe).
    Idempotent: the account remembers how much of the prepaid ledger it has drawn (`credit_drawn`, the net of the two)
    and given back (`credit_given_back`), and from when on the database's clock its rows are new
    (`ledger.undrawn_prepaid_usage`); a rerun finds nothing. The gateway never settles more than it reserved against
    the credit left, so spend beyond it can only come from a grant expiring while a request ran; it is drawn as
    nothing (`credit_unpaid`: an overcharge of it later gives no grant credit back). Returns what the grants took now
    less what they got back.
    """
    now = now or database_now()  # NOTE: the clock the grants are stamped by (`grant_credits`)
    with transaction.atomic():
        account = BillingAccount.objects.select_for_update().for_organization(organization_id)
        with connection.cursor() as cursor:
            cursor.execute("SELECT now()")
            drawn_at = cursor.fetchone()[0]
        # NOTE: the amounts and their parts in one statement: read in two, a row committed between them was in the
        # parts alone, the newest, and pushed out an older row not drawn yet (dated at the draw: paid twice).
        undrawn = undrawn_prepaid_usage(account)
        draw = CreditDraw({}, {}, account.credit_unpaid)
        if undrawn.drawn > 0 or undrawn.returned > 0:
            dates = [started_at for started_at, _ in (*undrawn.usage, *undrawn.overcharge)]
            grants = list(CreditGrant.objects.paying_for(organization_id, since=min(dates, default=now), now=now)
                          .select_for_update())
            draw = credit_draw(grants, undrawn.usage, undrawn.overcharge, returned=undrawn.returned,
                               unpaid=account.credit_unpaid, now=now)
            for grant in grants:
                change = draw.taken.get(grant.pk, Decimal(0)) - draw.returned.get(grant.pk, Decimal(0))
                if change:
                    CreditGrant.objects.filter(pk=grant.pk).update(consumed=grant.consumed + change)
        BillingAccount.objects.filter(pk=account.pk).update(
            credit_draw_due=False, credit_drawn_at=drawn_at, credit_drawn=account.credit_drawn + undrawn.amount,
            credit_given_back=undrawn.overcharged, credit_unpaid=draw.unpaid)
    # The Redis figure already counted this spend; it stays right. A new figure comes from the grants.
    return sum(draw.taken.values(), Decimal(0)) - sum(draw.returned.values(), Decimal(0))
