"""Where and when batch work runs: the decisions, kept pure (numbers in, numbers out) so that the
autoscaler, the runner, the tests and the benchmark all drive the same functions.

- **Fill warm capacity only.** A batch's lines go to READY replicas while they have spare slots:
  `batch_slots` = READY replicas × target concurrency − what other work holds, never more. Batch
  lines also run at `BATCH_ENGINE_PRIORITY` at the engine (vLLM: lower runs sooner; interactive
  calls use 0), so a burst of interactive calls overtakes them.
- **Hold before scaling down.** While an endpoint has batch work pending and a READY replica, the
  autoscaler keeps up to ceil(lines the batches can keep in flight / target concurrency) of its READY
  replicas (`apply`, rule "hold"): the replica it would scale down drains the queue first, and goes
  once the queue is empty. The lines in flight are the pending ones, at most what the batches' keys
  may send (`BatchDemand.max_lines_per_s` × `INFERPLANE_BATCH_SECONDS_PER_LINE`), and at most what its
  runs kept in flight over the last minute (`LineUse`, refused lines not counted), one replica at least.
- **Wake only for the deadline.** An endpoint with nothing serving is started for batch work only
  once `now ≥ wake_at` = deadline − 2 × (cold start allowance + estimated work), the estimate being
  pending lines × `INFERPLANE_BATCH_SECONDS_PER_LINE` / target concurrency, or pending lines / the
  keys' lines per second where that is slower (rule "wake"); before that the work waits for
  interactive traffic to warm the endpoint (rule "wait").
- **Only for work that can use the GPU.** Batch work whose keys cannot keep `MIN_REPLICA_USE` of a
  replica busy (`rate_bound`: lines a second × `INFERPLANE_BATCH_SECONDS_PER_LINE` < `MIN_REPLICA_USE` ×
  min(pending, target concurrency); with target 8 and 2 s a line, any key under 60 requests a minute) holds
  no replica for its own sake: it runs on capacity interactive traffic keeps warm (rule "wait"), until
  `now ≥ deadline_wake_at` = deadline − cold start allowance − pending / the keys' lines per second; then it
  wakes its endpoint and holds one READY replica (rules "wake", "hold"), if its keys may keep
  `MIN_WAKE_LINES_IN_FLIGHT` line in flight (`wake_time`; else never: a key of 1 request a minute). A batch whose every try has been refused
  (429, 5xx) for `STALL_S` is left out of the demand (`stalled`) until a line of it finishes, or
  `STALL_FORGOTTEN_S` after its last refusal. NOTE: before, such work kept every READY replica (up to
  `max_replicas`) for the batch's 24 h while ~1,440 one-token lines a day were billed.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

BATCH_ENGINE_PRIORITY = 100  # vLLM priority of batch lines: after every interactive request (priority 0)
WAKE_SAFETY_FACTOR = 2.0
# Batch work holds or wakes a replica only if its keys may keep at least this share of the replica's target concurrency
# (or of its pending lines, if fewer) busy.
MIN_REPLICA_USE = 0.25
# Rate-bound work wakes (and holds) a replica for its deadline only if its keys may keep this many lines in flight.
MIN_WAKE_LINES_IN_FLIGHT = 1.0
STALL_S = 300.0  # a batch whose tries have all been refused for this long is stalled: it holds and wakes nothing
STALL_FORGOTTEN_S = 3600.0  # a stalled batch not tried since its last refusal this long ago may wake again
USE_WINDOW_S = 60.0  # a run measures the lines it keeps in flight over this long (`LineUse`), and it counts this long


@dataclass(slots=True, frozen=True)
class BatchDemand:
    """An endpoint's queued batch work: lines not yet done, the earliest deadline among its batches, and the lines
    per second their keys may send together (None: no limit)."""

    num_pending: int
    deadline_at: float  # unix time
    max_lines_per_s: float | None = None
    # the lines its runs kept in flight of late, on average, none refused (`LineUse`); None: not measured lately
    line_concurrency: float | None = None
    # PostgreSQL's clock (unix time) when it was read (`demand.read_demand`): the clock `deadline_at` is on, so the one
    # it is judged by (`apply`); None: the caller's `now`
    read_at: float | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.num_pending < 0:
            raise ValueError("num_pending cannot be negative")
        if self.max_lines_per_s is not None and self.max_lines_per_s <= 0:
            raise ValueError("max_lines_per_s must be positive (None: no limit)")
        if self.line_concurrency is not None and self.line_concurrency < 0:
            raise ValueError("line_concurrency cannot be negative")


@dataclass(slots=True)
class LineUse:
    """The lines a run keeps in flight on average over the last `USE_WINDOW_S` (monotonic times): each line from its
    start to its end, but a line that was refused (tried again later) not at all. Little's law: the slots its work
    uses, whatever a line takes, where `INFERPLANE_BATCH_SECONDS_PER_LINE` is a guess."""

    began_at: float
    spans: deque = field(default_factory=deque)  # (started_at, ended_at) of lines ended, oldest first

    def ended(self, started_at: float, ended_at: float) -> None:
        self.spans.append((started_at, ended_at))

    def concurrency(self, now: float, running_since: list[float]) -> float:
        """The average over the window (from `began_at` if later) with lines `running_since` still in flight."""
        window_start = now - USE_WINDOW_S
        while self.spans and self.spans[0][1] <= window_start:
            self.spans.popleft()
        busy_s = sum(end - max(start, window_start) for start, end in self.spans if end > window_start)
        busy_s += sum(now - max(start, window_start) for start in running_since)
        return busy_s / max(now - max(window_start, self.began_at), 1.0)


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


def stalled(*, refused_since: float | None, last_refused_at: float | None, now: float) -> bool:
    """Whether a batch's tries have all been refused (429, 5xx: left pending) for `STALL_S`, the last of them less than
    `STALL_FORGOTTEN_S` ago (unix times; `refused_since` is None once a line finished after the refusals)."""
    if refused_since is None or last_refused_at is None:
        return False
    return last_refused_at - refused_since >= STALL_S and now - last_refused_at < STALL_FORGOTTEN_S


def lines_in_flight(demand: BatchDemand, *, seconds_per_line: float) -> float:
    """The most lines the batch work can keep in flight: its pending lines, at most what its keys may send."""
    if demand.max_lines_per_s is None:
        return float(demand.num_pending)
    return min(float(demand.num_pending), demand.max_lines_per_s * seconds_per_line)


def rate_bound(demand: BatchDemand, *, target_concurrency: int, seconds_per_line: float) -> bool:
    """Whether the batch work's keys cannot keep `MIN_REPLICA_USE` of a replica busy: it then holds and wakes none."""
    wanted = min(demand.num_pending, max(target_concurrency, 1))
    return lines_in_flight(demand, seconds_per_line=seconds_per_line) < MIN_REPLICA_USE * wanted


