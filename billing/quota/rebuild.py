"""A quota counter that Redis lost (a flush, a new period, an expired credit figure), rebuilt from
PostgreSQL: spend is the ledger's sum, credit what the grants leave after it."""

from __future__ import annotations

import logging
from collections.abc import Collection
from contextlib import contextmanager
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal

from asgiref.sync import sync_to_async
from django.db import DatabaseError, close_old_connections, connection, transaction
from django.utils import timezone

from billing.ledger import period_spend_and_pending, undrawn_prepaid_spend_and_pending, undrawn_usage_began
from billing.models import ApiKeySpendCap, BillingAccount, CreditGrant
from billing.periods import Period, period_containing
from billing.quota.counters import PERIOD_TTL_S, Reservation, limit_fields, refresh_limits, to_units
from controlplane.redis_client import get_async_redis
from controlplane.redis_keys import (
    credit_journaled_key,
    credit_key,
    key_period_key,
    limits_refreshed_key,
    org_period_key,
    reservations_key,
    settled_key,
)
from controlplane.redis_scripts import Script

logger = logging.getLogger("inferplane.billing")

CREDIT_FIGURE_MAX_TTL_S = 3600
# At most one rewrite of an organisation counter's limits for a version mismatch in this long (`rebuild_missing`).
LIMITS_REFRESH_INTERVAL_S = 10

# KEYS: a period counter (a hash), the organisation's reservations, then the settled marker of each pending call;
# ARGV: ttl, each pending call's request id, then each one's cost (units, > 0), then the hash's field/value pairs.
# Writes the hash only if nobody did meanwhile, its spend less the cost of each pending call still reserved and not
# settled, whose own settlement (`counters.SETTLE`) adds it once the counter exists.
_INIT_SPEND = Script("""
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local pending = #KEYS - 2
redis.call('HSET', KEYS[1], unpack(ARGV, 2 + 2 * pending))
redis.call('EXPIRE', KEYS[1], ARGV[1])
for i = 1, pending do
  if redis.call('HEXISTS', KEYS[2], ARGV[1 + i]) == 1 and redis.call('EXISTS', KEYS[2 + i]) == 0 then
    redis.call('HINCRBY', KEYS[1], 'spent', '-' .. ARGV[1 + pending + i])
  end
end
return 1
""")


# KEYS: the credit figure, the organisation's reservations, the journaled calls the figure counted, then the settled
# marker of each pending call; ARGV: ttl, the figure (units), each pending call's request id, then each one's cost
# (units, > 0). Writes the figure only if nobody did meanwhile, with the cost of each pending call still reserved and
# not settled given back: its own settlement (`counters.SETTLE`) takes it once the figure exists. NOTE: the figure
# counted it, then the settlement took it again: a prepaid account refused (402) early for up to an hour after any
# grant or mode change. A new figure has counted no journaled call (`replayed`): what the last one had is dropped.
_INIT_CREDIT = Script("""
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[1])
redis.call('DEL', KEYS[3])
local pending = #KEYS - 3
for i = 1, pending do
  if redis.call('HEXISTS', KEYS[2], ARGV[2 + i]) == 1 and redis.call('EXISTS', KEYS[3 + i]) == 0 then
    redis.call('INCRBY', KEYS[1], ARGV[2 + pending + i])
  end
end
return 1
""")


@dataclass(slots=True, frozen=True)
class _Rebuild:
    key: str
    fields: dict[str, str] | None  # a hash, or
    value: str | None  # a plain counter
    ttl_s: int
    # a hash's: request id -> cost (units) of the rows in its spend whose calls were still reserved (`_INIT_SPEND`)
    pending: dict[str, int] = field(default_factory=dict)


