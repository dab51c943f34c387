"""Cost truth of node pools: node-hours paid for, busy vs idle, and their cost, over a period.

A pool's machines cost its `hourly_price` from the moment a launch is requested until it is
terminated, whether they serve anything or not; the idle part is what scale-to-zero of machines
saves. The fleet page, the pools API and `/metrics` all read these numbers from here.

`NodeLaunch` keeps its occupancy as running sums (`idle_s`, `idle_since`), not as a list of
spells, so a launch that straddles the period's edge is clipped as exactly as those sums allow:
booting (requested to joined) and the current idle spell are known intervals and are clipped
exactly; earlier idle spells between joining and now are spread evenly over that stretch. A
launch wholly inside the period gets exactly `NodeLaunch.node_seconds`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import ROUND_HALF_UP, Decimal

from django.db.models import Q
from django.utils import timezone

from endpoints.nodes.models import LIVE_LAUNCH_STATES, LaunchState, NodeLaunch, NodePool

BOOTING_STATES = (LaunchState.REQUESTED, LaunchState.LAUNCHING)
COST_QUANTUM = Decimal("0.0001")
SECONDS_PER_HOUR = 3600


@dataclass(slots=True, frozen=True)
class Period:
    """[start, end) in UTC."""

    start: datetime
    end: datetime

    @classmethod
    def of_days(cls, first: date, last: date) -> Period:
        """From the start of `first` to the end of `last` (inclusive, UTC days)."""
        return cls(datetime.combine(first, time.min, UTC),
                   datetime.combine(last + timedelta(days=1), time.min, UTC))

    @classmethod
    def this_month(cls, now: datetime | None = None) -> Period:
        today = (now or timezone.now()).astimezone(UTC).date()
        return cls.of_days(today.replace(day=1), today)


@dataclass(slots=True, frozen=True)
class PoolUsage:
    """One pool's machines over a period, and how many it holds now."""

    period: Period
    hourly_price: Decimal
    node_s: float = 0.0
    idle_s: float = 0.0
    num_live: int = 0  # launches not finished (LIVE_LAUNCH_STATES): machines paid for now
    num_booting: int = 0  # requested or launching, not joined yet

    @property
    def busy_s(self) -> float:
        return max(0.0, self.node_s - self.idle_s)

    @property
    def node_hours(self) -> float:
        return self.node_s / SECONDS_PER_HOUR

    @property
    def busy_node_hours(self) -> float:
        return self.busy_s / SECONDS_PER_HOUR

    @property
    def idle_node_hours(self) -> float:
        return self.idle_s / SECONDS_PER_HOUR

    @property
    def cost(self) -> Decimal:
        return cost_of(self.node_s, self.hourly_price)

    @property
    def idle_cost(self) -> Decimal:
        return cost_of(self.idle_s, self.hourly_price)

    @property
    def busy_cost(self) -> Decimal:
        return cost_of(self.busy_s, self.hourly_price)


def cost_of(seconds: float, hourly_price: Decimal) -> Decimal:
    # NOTE: seconds rounded to the millisecond first, so float noise never reaches the cost.
    exact = Decimal(str(round(seconds, 3))) * Decimal(hourly_price) / SECONDS_PER_HOUR
    return exact.quantize(COST_QUANTUM, rounding=ROUND_HALF_UP)


def _overlap_s(start: datetime, end: datetime, window: Period) -> float:
    return max(0.0, (min(end, window.end) - max(start, window.start)).total_seconds())


def clipped_node_seconds(launch: NodeLaunch, period: Period, now: datetime) -> tuple[float, float]:
    """(Seconds paid for, of them idle) of `launch` inside `period`, up to `now`."""
    window = Period(period.start, min(period.end, now))
    if window.end <= window.start:
        return 0.0, 0.0
    paid_end = min(launch.terminated_at or now, now)
    if paid_end <= launch.requested_at:
        return 0.0, 0.0
    total = _overlap_s(launch.requested_at, paid_end, window)
    if launch.joined_at is None:
        return total, total  # never joined (booting, or failed to join): all of it idle
    joined_at = min(launch.joined_at, paid_end)
    booting_s = (joined_at - launch.requested_at).total_seconds()
    idle = _overlap_s(launch.requested_at, joined_at, window)
    # The stretch after joining: the open idle spell is known; earlier spells only as a sum.
    spell_start = launch.idle_since if launch.idle_since is not None and launch.terminated_at is None else None
    middle_end = min(spell_start, paid_end) if spell_start is not None else paid_end
    if spell_start is not None:
        idle += _overlap_s(spell_start, paid_end, window)
    earlier_idle_s = max(0.0, launch.idle_s - booting_s)
    middle_s = (middle_end - joined_at).total_seconds()
    if earlier_idle_s and middle_s > 0:
        idle += min(earlier_idle_s, middle_s) * _overlap_s(joined_at, middle_end, window) / middle_s
    return total, min(idle, total)


def launches_in(period: Period, pools=None):
    """Launches that paid for any time in `period` (of `pools`, or every pool)."""
    query = NodeLaunch.objects.filter(requested_at__lt=period.end).filter(
        Q(terminated_at__isnull=True) | Q(terminated_at__gt=period.start))
    if pools is not None:
        query = query.filter(pool__in=pools)
    return query.only("pool_id", "state", "requested_at", "joined_at", "terminated_at", "idle_since", "idle_s")


def usage_by_pool(pools: list[NodePool], period: Period | None = None, now: datetime | None = None) -> dict[int, PoolUsage]:
    """Each pool's usage in `period` (default: this month), keyed by pool id; one query for all."""
    now = now or timezone.now()
    period = period or Period.this_month(now)
    sums = {pool.pk: [0.0, 0.0, 0, 0] for pool in pools}
    for launch in launches_in(period, pools):
        row = sums[launch.pool_id]
        total, idle = clipped_node_seconds(launch, period, now)
        row[0] += total
        row[1] += idle
    current = NodeLaunch.objects.filter(pool__in=pools, state__in=LIVE_LAUNCH_STATES).values_list("pool_id", "state")
    for pool_id, state in current:
        sums[pool_id][2] += 1
        sums[pool_id][3] += state in BOOTING_STATES
    return {
        pool.pk: PoolUsage(period=period, hourly_price=pool.hourly_price, node_s=sums[pool.pk][0],
                           idle_s=sums[pool.pk][1], num_live=sums[pool.pk][2], num_booting=sums[pool.pk][3])
        for pool in pools
    }


def usage_of(pool: NodePool, period: Period | None = None, now: datetime | None = None) -> PoolUsage:
    return usage_by_pool([pool], period, now)[pool.pk]
