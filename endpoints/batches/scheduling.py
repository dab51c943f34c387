"""Where and when batch work runs: the decisions, kept pure (numbers in, numbers out) so that the
autoscaler, the runner, the tests and the benchmark all drive the same functions.

- **Fill warm capacity only.** A batch's lines go to READY replicas while they have spare slots:
  `batch_slots` = READY replicas × target concurrency − what other work holds, never more. Batch
  lines also run at `BATCH_ENGINE_PRIORITY` at the engine (vLLM: lower runs sooner; interactive
  calls use 0), so a burst of interactive calls overtakes them.
- **Hold before scaling down.** While an endpoint has batch work pending and a READY replica, the
  autoscaler keeps up to ceil(pending / target concurrency) of its READY replicas (`apply`, rule
  "hold"): the replica it would scale down drains the queue first, and goes once the queue is empty.
- **Wake only for the deadline.** An endpoint with nothing serving is started for batch work only
  once `now ≥ wake_at` = deadline − 2 × (cold start allowance + estimated work), the estimate being
  pending lines × `INFERPLANE_BATCH_SECONDS_PER_LINE` / target concurrency (rule "wake"); before
  that the work waits for interactive traffic to warm the endpoint (rule "wait").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BATCH_ENGINE_PRIORITY = 100  # vLLM priority of batch lines: after every interactive request (priority 0)
WAKE_SAFETY_FACTOR = 2.0


@dataclass(slots=True, frozen=True)
class BatchDemand:
    """An endpoint's queued batch work: lines not yet done, and the earliest deadline among its batches."""

    num_pending: int
    deadline_at: float  # unix time

    def __post_init__(self) -> None:
        if self.num_pending < 0:
            raise ValueError("num_pending cannot be negative")


@dataclass(slots=True, frozen=True)
class BatchVerdict:
    desired: int
    reason: str
    rule: str  # "" (batch work changed nothing), "hold", "wake" or "wait"


def batch_slots(*, num_ready: int, target_concurrency: int, num_outstanding: int, num_batch_in_flight: int) -> int:
    """How many batch lines may be in flight now: the READY replicas' spare slots, counting the
    batch's own lines as using the slots they hold (`num_outstanding` includes them)."""
    capacity = num_ready * max(target_concurrency, 1)
    others = max(0, num_outstanding - num_batch_in_flight)
    return max(0, capacity - others)


def estimated_work_s(demand: BatchDemand, *, target_concurrency: int, seconds_per_line: float) -> float:
    return demand.num_pending * seconds_per_line / max(target_concurrency, 1)


def wake_at(demand: BatchDemand, *, target_concurrency: int, cold_start_s: float, seconds_per_line: float) -> float:
    """The latest time a sleeping endpoint can be started and still finish the work by the deadline,
    with a safety factor of `WAKE_SAFETY_FACTOR` on the cold start and the work."""
    work_s = estimated_work_s(demand, target_concurrency=target_concurrency, seconds_per_line=seconds_per_line)
    return demand.deadline_at - WAKE_SAFETY_FACTOR * (cold_start_s + work_s)


def apply(desired: int, reason: str, *, demand: BatchDemand | None, num_ready: int, num_serving: int,
          target_concurrency: int, max_replicas: int, cold_start_s: float, seconds_per_line: float,
          now: float) -> BatchVerdict:
    """The autoscaler's `desired` once batch work is taken into account (see the module's rules)."""
    if demand is None or demand.num_pending == 0 or max_replicas == 0:
        return BatchVerdict(desired, reason, "")
    target = max(target_concurrency, 1)
    if num_ready > 0:
        hold = min(num_ready, math.ceil(demand.num_pending / target), max_replicas)
        if desired < hold:
            return BatchVerdict(hold, f"holding {hold} warm replica(s) for batch work: {demand.num_pending} "
                                      f"line(s) pending (interactive load alone: {reason})", "hold")
        return BatchVerdict(desired, reason, "")
    if num_serving > 0 or desired > 0:
        return BatchVerdict(desired, reason, "")  # starting already: the work waits for it
    wake = wake_at(demand, target_concurrency=target, cold_start_s=cold_start_s, seconds_per_line=seconds_per_line)
    if now >= wake:
        return BatchVerdict(1, f"woken for batch work: {demand.num_pending} line(s) pending and the deadline is "
                               f"{max(0, demand.deadline_at - now):.0f} s away", "wake")
    return BatchVerdict(desired, f"{reason}; batch work ({demand.num_pending} line(s)) waits for warm capacity, "
                                 f"waking in {wake - now:.0f} s for its deadline", "wait")
