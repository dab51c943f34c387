"""How many machines a node pool launches, and which idle ones it releases: pure arithmetic.

No Django and no clock of its own, so that the pool policy (`endpoints.fleet.pools`) and the
benchmark (`bench/bench_node_pools.py`) run the very same rules, and property tests can check them.

A machine is one bin: a GPU machine holds `num_gpus` whole GPUs and a replica takes the GPUs it
needs (a replica that may share a GPU is counted as taking a whole one: the pool may launch a little
more than a perfect packing would, never less); a CPU machine is one pool of memory. Needs are
packed into the machines already booting first, then into as few new machines as possible: first
fit decreasing, improved by an exact search when there are few needs, so small cases are optimal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Up to this many needs the plan searches for the true minimum; beyond, first fit decreasing (at
# most 11/9 of the optimum + 1) is close enough and fast.
EXACT_SEARCH_MAX_NEEDS = 10


@dataclass(slots=True, frozen=True)
class NodeShape:
    """One machine of a pool."""

    num_gpus: int  # 0: a CPU machine (one memory pool)
    gpu_memory_mb: int  # per GPU; a CPU machine's engine memory

    def __post_init__(self):
        if self.num_gpus < 0 or self.gpu_memory_mb < 0:
            raise ValueError("a machine's GPUs and memory are never negative")

    @property
    def capacity(self) -> int:
        """What one machine holds, in the unit of `Need.size`: GPUs, or a CPU machine's memory."""
        return self.num_gpus if self.num_gpus else self.gpu_memory_mb


@dataclass(slots=True, frozen=True)
class Need:
    """One replica that placement could not put anywhere."""

    endpoint_id: str
    memory_mb: int  # what placement would reserve (placement.memory_needed_mb)
    num_gpus: int  # whole GPUs it needs (0 or 1 on CPU machines: from the pooled memory)
    # Whether the pool's empty joined machines may hold it: False when placement accepts it on none of them (their
    # agent or template older than a new machine's), so only a new or booting machine does (`pool_demand.serving_pool`).
    on_empty: bool = True

    def __post_init__(self):
        if self.memory_mb < 0 or self.num_gpus < 0:
            raise ValueError("a need's memory and GPUs are never negative")

    def size(self, shape: NodeShape) -> int:
        return max(self.num_gpus, 1) if shape.num_gpus else self.memory_mb

    def fits(self, shape: NodeShape) -> bool:
        """Whether one empty machine of `shape` can ever hold it."""
        if not shape.num_gpus:
            return self.num_gpus <= 1 and self.memory_mb <= shape.gpu_memory_mb
        num_gpus = max(self.num_gpus, 1)
        return num_gpus <= shape.num_gpus and math.ceil(self.memory_mb / num_gpus) <= shape.gpu_memory_mb


@dataclass(slots=True, frozen=True)
class PoolCounts:
    min_nodes: int
    max_nodes: int
    warm_nodes: int
    num_live: int  # REQUESTED + LAUNCHING + JOINED (not RELEASING / finished)
    num_booting: int  # REQUESTED + LAUNCHING (capacity on its way: fill it before launching more)
    num_empty: int  # JOINED with no active replica, not cordoned
    # JOINED whose registered host the gateway refuses: placement never gives them a replica, so they are neither the
    # pool's minimum nor its warm machines (not in `num_empty`), only machines paid for (within `max_nodes`).
    num_unusable: int = 0

    def __post_init__(self):
        if min(self.min_nodes, self.max_nodes, self.warm_nodes, self.num_live, self.num_booting, self.num_empty,
               self.num_unusable) < 0:
            raise ValueError("pool counts are never negative")
        if self.num_booting + self.num_empty + self.num_unusable > self.num_live:
            raise ValueError("booting, empty and unusable nodes are live nodes")

    @property
    def num_usable(self) -> int:
        """The live machines placement may use (booting ones included): what `min_nodes` and `warm_nodes` count."""
        return self.num_live - self.num_unusable


@dataclass(slots=True, frozen=True)
class LaunchPlan:
    num_launch: int
    reason: str  # for the event log: "2 replicas of 2 endpoints fit on 1 new node", "pool at its maximum", …
    unplaceable: tuple[Need, ...] = ()  # needs no machine of this shape can ever hold


