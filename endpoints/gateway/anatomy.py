"""A cold start's anatomy, as the request held for it saw it: where its wait went, phase by phase.

Each side measures what it knows: the gateway when it held the request and when the first token
came; the control plane when it placed the replica (`Replica.created_at`) and when it turned READY
(`Replica.ready_at`); the agent how long the weights took to fetch and the engine to start
(`Replica.download_s`, `Replica.engine_start_s`, from its replica reports). `split` lays these on
one time line and clips it to the request's own wait, so the phases always sum to the total the
request waited (`x-inferplane-cold-start-ms`, `UsageRecord.cold_start_ms`):

- queue: held, until a replica was placed for it (0 when one was already starting);
- placement: placed, until the agent began fetching weights (the agent's pickup);
- download: fetching weights (0 from the node's cache);
- engine: launching the engine until its first healthy check;
- wake: a sleeping replica (vLLM sleep mode) asked to wake, until READY again; a wake is not a start,
  so placement, download and engine are then 0 (`Replica.woken_at`);
- first_token: READY, until the first token reached the gateway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from controlplane.worker_threads import in_worker_thread
from endpoints.models import Replica
from gpu_agent.protocol import MAX_MEASURED_S, ReplicaState

PHASES = ("queue", "placement", "download", "engine", "wake", "first_token")
HEADER = b"x-inferplane-cold-start-ms"
# A non-streaming client's opt-in to progress while held: the answer (200, JSON) starts at once and
# the gateway writes a space at each step of the cold start; JSON allows leading whitespace, so the
# body parses as ever. The status is then committed: a failure comes as an error object in the body.
PROGRESS_HEADER = "x-inferplane-progress"


@dataclass(slots=True, frozen=True)
class ReplicaTimeline:
    """What the control plane recorded of the replica that ended a hold."""

    placed_at: datetime
    ready_at: datetime
    download_s: float | None
    engine_start_s: float | None
    woken_at: datetime | None = None  # set when its READY was a wake from sleep, not a start


@dataclass(slots=True, frozen=True)
class ColdStart:
    """One held request's cold start: its total and its phases, in whole milliseconds."""

    total_ms: int
    phases: dict[str, int]

    def header(self) -> tuple[bytes, bytes]:
        return HEADER, str(self.total_ms).encode()


def wants_progress(headers: dict[str, str]) -> bool:
    return headers.get(PROGRESS_HEADER, "").strip().lower() in ("true", "1", "yes")


def split(held_at: datetime, first_token_at: datetime, replica: ReplicaTimeline | None) -> ColdStart:
    """The request's wait from `held_at` to `first_token_at`, split into `PHASES` (summing to the total)."""
    end = max(first_token_at, held_at)
    if replica is None:  # the replica is unknown (gone already): the wait is all queueing
        boundaries = [end, end, end, end, end]
    elif replica.woken_at is not None:
        woken = replica.woken_at
        ready = max(replica.ready_at, woken)
        boundaries = [woken, woken, woken, woken, ready]
    else:
        engine = timedelta(seconds=_measured_s(replica.engine_start_s))
        download = timedelta(seconds=_measured_s(replica.download_s))
        placed = replica.placed_at
        ready = max(replica.ready_at, placed)
        fetch_from = max(placed, ready - engine - download)
        engine_from = max(fetch_from, ready - engine)
        boundaries = [placed, fetch_from, engine_from, ready, ready]
    points = [held_at, *boundaries, end]
    phases = {}
    for name, start, stop in zip(PHASES, points[:-1], points[1:], strict=True):
        start, stop = min(max(start, held_at), end), min(max(stop, held_at), end)
        phases[name] = max(round((stop - start).total_seconds() * 1000), 0)
    total = round((end - held_at).total_seconds() * 1000)
    # NOTE: rounding may leave a millisecond over or under: the last phase absorbs it.
    phases["first_token"] = max(phases["first_token"] + total - sum(phases.values()), 0)
    return ColdStart(total_ms=total, phases=phases)


def _measured_s(value: float | None) -> float:
    """An agent's measure as kept, 0 when unknown. NOTE: rows stored before the protocol bounded these may hold NaN,
    infinity or 1e308, which `timedelta` refuses (it raised past the held call's usage row): a non-finite one counts
    as unknown, the rest within 0..`MAX_MEASURED_S`, as the protocol clamps them now."""
    if value is None or not math.isfinite(value):
        return 0.0
    return min(max(value, 0.0), MAX_MEASURED_S)


def _load_timeline(endpoint_id: str, replica_id: str | None) -> ReplicaTimeline | None:
    replicas = Replica.objects.filter(endpoint_id=endpoint_id, ready_at__isnull=False)
    if replica_id:
        replicas = replicas.filter(pk=replica_id)
    row = (replicas.exclude(state=ReplicaState.PENDING).order_by("-ready_at")
           .values("created_at", "ready_at", "download_s", "engine_start_s", "woken_at").first())
    if row is None:
        return None
    woken_at = row["woken_at"] if row["woken_at"] is not None and row["woken_at"] <= row["ready_at"] else None
    return ReplicaTimeline(placed_at=row["created_at"], ready_at=row["ready_at"], download_s=row["download_s"],
                           engine_start_s=row["engine_start_s"], woken_at=woken_at)


async def replica_timeline(endpoint_id: str, replica_id: str | None = None) -> ReplicaTimeline | None:
    """The replica that served a held request (or the endpoint's latest to turn READY)."""
    return await in_worker_thread(_load_timeline)(endpoint_id, replica_id)
