"""The pool plan's arithmetic (`endpoints.fleet.pool_plan`), checked as properties over many pools."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from endpoints.fleet.pool_plan import (
    IdleNode,
    LaunchPlan,
    Need,
    NodeShape,
    PoolCounts,
    fewest_bins,
    nodes_to_release,
    plan_launches,
)

shapes = st.one_of(
    st.builds(NodeShape, num_gpus=st.just(0), gpu_memory_mb=st.integers(1000, 16000)),
    st.builds(NodeShape, num_gpus=st.integers(1, 8), gpu_memory_mb=st.sampled_from([24000, 48000, 80000])),
)
needs_lists = st.lists(
    st.builds(Need, endpoint_id=st.sampled_from(["a", "b", "c", "d"]), memory_mb=st.integers(100, 200000),
              num_gpus=st.integers(0, 8)),
    max_size=12,
)


@st.composite
def pool_counts(draw):
    max_nodes = draw(st.integers(0, 12))
    min_nodes = draw(st.integers(0, max_nodes))
    num_live = draw(st.integers(0, 12))
    num_booting = draw(st.integers(0, num_live))
    num_empty = draw(st.integers(0, num_live - num_booting))
    return PoolCounts(min_nodes=min_nodes, max_nodes=max_nodes, warm_nodes=draw(st.integers(0, 3)),
                      num_live=num_live, num_booting=num_booting, num_empty=num_empty)


def counts(**given) -> PoolCounts:
    values = dict(min_nodes=0, max_nodes=10, warm_nodes=0, num_live=0, num_booting=0, num_empty=0) | given
    return PoolCounts(**values)


def brute_force_bins(sizes: list[int], capacity: int) -> int:
    """The true minimum, by trying every assignment of sizes to bins."""
    for num_bins in range(0 if not sizes else 1, len(sizes) + 1):
        for assignment in itertools.product(range(num_bins), repeat=len(sizes)):
            loads = [0] * num_bins
            for size, slot in zip(sizes, assignment, strict=True):
                loads[slot] += size
            if max(loads, default=0) <= capacity:
                return num_bins
    raise AssertionError("every size fits a bin of its own")


@settings(max_examples=300, deadline=None)
@given(needs_lists, shapes, pool_counts())
def test_a_plan_never_takes_the_pool_past_its_maximum(needs, shape, pool):
    plan = plan_launches(needs, shape, pool)
    assert plan.num_launch >= 0
    assert plan.num_launch == 0 or pool.num_live + plan.num_launch <= pool.max_nodes


@settings(max_examples=300, deadline=None)
@given(needs_lists, shapes, pool_counts())
def test_every_fitting_need_is_covered_by_booting_and_new_machines_when_the_maximum_allows(needs, shape, pool):
    roomy = PoolCounts(min_nodes=pool.min_nodes, max_nodes=pool.num_live + 20, warm_nodes=pool.warm_nodes,
                       num_live=pool.num_live, num_booting=pool.num_booting, num_empty=pool.num_empty)
    plan = plan_launches(needs, shape, roomy)
    fitting = [need for need in needs if need.fits(shape)]
    assert set(plan.unplaceable) == {need for need in needs if not need.fits(shape)}
    num_held = pool.num_booting + pool.num_empty + plan.num_launch  # an empty joined machine holds demand first
    assert brute_force_bins([need.size(shape) for need in fitting][:7], shape.capacity) <= num_held or len(fitting) > 7
    assert fewest_bins([need.size(shape) for need in fitting], shape.capacity) <= num_held


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 10), max_size=7), st.integers(10, 12))
def test_the_number_of_machines_is_the_true_minimum_for_small_cases(sizes, capacity):
    assert fewest_bins(sizes, capacity) == brute_force_bins(sizes, capacity)


def test_first_fit_decreasing_alone_would_use_one_machine_too_many_here():
    # FFD puts 5+4 then 3+3+3 then 2 (3 bins); 5+3+2 and 4+3+3 fit in 2.
    assert fewest_bins([5, 4, 3, 3, 3, 2], 10) == 2


@settings(max_examples=200, deadline=None)
@given(needs_lists, shapes, pool_counts())
def test_the_plan_launches_nothing_for_demand_while_booting_machines_hold_it(needs, shape, pool):
    fitting = [need for need in needs if need.fits(shape)]
    if fewest_bins([need.size(shape) for need in fitting], shape.capacity) <= pool.num_booting \
            and pool.num_live >= pool.min_nodes and pool.warm_nodes == 0:
        assert plan_launches(needs, shape, pool).num_launch == 0


def test_demand_beside_an_empty_joined_machine_launches_no_other_of_the_same_shape():
    """Before: a need placement kept off the empty machine (its quantization, its agent's version) launched one more
    machine every tick, up to the maximum."""
    shape = NodeShape(num_gpus=1, gpu_memory_mb=80000)
    plan = plan_launches([Need("a", 30000, 1)], shape, counts(num_live=1, num_empty=1))
    assert plan.num_launch == 0 and "no new node would take them" in plan.reason
    assert plan_launches([Need("a", 30000, 1), Need("b", 30000, 1)], shape, counts(num_live=1, num_empty=1)).num_launch == 1


def test_an_empty_machine_a_waiting_need_is_kept_off_is_the_warm_one():
    """The need placement keeps off the pool's empty machine leaves it empty: that machine is the pool's warm one.
    Before: counted as the need's, the plan launched one more warm machine; with two empty, the release took one back
    at its idle timeout (`nodes_to_release` keeps warm ones empty), and the plan launched another: paid for, for ever."""
    shape = NodeShape(num_gpus=1, gpu_memory_mb=80000)
    waiting = [Need("a", 30000, 1)]
    plan = plan_launches(waiting, shape, counts(warm_nodes=1, num_live=1, num_empty=1))
    assert plan.num_launch == 0 and "no new node would take them" in plan.reason
    assert plan_launches([], shape, counts(warm_nodes=1, num_live=1, num_empty=1)).num_launch == 0


def test_two_replicas_that_fit_one_machine_launch_one():
    shape = NodeShape(num_gpus=0, gpu_memory_mb=8192)
    plan = plan_launches([Need("a", 3000, 0), Need("b", 3000, 0)], shape, counts(max_nodes=2))
    assert plan == LaunchPlan(1, "2 replicas of 2 endpoints fit on 1 new node")


def test_a_booting_machine_is_filled_before_another_is_launched():
    shape = NodeShape(num_gpus=1, gpu_memory_mb=80000)
    assert plan_launches([Need("a", 30000, 1)], shape, counts(num_live=1, num_booting=1)).num_launch == 0
    assert plan_launches([Need("a", 30000, 1), Need("b", 30000, 1)], shape, counts(num_live=1, num_booting=1)).num_launch == 1


def test_min_and_warm_nodes_are_launched_without_demand():
    shape = NodeShape(num_gpus=1, gpu_memory_mb=80000)
    assert plan_launches([], shape, counts(min_nodes=2)).num_launch == 2
    assert plan_launches([], shape, counts(min_nodes=1, warm_nodes=1)).num_launch == 2
    # One busy node is the minimum; one more waits empty.
    assert plan_launches([], shape, counts(min_nodes=1, warm_nodes=1, num_live=1)).num_launch == 1
    assert plan_launches([], shape, counts(min_nodes=1, warm_nodes=1, num_live=2, num_empty=1)).num_launch == 0
    # A replica waiting beside the one settled empty node is one placement keeps off it: that node stays the warm one
    # (placed there at the scheduler's next tick after all, the next plan launches a warm one).
    assert plan_launches([Need("a", 1000, 1)], shape, counts(warm_nodes=1, num_live=1, num_empty=1)).num_launch == 0
    assert plan_launches([], shape, counts(warm_nodes=1, num_live=1, num_empty=0)).num_launch == 1


def test_a_need_larger_than_any_machine_is_reported_unplaceable_and_launches_nothing():
    shape = NodeShape(num_gpus=1, gpu_memory_mb=24000)
    too_big = Need("a", 60000, 1)
    plan = plan_launches([too_big, Need("b", 60000, 4)], shape, counts())
    assert plan.num_launch == 0 and plan.unplaceable == (too_big, Need("b", 60000, 4))
    assert "too large" in plan.reason


def test_a_pool_at_its_maximum_says_so():
    plan = plan_launches([Need("a", 1000, 0)], NodeShape(0, 8192), counts(max_nodes=1, num_live=1))
    assert plan.num_launch == 0 and "pool at its maximum" in plan.reason


def test_bad_counts_are_refused():
    with pytest.raises(ValueError):
        counts(num_live=1, num_booting=1, num_empty=1)
    with pytest.raises(ValueError):
        Need("a", -1, 0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(0, 1000), max_size=8), pool_counts(), st.floats(0, 500))
def test_release_keeps_min_and_warm_and_takes_the_longest_idle_first(idle_since, pool, idle_timeout_s):
    idle_since = idle_since[: pool.num_empty]
    idle = [IdleNode(f"n{index}", since) for index, since in enumerate(idle_since)]
    now = 1000.0
    released = nodes_to_release(idle, pool, idle_timeout_s, now)
    assert pool.num_live - len(released) >= min(pool.min_nodes + pool.warm_nodes, pool.num_live)
    assert pool.num_empty - len(released) >= min(pool.warm_nodes, pool.num_empty)
    by_id = {node.launch_id: node for node in idle}
    assert all(now - by_id[launch_id].idle_since >= idle_timeout_s for launch_id in released)
    kept_timed_out = [node for node in idle if node.launch_id not in released and now - node.idle_since >= idle_timeout_s]
    assert all(by_id[launch_id].idle_since <= node.idle_since for launch_id in released for node in kept_timed_out)


def test_a_node_whose_host_is_refused_is_never_the_pools_minimum():
    """Before, a machine placement never uses (its host refused) met `min_nodes`: nothing was launched in its place
    until its idle timeout released it, and while it had not timed out a usable machine that had went in its stead."""
    shape = NodeShape(num_gpus=0, gpu_memory_mb=8192)
    pool = counts(min_nodes=1, num_live=2, num_empty=1, num_unusable=1)
    idle = [IdleNode("usable", 0.0), IdleNode("refused", 90.0, placeable=False)]
    assert nodes_to_release(idle, pool, idle_timeout_s=30, now=100.0) == []  # the usable one is the minimum
    assert nodes_to_release(idle, pool, idle_timeout_s=5, now=100.0) == ["refused"]
    alone = counts(min_nodes=1, num_live=1, num_unusable=1)
    assert plan_launches([], shape, alone).num_launch == 1  # replaced at once
    assert plan_launches([], shape, counts(min_nodes=1, max_nodes=1, num_live=1, num_unusable=1)).num_launch == 0
    with pytest.raises(ValueError):
        counts(num_live=1, num_empty=1, num_unusable=1)


def test_an_idle_node_goes_after_its_timeout_down_to_min_plus_warm():
    idle = [IdleNode("old", 0.0), IdleNode("newer", 50.0), IdleNode("fresh", 95.0)]
    pool = counts(min_nodes=1, warm_nodes=1, num_live=3, num_empty=3)
    assert nodes_to_release(idle, pool, idle_timeout_s=30, now=100.0) == ["old"]  # min 1 + warm 1 stay
    assert nodes_to_release(idle, pool, idle_timeout_s=60, now=100.0) == ["old"]  # "newer" is not idle long enough
    assert nodes_to_release(idle, counts(num_live=3, num_empty=3), idle_timeout_s=30, now=100.0) == ["old", "newer"]


def test_a_need_no_empty_machine_may_hold_is_launched_for_beside_them():
    """A need placement accepts on none of the pool's empty machines (`on_empty` False) takes none of them: before,
    counted against them, the pool launched nothing and the machine that would serve it never came."""
    shape = NodeShape(num_gpus=1, gpu_memory_mb=24000)
    counts = PoolCounts(min_nodes=1, max_nodes=4, warm_nodes=0, num_live=1, num_booting=0, num_empty=1)
    assert plan_launches([Need("a", 8000, 1)], shape, counts).num_launch == 0
    assert plan_launches([Need("a", 8000, 1, on_empty=False)], shape, counts).num_launch == 1
    assert plan_launches([Need("a", 8000, 1, on_empty=False), Need("b", 8000, 1)], shape, counts).num_launch == 1
    booting = PoolCounts(min_nodes=1, max_nodes=4, warm_nodes=0, num_live=2, num_booting=1, num_empty=1)
    assert plan_launches([Need("a", 8000, 1, on_empty=False)], shape, booting).num_launch == 0