def estimated_work_s(demand: BatchDemand, *, target_concurrency: int, seconds_per_line: float) -> float:
    work_s = demand.num_pending * seconds_per_line / max(target_concurrency, 1)
    if demand.max_lines_per_s is None:
        return work_s
    return max(work_s, demand.num_pending / demand.max_lines_per_s)  # the keys' limits may be the slower


def wake_at(demand: BatchDemand, *, target_concurrency: int, cold_start_s: float, seconds_per_line: float) -> float:
    """The latest time a sleeping endpoint can be started and still finish the work by the deadline,
    with a safety factor of `WAKE_SAFETY_FACTOR` on the cold start and the work."""
    work_s = estimated_work_s(demand, target_concurrency=target_concurrency, seconds_per_line=seconds_per_line)
    return demand.deadline_at - WAKE_SAFETY_FACTOR * (cold_start_s + work_s)


def deadline_wake_at(demand: BatchDemand, *, target_concurrency: int, cold_start_s: float,
                     seconds_per_line: float) -> float:
    """When rate-bound work (`rate_bound`) wakes its sleeping endpoint, and from when it holds one READY replica: the
    deadline less the cold start and the estimated work, no safety factor (a replica woken earlier would idle)."""
    work_s = estimated_work_s(demand, target_concurrency=target_concurrency, seconds_per_line=seconds_per_line)
    return demand.deadline_at - cold_start_s - work_s


