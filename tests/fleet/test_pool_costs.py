"""Cost truth of node pools: node-hours paid for, busy vs idle, and their cost, clipped to a period."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from endpoints.fleet import launches
from endpoints.fleet.pool_costs import Period, clipped_node_seconds, usage_by_pool, usage_of
from endpoints.gateway import metrics
from endpoints.nodes.models import LaunchState, Node, NodeLaunch, NodePool

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 10, 12, 0, tzinfo=UTC)
NOVEMBER = Period.of_days(datetime(2026, 11, 1).date(), datetime(2026, 11, 30).date())


def make_pool(name="l4-pool", price="2.40", **fields):
    return NodePool.objects.create(name=name, gpu_type="l4", provider="local", hourly_price=Decimal(price),
                                   gpu_memory_mb=23_034, max_nodes=4, **fields)


def make_launch(pool, requested_at=T0, **fields):
    return NodeLaunch.objects.create(pool=pool, requested_at=requested_at,
                                     deadline_at=requested_at + timedelta(minutes=10), **fields)


def make_node(name):
    return Node.objects.create(name=name, gpu_type="l4", num_gpus=1, gpu_memory_mb=23_034,
                               secret_lookup=name.ljust(12, "0"), secret_digest="x")


def run_machine(pool, name="m-1", start=T0):
    """Requested at start, joined 90 s later, busy 10 min, idle 20 min, terminated."""
    launch = make_launch(pool, requested_at=start)
    launches.link_joined_node(make_node(name), launch=launch, now=start + timedelta(seconds=90))
    launch.refresh_from_db()
    launches.record_occupancy(launch, busy=True, now=start + timedelta(seconds=90))
    launches.record_occupancy(launch, busy=False, now=start + timedelta(seconds=90 + 600))
    launches.finish_launch(launch, LaunchState.TERMINATED, "idle", now=start + timedelta(seconds=90 + 600 + 1200))
    return launch


def test_a_machine_booting_90_s_busy_10_min_and_idle_20_min_costs_exactly_its_node_hours():
    pool = make_pool()
    run_machine(pool)

    usage = usage_of(pool, NOVEMBER, now=T0 + timedelta(hours=5))

    assert usage.node_s == 1890 and usage.idle_s == 90 + 1200 and usage.busy_s == 600
    assert usage.node_hours == pytest.approx(0.525) and usage.busy_node_hours == pytest.approx(1 / 6)
    assert usage.idle_node_hours == pytest.approx(1290 / 3600)
    assert (usage.cost, usage.busy_cost, usage.idle_cost) == (Decimal("1.2600"), Decimal("0.4000"), Decimal("0.8600"))
    assert (usage.num_live, usage.num_booting) == (0, 0)


def test_a_whole_launch_inside_the_period_counts_what_the_launch_itself_says():
    pool = make_pool()
    launch = run_machine(pool)

    assert clipped_node_seconds(launch, NOVEMBER, T0 + timedelta(days=1)) == launch.node_seconds()


def test_a_period_that_ends_mid_launch_clips_booting_exactly_and_spreads_its_finished_idle_spells():
    pool = make_pool()
    launch = run_machine(pool)
    # To T0 + 10 min: 90 s booting (idle), then 510 s of the 1800 s joined, in which 1200 s were idle
    # (when, the launch no longer says once it is terminated).
    cut = Period(T0 - timedelta(hours=1), T0 + timedelta(minutes=10))

    total, idle = clipped_node_seconds(launch, cut, T0 + timedelta(days=1))

    assert total == 600 and idle == pytest.approx(90 + 1200 * 510 / 1800)


def test_a_launch_still_running_counts_up_to_now_with_its_open_idle_spell():
    pool = make_pool()
    launch = make_launch(pool)
    launches.link_joined_node(make_node("m-1"), launch=launch, now=T0 + timedelta(seconds=60))
    launch.refresh_from_db()
    launches.record_occupancy(launch, busy=True, now=T0 + timedelta(seconds=60))
    launches.record_occupancy(launch, busy=False, now=T0 + timedelta(seconds=60 + 1800))
    now = T0 + timedelta(hours=1)

    usage = usage_of(pool, NOVEMBER, now=now)

    assert (usage.node_s, usage.idle_s, usage.busy_s) == (3600, 60 + 1740, 1800)
    assert usage.cost == Decimal("2.4000") and usage.idle_cost == Decimal("1.2000")
    assert (usage.num_live, usage.num_booting) == (1, 0)


def test_a_launch_from_last_month_counts_only_its_hours_in_this_month():
    pool = make_pool(price="1.00")
    start = datetime(2026, 10, 31, 23, 0, tzinfo=UTC)  # an hour before November
    launch = make_launch(pool, requested_at=start)
    launches.link_joined_node(make_node("m-1"), launch=launch, now=start + timedelta(minutes=30))
    launch.refresh_from_db()
    launches.record_occupancy(launch, busy=True, now=start + timedelta(minutes=30))  # busy from 23:30 on
    now = start + timedelta(hours=3)

    usage = usage_of(pool, NOVEMBER, now=now)

    assert (usage.node_s, usage.idle_s) == (2 * 3600, 0)  # its 30 min of booting were in October
    assert usage.cost == Decimal("2.0000")


def test_earlier_idle_spells_of_a_straddling_launch_are_spread_over_its_joined_time():
    pool = make_pool(price="1.00")
    start = datetime(2026, 10, 31, 23, 0, tzinfo=UTC)
    launch = make_launch(pool, requested_at=start)
    launches.link_joined_node(make_node("m-1"), launch=launch, now=start)  # joined at once, idle
    launch.refresh_from_db()
    launches.record_occupancy(launch, busy=True, now=start + timedelta(hours=1))  # 1 h idle, then busy
    launches.finish_launch(launch, LaunchState.TERMINATED, now=start + timedelta(hours=2))

    total, idle = clipped_node_seconds(launch, NOVEMBER, start + timedelta(hours=5))

    # 1 h of 2 h joined was idle, position unknown: half of November's hour.
    assert (total, idle) == (3600, 1800)


def test_a_machine_that_never_joined_is_all_idle_and_booting_ones_are_counted_live():
    pool = make_pool(price="3.00")
    failed = make_launch(pool)
    launches.finish_launch(failed, LaunchState.FAILED, "never joined", now=T0 + timedelta(minutes=10))
    make_launch(pool, requested_at=T0 + timedelta(minutes=50), state=LaunchState.LAUNCHING)
    now = T0 + timedelta(hours=1)

    usage = usage_of(pool, NOVEMBER, now=now)

    assert (usage.node_s, usage.idle_s, usage.busy_s) == (1200, 1200, 0)
    assert usage.cost == usage.idle_cost == Decimal("1.0000")
    assert (usage.num_live, usage.num_booting) == (1, 1)


def test_launches_outside_the_period_and_of_other_pools_count_nothing():
    pool, other = make_pool(), make_pool(name="other")
    run_machine(pool, start=datetime(2026, 10, 2, tzinfo=UTC))
    run_machine(other, name="m-2")

    usage = usage_by_pool([pool, other], NOVEMBER, now=T0 + timedelta(days=1))

    assert usage[pool.pk].node_s == 0 and usage[pool.pk].cost == Decimal("0.0000")
    assert usage[other.pk].node_s == 1890


def test_the_default_period_is_this_calendar_month_in_utc():
    period = Period.this_month(datetime(2026, 2, 14, 8, 30, tzinfo=UTC))

    assert period.start == datetime(2026, 2, 1, tzinfo=UTC)
    assert period.end == datetime(2026, 2, 15, tzinfo=UTC)


def test_metrics_report_each_pools_machines_by_state_and_this_months_hours_and_cost():
    pool = make_pool()
    now = timezone.now()
    hours = min(1.0, (now - Period.this_month(now).start).total_seconds() / 3600)  # this month's part of the hour
    make_launch(pool, requested_at=now - timedelta(hours=1), state=LaunchState.LAUNCHING)
    make_launch(make_pool(name="empty"), requested_at=now - timedelta(days=40), state=LaunchState.TERMINATED,
                terminated_at=now - timedelta(days=39))

    metrics.refresh_fleet_gauges()
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(metrics.render().decode())
               for sample in family.samples if sample.name.startswith("inferplane_pool_")}

    assert samples[("inferplane_pool_nodes", (("pool", "l4-pool"), ("state", "LAUNCHING")))] == 1
    assert samples[("inferplane_pool_node_hours", (("kind", "idle"), ("pool", "l4-pool")))] == pytest.approx(hours, abs=0.01)
    assert samples[("inferplane_pool_node_hours", (("kind", "busy"), ("pool", "l4-pool")))] == 0
    assert samples[("inferplane_pool_cost", (("kind", "idle"), ("pool", "l4-pool")))] == pytest.approx(2.4 * hours, abs=0.05)
    assert samples[("inferplane_pool_cost", (("kind", "idle"), ("pool", "empty")))] == 0