def _rebuild_from_database(what: str, organization_id: int, api_key_id: int | None, period: Period,
                           reserved_ids: Collection[str] = ()) -> _Rebuild:
    """The counter `what` as PostgreSQL has it; `reserved_ids`: the organisation's reservations (read before),
    whose calls may have a row in the period's spend and settle after the counter is written."""
    close_old_connections()  # NOTE: runs in a worker thread whose connection may have gone stale
    if what in ("org", "key"):
        spent, pending = period_spend_and_pending(organization_id, period, reserved_ids,
                                                  api_key_id=api_key_id if what == "key" else None)
    if what == "org":
        account = BillingAccount.objects.for_organization(organization_id)
        return _Rebuild(org_period_key(organization_id, period.key), {"spent": str(to_units(spent))} | limit_fields(account),
                        None, PERIOD_TTL_S, _units(pending))
    if what == "key":
        key_cap = ApiKeySpendCap.objects.filter(api_key_id=api_key_id).values_list("spend_cap", flat=True).first()
        fields = {"spent": str(to_units(spent)), "cap": str(to_units(key_cap) if key_cap is not None else -1)}
        return _Rebuild(key_period_key(organization_id, api_key_id, period.key), fields, None, PERIOD_TTL_S, _units(pending))
    if what == "credit":
        available, ttl_s, pending = _credit_and_pending(organization_id, reserved_ids)
        return _Rebuild(credit_key(organization_id), None, str(to_units(available, ROUND_HALF_UP)), ttl_s, _units(pending))
    raise ValueError(what)


def _units(pending: dict[str, Decimal]) -> dict[str, int]:
    return {request_id: units for request_id, cost in pending.items() if (units := to_units(cost)) > 0}


def credit_available(organization_id: int, *, now=None) -> tuple[Decimal, int]:
    """Prepaid credit left now (active grants less usage not yet drawn from them), and for how many
    seconds that figure holds before a grant starts or expires."""
    available, ttl_s, _ = _credit_and_pending(organization_id, (), now=now)
    return available, ttl_s


def _credit_and_pending(organization_id: int, reserved_ids: Collection[str], *,
                        now=None) -> tuple[Decimal, int, dict[str, Decimal]]:
    """`credit_available`, and the cost of each prepaid row in it whose call is one of `reserved_ids`."""
    now = now or timezone.now()
    BillingAccount.objects.for_organization(organization_id)  # made first if need be: the snapshot only reads
    with _one_snapshot():
        # NOTE: one snapshot for the account's `credit_drawn`, the grants and the ledger. A draw (`draw_credits`)
        # committed between two of these reads was counted twice: the grants had taken it while `credit_drawn`
        # still left it undrawn, and a prepaid account near the end of its credit was refused (402) early for up
        # to the figure's TTL.
        account = BillingAccount.objects.get(organization_id=organization_id)
        grants = list(CreditGrant.objects.filter(organization_id=organization_id))
        undrawn, pending = undrawn_prepaid_spend_and_pending(account, reserved_ids)
        # NOTE: what expired after the usage not drawn yet began pays first for it, as the draw will take it
        # (`CreditGrantQuerySet.paying_for`), and never for anything more.
        since = undrawn_usage_began(account) or now
        lapsed = [grant for grant in CreditGrant.objects.paying_for(organization_id, since=since, now=now)
                  if not grant.is_active(now)]
    active = [grant for grant in grants if grant.is_active(now)]
    undrawn_on_active = max(undrawn - sum((grant.remaining for grant in lapsed), Decimal(0)), Decimal(0))
    available = sum((grant.remaining for grant in active), Decimal(0)) - undrawn_on_active
    changes = [g.expires_at for g in active if g.expires_at] + [g.granted_at for g in grants if g.granted_at > now]
    ttl_s = CREDIT_FIGURE_MAX_TTL_S
    if changes:
        ttl_s = max(1, min(ttl_s, int((min(changes) - now).total_seconds()) + 1))
    return available, ttl_s, pending