def plan_launches(needs: Sequence[Need], shape: NodeShape, counts: PoolCounts) -> LaunchPlan:
    """The fewest new machines that hold every need (after the booting ones and the empty joined ones), plus what min
    and warm ask for; never past `max_nodes`.

    NOTE: an empty joined machine (`num_empty`, settled: the scheduler had its ticks to place on it) holds demand
    before a new one is launched. A need still waiting beside it is one placement keeps off this pool's machines for
    another reason than room (a quantization, an agent version, a registration smaller than the pool's shape): a
    machine of the same shape takes it no more. Counted as needing a new machine, it launched one every tick up to
    `max_nodes`, each joining empty and idle until its timeout, paid for. A need placement accepts on none of the empty
    machines, where a new machine would differ (`Need.on_empty` False: they predate the pool's definition), takes
    none of them: counted against them, the pool never launched the machine that would serve it (a 503 for ever)."""
    unplaceable = tuple(need for need in needs if not need.fits(shape))
    fitting = [need for need in needs if need.fits(shape)]
    sizes = [need.size(shape) for need in fitting]
    num_bins = fewest_bins(sizes, shape.capacity)
    # NOTE: packed apart (a little more than a joint packing, never less): the empty machines hold only those that
    # may go on them, the booting and new ones any.
    num_on_empty = fewest_bins([need.size(shape) for need in fitting if need.on_empty], shape.capacity)
    num_off_empty = fewest_bins([need.size(shape) for need in fitting if not need.on_empty], shape.capacity)
    num_for_needs = max(0, max(0, num_on_empty - counts.num_empty) + num_off_empty - counts.num_booting)
    num_booting_unused = max(0, counts.num_booting - num_bins)
    # NOTE: booting machines nobody needs will join empty: they count as warm already; so do the empty ones, settled:
    # a need beside one is one placement keeps off it, which leaves it empty. Counted as that need's, the plan
    # launched one more warm machine, the release took one back at its idle timeout, and so on for ever. An empty one
    # placement does fill at its next tick is warm no more: the next plan launches its replacement.
    num_for_warm = max(0, counts.warm_nodes - counts.num_empty - num_booting_unused)
    # NOTE: min nodes run, warm nodes more wait empty: the same floor `nodes_to_release` keeps, so
    # the two never undo each other. A machine placement never uses is not one of them: replaced at once.
    num_for_min = max(0, counts.min_nodes + counts.warm_nodes - counts.num_usable)
    wanted = max(num_for_needs + num_for_warm, num_for_min)
    headroom = max(0, counts.max_nodes - counts.num_live)
    num_launch = min(wanted, headroom)
    reasons = []
    if num_for_needs:
        num_endpoints = len({need.endpoint_id for need in fitting})
        reasons.append(f"{_plural(len(fitting), 'replica')} of {_plural(num_endpoints, 'endpoint')} "
                       f"fit on {_plural(num_for_needs, 'new node')}")
    elif fitting and num_bins <= counts.num_booting:
        reasons.append(f"{_plural(len(fitting), 'replica')} wait for {_plural(counts.num_booting, 'booting node')}")
    elif fitting:
        reasons.append(f"{_plural(len(fitting), 'replica')} not placed on this pool's empty nodes: no new node would "
                       "take them either")
    if num_for_warm:
        reasons.append(f"{_plural(num_for_warm, 'warm node')} to keep")
    if num_for_min > num_for_needs + num_for_warm:
        reasons.append(f"{counts.min_nodes + counts.warm_nodes} nodes at least (min plus warm)")
    if wanted > headroom:
        reasons.append(f"pool at its maximum ({counts.max_nodes} nodes, {wanted - num_launch} more wanted)")
    if unplaceable:
        reasons.append(f"{_plural(len(unplaceable), 'replica')} too large for this pool's machines")
    return LaunchPlan(num_launch, "; ".join(reasons) or "nothing to launch", unplaceable)


def fewest_bins(sizes: Sequence[int], capacity: int) -> int:
    """How many empty bins of `capacity` hold `sizes` (each at most `capacity`): first fit
    decreasing, then for few sizes an exact search below it."""
    if not sizes:
        return 0
    order = sorted(sizes, reverse=True)
    bins: list[int] = []  # used capacity per bin
    for size in order:
        for index, used in enumerate(bins):
            if used + size <= capacity:
                bins[index] = used + size
                break
        else:
            bins.append(size)
    if len(order) > EXACT_SEARCH_MAX_NEEDS or not capacity:
        return len(bins)
    for num_bins in range(max(1, math.ceil(sum(order) / capacity)), len(bins)):
        if _packs(order, capacity, num_bins):
            return num_bins
    return len(bins)


def _packs(order: list[int], capacity: int, num_bins: int) -> bool:
    """Whether the (decreasing) sizes fit in `num_bins` bins: depth-first, bins of equal load tried once."""
    loads = [0] * num_bins

    def place(index: int) -> bool:
        if index == len(order):
            return True
        tried = set()
        for slot in range(num_bins):
            if loads[slot] in tried or loads[slot] + order[index] > capacity:
                continue
            tried.add(loads[slot])
            loads[slot] += order[index]
            if place(index + 1):
                return True
            loads[slot] -= order[index]
        return False

    return place(0)


@dataclass(slots=True, frozen=True)
class IdleNode:
    launch_id: str
    idle_since: float  # epoch seconds
    placeable: bool = True  # False: placement never gives it a replica (its host refused), not in `num_empty`


def nodes_to_release(idle: Sequence[IdleNode], counts: PoolCounts, idle_timeout_s: float, now: float) -> list[str]:
    """Launch ids of nodes empty for `idle_timeout_s`, longest idle first, keeping `min_nodes`
    plus `warm_nodes` live, and `warm_nodes` empty (the most recently idle stay warm).

    A node placement never uses (one of `counts.num_unusable`) is released once timed out whatever min and warm say:
    it is neither, and the plan launches a usable one in its place. NOTE: it never keeps the minimum either: counted
    live, a usable node timed out went while it was not, and the minimum was a machine placement never uses."""
    if idle_timeout_s < 0:
        raise ValueError("an idle timeout is never negative")
    timed_out = sorted((node for node in idle if now - node.idle_since >= idle_timeout_s),
                       key=lambda node: (node.idle_since, node.launch_id))
    unusable = [node.launch_id for node in timed_out if not node.placeable]
    num_releasable = max(0, min(counts.num_usable - counts.min_nodes - counts.warm_nodes,
                                counts.num_empty - counts.warm_nodes))
    return unusable + [node.launch_id for node in timed_out if node.placeable][:num_releasable]


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