def wake_time(demand: BatchDemand, *, target_concurrency: int, cold_start_s: float,
              seconds_per_line: float) -> float | None:
    """When the batch work wakes its sleeping endpoint (`wake_at`, or `deadline_wake_at` for rate-bound work), or None:
    never (rate-bound work whose keys may not keep `MIN_WAKE_LINES_IN_FLIGHT` lines in flight)."""
    if not rate_bound(demand, target_concurrency=target_concurrency, seconds_per_line=seconds_per_line):
        return wake_at(demand, target_concurrency=target_concurrency, cold_start_s=cold_start_s,
                       seconds_per_line=seconds_per_line)
    if lines_in_flight(demand, seconds_per_line=seconds_per_line) < MIN_WAKE_LINES_IN_FLIGHT:
        return None
    return deadline_wake_at(demand, target_concurrency=target_concurrency, cold_start_s=cold_start_s,
                            seconds_per_line=seconds_per_line)


def apply(desired: int, reason: str, *, demand: BatchDemand | None, num_ready: int, num_serving: int,
          target_concurrency: int, max_replicas: int, cold_start_s: float, seconds_per_line: float,
          now: float) -> BatchVerdict:
    """The autoscaler's `desired` once batch work is taken into account (see the module's rules). `now`: the caller's
    clock, where the demand does not say when it was read by the deadline's (`BatchDemand.read_at`).

    NOTE: the deadline is judged by the clock it was stamped by (PostgreSQL's), never the caller's (the autoscaler's is
    Redis's): with Redis an hour behind, a scaled-to-zero endpoint was woken an hour late, its batch expired unserved."""
    if demand is None or demand.num_pending == 0 or max_replicas == 0:
        return BatchVerdict(desired, reason, "")
    now = now if demand.read_at is None else demand.read_at
    target = max(target_concurrency, 1)
    if rate_bound(demand, target_concurrency=target, seconds_per_line=seconds_per_line):
        due = wake_time(demand, target_concurrency=target, cold_start_s=cold_start_s, seconds_per_line=seconds_per_line)
        if due is not None and now >= due:
            # NOTE: else such work expired unrun on a scale-to-zero endpoint: the runner never starts lines through a
            # cold start, and nothing else woke it (rvrv5: 1,000 lines of a 59 rpm key, target 8, never woken)
            if num_ready > 0:
                if desired >= 1:
                    return BatchVerdict(desired, reason, "")
                return BatchVerdict(1, f"holding 1 warm replica for batch work due soon: {demand.num_pending} "
                                       f"line(s) pending (interactive load alone: {reason})", "hold")
            if num_serving > 0 or desired > 0:
                return BatchVerdict(desired, reason, "")
            return BatchVerdict(1, f"woken for batch work: {demand.num_pending} line(s) pending at "
                                   f"{demand.max_lines_per_s * 60:.0f} line(s) a minute and the deadline is "
                                   f"{max(0, demand.deadline_at - now):.0f} s away", "wake")
        if num_ready > 0 or num_serving > 0 or desired > 0:
            return BatchVerdict(desired, reason, "")
        return BatchVerdict(desired, f"{reason}; batch work ({demand.num_pending} line(s)) waits for warm capacity: its "
                                     f"keys may send {demand.max_lines_per_s * 60:.0f} line(s) a minute, too few to "
                                     "keep a replica busy", "wait")
    if num_ready > 0:
        in_flight = lines_in_flight(demand, seconds_per_line=seconds_per_line)
        if demand.line_concurrency is not None:
            # NOTE: at least one: a replica kept while the work may use it, measured or not (else no run could measure)
            in_flight = max(1.0, min(in_flight, demand.line_concurrency))
        hold = min(num_ready, math.ceil(in_flight / target), max_replicas)
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