@contextmanager
def _one_snapshot():
    """A read-only transaction whose reads all see the database as it was at the first of them (REPEATABLE READ):
    what others commit meanwhile stays unseen, and nothing is locked. Inside a caller's transaction, its reads are
    that one's. NOTE: `SET LOCAL` (as `SET TRANSACTION`, before the first read) keeps no session state
    (`DATABASE_POOLER=transaction`)."""
    if connection.in_atomic_block:
        yield
        return
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL transaction_isolation = 'repeatable read'")
            cursor.execute("SET LOCAL transaction_read_only = on")
        yield


async def _write_rebuild(rebuild: _Rebuild, organization_id: int) -> None:
    request_ids = list(rebuild.pending)
    markers = [settled_key(organization_id, request_id) for request_id in request_ids]
    costs = [rebuild.pending[request_id] for request_id in request_ids]
    if rebuild.fields is not None:
        await _INIT_SPEND(keys=[rebuild.key, reservations_key(organization_id), *markers],
                          args=[rebuild.ttl_s, *request_ids, *costs,
                                *[item for pair in rebuild.fields.items() for item in pair]])
    else:
        await _INIT_CREDIT(keys=[rebuild.key, reservations_key(organization_id), credit_journaled_key(organization_id),
                                 *markers], args=[rebuild.ttl_s, rebuild.value, *request_ids, *costs])


async def rebuild_missing(what: str, reservation: Reservation) -> bool:
    """`quota_reserve` answered {'missing', what}: rebuild that counter from PostgreSQL. True when the
    caller should take the organisation counter's limits as they stand (`any_limits`).

    NOTE: during a rolling deploy that changes `limits_version` (this code's fields, the limit without a
    payment method, Stripe's set-up) pods of both versions find the other's `lv`. Each would rewrite the
    limits under the account's row lock on every request, and a request whose every attempt found the
    other's failed. So a version mismatch rewrites the limits at most once per organisation per
    `LIMITS_REFRESH_INTERVAL_S`; meanwhile calls take the limits the other version wrote moments ago."""
    period = period_containing()
    if period.key != reservation.period_key:
        return False  # a new month began meanwhile: the caller prepares the reservation again
    if what == "limits" and not await get_async_redis().set(
            limits_refreshed_key(reservation.organization_id), "1", nx=True, ex=LIMITS_REFRESH_INTERVAL_S):
        return True
    if what != "limits":  # 'limits': the counter exists, its spend stands; only its limits are written again
        organization_id = reservation.organization_id
        # NOTE: read before the ledger. A call reserved then whose row the ledger has may settle after the counter is
        # written (the row is written first; a call reserved in the last month spends in this one when it finishes
        # in it), and adds its cost then: the counter is written without it (`_INIT_SPEND`). A call reserved since
        # found this counter missing (its own rebuild wrote it first, or ours does) and reserved nothing.
        reserved_ids = await get_async_redis().hkeys(reservations_key(organization_id))
        rebuild = await sync_to_async(_rebuild_from_database)(what, organization_id, reservation.api_key_id,
                                                              period, reserved_ids)
        await _write_rebuild(rebuild, organization_id)
    if what in ("org", "limits"):
        # NOTE: the limits read (again) after the counter exists, under the account's lock: a change committed
        # between the rebuild's read and its write refreshed nothing (no counter yet), and would otherwise stay
        # unseen for the month.
        await sync_to_async(_limits_again)(reservation.organization_id)
    return False


def _limits_again(organization_id: int) -> None:
    """NOTE: a database that serves reads and refuses writes (a failover's demoted primary, a full disk) refuses the
    refresh's row lock: the limits just rebuilt from it stand, as good as it can tell, and the call goes on. It raised
    `InternalError` (read-only transaction), not an outage: every call that found its counter missing was a 500 for
    the rest of the outage."""
    close_old_connections()
    try:
        refresh_limits(BillingAccount.objects.for_organization(organization_id), credit=False)
    except DatabaseError as exc:
        logger.warning("organisation %s: its limits are not read again under its lock (%s); the rebuilt ones stand",
                       organization_id, type(exc).__name__)
