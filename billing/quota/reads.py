"""What the quota counters in Redis hold now (for the console and tests)."""

from __future__ import annotations

from decimal import Decimal

from billing.periods import Period, period_containing
from billing.quota.counters import from_units
from controlplane.clock import redis_datetime
from controlplane.redis_client import get_redis
from controlplane.redis_keys import org_period_key, org_reserved_key


def reserved_now(organization_id: int) -> Decimal:
    """Outstanding reservations of an organisation (for the console and tests)."""
    return from_units(int(get_redis().get(org_reserved_key(organization_id)) or 0))


def counted_spend(organization_id: int, period: Period | None = None) -> Decimal | None:
    """Settled spend as Redis counts it this period, or None when the counter is not built.

    NOTE: this period by Redis's clock (`redis_datetime`), as the gateway names the counter it settles into
    (`billing.quota.counters`); no database read, so it may be asked from the gateway's loop."""
    period = period or period_containing(redis_datetime())
    spent = get_redis().hget(org_period_key(organization_id, period.key), "spent")
    return from_units(int(spent)) if spent is not None else None
