"""Billing periods: calendar months in UTC."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from controlplane.clock import database_now


@dataclass(slots=True, frozen=True)
class Period:
    start: datetime
    end: datetime  # exclusive
    # A short stable name, used in Redis keys: `202607`. NOTE: computed once: the gateway reads it
    # several times per request.
    key: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self.start:%Y%m}")


_latest: Period | None = None


def period_containing(moment: datetime | None = None) -> Period:
    global _latest
    moment = (moment or datetime.now(UTC)).astimezone(UTC)
    latest = _latest  # NOTE: the gateway asks for the current period on every request
    if latest is not None and latest.start <= moment < latest.end:
        return latest
    start = moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    _latest = Period(start=start, end=end)
    return _latest


def current_period() -> Period:
    """The period now by PostgreSQL's clock (`controlplane.clock.database_now`): the month a spend, a limit or what a
    tenant is shown is read in, on a web pod or a worker (a gateway picks its reservations' by Redis's clock,
    `billing.quota.counters`).

    NOTE: `period_containing()` with no moment took this process's clock: near a month's edge a pod minutes behind read
    last month's spend as this month's (its cap alerts, the billing overview, a card's others' spend behind the spending
    ceiling's room written to the gateway), one ahead a month with nothing spent yet (`tests/billing/test_period_clock.py`)."""
    return period_containing(database_now())


def periods_near(slack: timedelta, moment: datetime | None = None) -> tuple[Period, ...]:
    """The periods within `slack` of `moment` (now): its own, and the one before or after it near a month's edge."""
    moment = (moment or datetime.now(UTC)).astimezone(UTC)
    near: dict[str, Period] = {}
    for at in (moment - slack, moment, moment + slack):
        period = period_containing(at)
        near.setdefault(period.key, period)
    return tuple(near.values())
