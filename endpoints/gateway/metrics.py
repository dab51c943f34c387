"""Prometheus metrics of the gateway, served at `/metrics` by every web process.

`/metrics` lists every tenant's endpoints and traffic, so only a scraper holding the bearer token
`INFERPLANE_METRICS_TOKEN` reads it (`access`); the ingress never routes it either (README, "Security").
Series are labelled by endpoint id and organisation id, never by name: two organisations may both
have an endpoint called `chat`. Names live in one info series per endpoint
(`inferplane_endpoint_info{endpoint_id, organization_id, name} 1`) and per node, which dashboards join.

A web pod runs several gateway processes (`controlplane/serve.py`); with `PROMETHEUS_MULTIPROC_DIR`
set, each process writes its request metrics to its own files there (prometheus_client's
multiprocess mode) and a scrape, answered by any one process, reports them merged: counters and
histograms summed over every process that ever ran in the pod, in-flight gauges summed over the
live ones. The fleet series are read from the database at each scrape by the process answering it,
never stored per process; the clock skews and the held rollups' counts (`billing.held_rollups`), from Redis, where
the processes that measure them keep them.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import enum
import ipaddress
import math
import os
from dataclasses import dataclass, field

import redis.exceptions
from django.conf import settings
from django.db.models import Count
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from billing import held_rollups, usage_journal
from controlplane import clock
from controlplane.metrics_processes import forget_dead_processes, multiprocess_registry, token_granted
from endpoints.fleet.pool_costs import usage_by_pool
from endpoints.models import LIVE_REPLICA_STATES, Endpoint, Replica
from endpoints.nodes.models import LIVE_LAUNCH_STATES, Node, NodeLaunch, NodePool
from gpu_agent.protocol import NodeState

REGISTRY = CollectorRegistry(auto_describe=True)
# NOTE: prometheus_client's own variable, read by it when it is first imported: set for the whole
# process before it starts (`controlplane/serve.py` does), never changed while it runs.
MULTIPROCESS_DIR = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# NOTE: an endpoint's series carry its id and its organisation's id; its name only in `endpoint_info`.
ENDPOINT = ["endpoint_id", "organization_id"]

requests_total = Counter("inferplane_requests_total", "Inference requests by endpoint and outcome.",
                         [*ENDPOINT, "status"], registry=REGISTRY)
request_duration = Histogram("inferplane_request_duration_seconds", "Whole request latency.", ENDPOINT,
                             buckets=LATENCY_BUCKETS, registry=REGISTRY)
time_to_first_token = Histogram("inferplane_time_to_first_token_seconds", "Time to the first streamed token.",
                                ENDPOINT, buckets=LATENCY_BUCKETS, registry=REGISTRY)
tokens_total = Counter("inferplane_tokens_total", "Tokens by endpoint and kind (prompt, cached, completion).",
                       [*ENDPOINT, "kind"], registry=REGISTRY)
# A request whose reported usage cost more than its reservation: billed the reservation, the rest is the platform's
# loss (a model's own chat template rendering more than the estimate allows, an engine over-reporting).
usage_past_reservation = Counter("inferplane_usage_past_reservation_total",
                                 "Requests whose reported usage cost more than was reserved (billed the reservation).",
                                 ENDPOINT, registry=REGISTRY)
# A replica that refused to render a cut Responses stream's prompt (HTTP 403: its engine was started without
# `--enable-scale-out`; 404: a vLLM without the route), by status: the log names the replica to restart
# (`endpoints.gateway.rendered_prompt`). Labelled by status alone: few series, whatever the fleet.
prompt_render_refusals = Counter("inferplane_prompt_render_refusals_total",
                                 "Renders of a cut Responses stream's prompt a replica refused (its engine needs a "
                                 "restart with --enable-scale-out), by HTTP status.", ["status"], registry=REGISTRY)
# Journal lines a replay set aside unbilled, defined beside the journal (billing owns it; registered here to be scraped).
REGISTRY.register(usage_journal.lines_set_aside)
# NOTE: `livesum`: a pod's in-flight requests are those of its live processes; a dead one's go with it.
inflight = Gauge("inferplane_inflight_requests", "Requests being served by this pod's gateway processes.", ENDPOINT,
                 registry=REGISTRY, multiprocess_mode="livesum")
waiting = Gauge("inferplane_waiting_requests", "Requests held for a cold start in this pod's gateway processes.",
                ENDPOINT, registry=REGISTRY, multiprocess_mode="livesum")
cold_start = Histogram("inferplane_cold_start_seconds", "Seconds a request waited for a replica.", ENDPOINT,
                       buckets=(0.5, 1, 2, 5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600), registry=REGISTRY)
# NOTE: labelled by phase only (`endpoints.gateway.anatomy.PHASES`): few series, whatever the fleet.
cold_start_phase = Histogram("inferplane_cold_start_phase_seconds",
                             "Seconds of a held request's cold start, by phase (queue, placement, download, engine, "
                             "wake, first_token).", ["phase"],
                             buckets=(0.05, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600), registry=REGISTRY)


def observe_cold_start_phases(phases: dict[str, int]) -> None:
    for phase, ms in phases.items():
        cold_start_phase.labels(phase).observe(ms / 1000)


# NOTE: a request's metrics are plain numbers in this process (`EndpointMetrics`), folded into the
# prometheus_client values above every `FOLD_EVERY_S` and before this process answers a scrape
# (`fold`). A request's seven locked updates (in multiprocess mode each a write into a memory-mapped file)
# took 8.9 us of CPU in one process and 17.8 us in multiprocess mode, against ~1 us as integers
# (bench/results/gateway_profile.md, round 7); a fold costs the same few updates a second, whatever the traffic. A scrape answered by
# another process of the pod sees this one's counts as of its last fold, at most `FOLD_EVERY_S` old.
FOLD_EVERY_S = 1.0


class Tally:
    """A histogram's observations since the last fold: a count per bucket of `bounds`, and their sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = (*bounds, math.inf)
        self.counts = [0] * len(self.bounds)
        self.total = 0.0

    def observe(self, value: float) -> None:
        # NOTE: the first bucket whose upper bound is >= value, as prometheus_client's `observe`
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def fold_into(self, child: Histogram) -> None:
        """Add the observations to `child` (prometheus_client's histogram of the same buckets), then forget them.

        NOTE: through the child's own values (`_buckets`, one per bucket, not cumulative, and `_sum`), as its
        `observe` updates them, many observations at once; `tests/gateway/test_metrics_fold.py` checks
        that the exposition is the one `observe` gives, so a prometheus_client that stores them otherwise fails there.
        """
        if not any(self.counts):
            return False
        for index, count in enumerate(self.counts):
            if count:
                child._buckets[index].inc(count)
                self.counts[index] = 0
        child._sum.inc(self.total)
        self.total = 0.0
        return True


class Level:
    """A gauge's value in this process (in flight, waiting), set on the gauge at each fold."""

    __slots__ = ("value", "_folded")

    def __init__(self):
        self.value = 0
        self._folded = 0

    def inc(self) -> None:
        self.value += 1

    def dec(self) -> None:
        self.value -= 1

    def fold_into(self, child: Gauge) -> None:
        if self.value != self._folded:
            child.set(self.value)
            self._folded = self.value


@dataclass(slots=True)
class EndpointMetrics:
    """One endpoint's request metrics in this process, counted as plain numbers; `fold` adds them to
    prometheus_client's children (looked up once: `labels()` takes a lock each call)."""

    labels: tuple[str, str]  # endpoint id, organisation id
    # prometheus_client's children the counts below are folded into
    inflight_child: Gauge
    duration_child: Histogram
    ttft_child: Histogram
    token_children: tuple[Counter, Counter, Counter]  # prompt, cached, completion
    waiting: Gauge  # NOTE: a held call's (rare, seconds long): straight to prometheus_client
    cold_start: Histogram
    inflight: Level = field(default_factory=Level)
    time_to_first_token: Tally = field(default_factory=lambda: Tally(LATENCY_BUCKETS))
    request_duration: Tally = field(default_factory=lambda: Tally(LATENCY_BUCKETS))
    tokens: list[int] = field(default_factory=lambda: [0, 0, 0])  # prompt, cached, completion, since the last fold
    outcomes: dict[str, int] = field(default_factory=dict)  # requests by outcome, since the last fold
    outcome_children: dict = field(default_factory=dict)  # `requests_total`'s child of each outcome seen
    idle_folds: int = 0  # folds in a row that found nothing counted, in flight or waiting (`fold`)

    def observe_request(self, outcome: str, duration_s: float, prompt: int, cached: int, completion: int) -> None:
        outcomes = self.outcomes
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        self.request_duration.observe(duration_s)
        tokens = self.tokens
        tokens[0] += prompt
        tokens[1] += cached
        tokens[2] += completion

    def fold(self) -> bool:
        """Whether the endpoint was in use: something counted since the last fold, in flight or waiting."""
        self.inflight.fold_into(self.inflight_child)
        used = self.request_duration.fold_into(self.duration_child)
        used = self.time_to_first_token.fold_into(self.ttft_child) or used
        for outcome, count in self.outcomes.items():
            if count:
                child = self.outcome_children.get(outcome)
                if child is None:
                    child = self.outcome_children[outcome] = requests_total.labels(*self.labels, outcome)
                child.inc(count)
                self.outcomes[outcome] = 0
                used = True
        for index, child in enumerate(self.token_children):
            if self.tokens[index]:
                child.inc(self.tokens[index])
                self.tokens[index] = 0
                used = True
        return used or self.inflight.value != 0 or self.waiting._value.get() != 0

    def remove(self) -> None:
        """Its series taken out of this process's registry (in multiprocess mode their values stay in the process's
        files, and a child made again later reads them back)."""
        for metric, labels in ((request_duration, self.labels), (time_to_first_token, self.labels),
                               (inflight, self.labels), (waiting, self.labels), (cold_start, self.labels),
                               (usage_past_reservation, self.labels),
                               *((requests_total, (*self.labels, outcome)) for outcome in self.outcome_children),
                               *((tokens_total, (*self.labels, kind)) for kind in ("prompt", "cached", "completion"))):
            with contextlib.suppress(KeyError):
                metric.remove(*labels)


_by_endpoint: dict[str, EndpointMetrics] = {}


def of_endpoint(endpoint_id: str, organization_id: int) -> EndpointMetrics:
    found = _by_endpoint.get(endpoint_id)
    if found is not None:
        # NOTE: a call holds it from here to its end, through awaits where nothing shows it in use (its admission, its
        # settlement): taken, it is not forgotten for `FORGET_AFTER_IDLE_FOLDS` more folds (the review of the forget).
        found.idle_folds = 0
    else:
        labels = (str(endpoint_id), str(organization_id))
        found = _by_endpoint[endpoint_id] = EndpointMetrics(
            labels=labels, inflight_child=inflight.labels(*labels), duration_child=request_duration.labels(*labels),
            ttft_child=time_to_first_token.labels(*labels),
            token_children=tuple(tokens_total.labels(*labels, kind) for kind in ("prompt", "cached", "completion")),
            waiting=waiting.labels(*labels), cold_start=cold_start.labels(*labels))
    return found


# An endpoint unused (nothing counted, in flight or waiting, not taken by a call) for this many folds in a row is
# forgotten by this process: its counts, and its series out of one process's registry (`EndpointMetrics.remove`),
# made again at its next call.
FORGET_AFTER_IDLE_FOLDS = 3600


def fold() -> None:
    """Publish every endpoint's counts since the last fold to prometheus_client (this process's values,
    or its files in multiprocess mode). Run on the event loop that counts them.

    NOTE: endpoints unused for `FORGET_AFTER_IDLE_FOLDS` folds are forgotten: before, every endpoint a process ever
    served (deleted ones too) kept ~17 KB of series and was folded every second for the process's life (found by the
    worker's soak: its batch lines count here too)."""
    for endpoint_id, endpoint_metrics in list(_by_endpoint.items()):
        if endpoint_metrics.fold():
            endpoint_metrics.idle_folds = 0
            continue
        endpoint_metrics.idle_folds += 1
        if endpoint_metrics.idle_folds >= FORGET_AFTER_IDLE_FOLDS:
            del _by_endpoint[endpoint_id]
            if MULTIPROCESS_DIR is None:
                # NOTE: in multiprocess mode prometheus_client cannot remove a series (its values stay in the process's
                # files), and a child made again shares their key: the children stay, only the counts here go.
                endpoint_metrics.remove()


async def fold_every_second() -> None:
    """`fold` every `FOLD_EVERY_S` for as long as the gateway runs (started at its startup)."""
    while True:
        await asyncio.sleep(FOLD_EVERY_S)
        fold()


class FleetCollector:
    """Fleet state from the database, read at each scrape (every web pod reports the same values).

    Computed whole by `refresh_fleet_gauges` and swapped in at once, so a replica state or a node
    that went away leaves no series behind, in one process or in several.
    """

    def __init__(self) -> None:
        self.families: list[GaugeMetricFamily] = []

    def describe(self) -> list:
        return []  # NOTE: nothing to describe before the first scrape; the names never collide

    def collect(self) -> list[GaugeMetricFamily]:
        return self.families


fleet = FleetCollector()
REGISTRY.register(fleet)


def refresh_fleet_gauges() -> None:
    """Read replica counts, names and GPU use from the database (sync: run it off the event loop)."""
    replicas = GaugeMetricFamily("inferplane_replicas", "Replicas by endpoint and state.", labels=[*ENDPOINT, "state"])
    rows = (Replica.objects.filter(state__in=LIVE_REPLICA_STATES, endpoint__deleted_at__isnull=True)
            .values("endpoint_id", "endpoint__organization_id", "state").annotate(count=Count("id")))
    for row in rows:
        replicas.add_metric([str(row["endpoint_id"]), str(row["endpoint__organization_id"]), row["state"]], row["count"])
    # Names, for dashboards to join on the ids (`* on (endpoint_id) group_left (name)`); always 1.
    endpoint_info = GaugeMetricFamily("inferplane_endpoint_info", "The name of each live endpoint, by id; always 1.",
                                      labels=[*ENDPOINT, "name"])
    for endpoint_id, organization_id, name in Endpoint.objects.live().values_list("id", "organization_id", "name"):
        endpoint_info.add_metric([str(endpoint_id), str(organization_id), name], 1)
    node_gpu_utilization = GaugeMetricFamily("inferplane_node_gpu_utilization",
                                             "GPU utilisation (0-1) per node and GPU.", labels=["node_id", "gpu"])
    node_info = GaugeMetricFamily("inferplane_node_info", "The name of each node not offline, by id; always 1.",
                                  labels=["node_id", "name"])
    for node_id, name, status in Node.objects.exclude(state=NodeState.OFFLINE).values_list("id", "name", "last_status"):
        node_info.add_metric([str(node_id), name], 1)
        for gpu in (status or {}).get("gpus", []):
            node_gpu_utilization.add_metric([str(node_id), str(gpu.get("index", 0))],
                                            float(gpu.get("utilization_percent", 0)) / 100)
    fleet.families = [replicas, node_gpu_utilization, endpoint_info, node_info, *pool_families(), *clock_families(),
                      *held_rollups.held_families()]


def clock_families() -> list[GaugeMetricFamily]:
    """How far each Celery process's clock was from Redis's when it last checked (`controlplane.clock`)."""
    skews = GaugeMetricFamily("inferplane_clock_skew_seconds", "Seconds each Celery process's clock was ahead of "
                              "Redis's (negative: behind) when it last checked; a worker ahead of beat by more than a "
                              "task's expiry drops its runs.", labels=["process"])
    try:
        recorded = clock.recorded_skews()
    except redis.exceptions.RedisError:
        return []  # NOTE: Redis down: the database's series are still reported
    for process, skew in sorted(recorded.items()):
        skews.add_metric([process], skew)
    return [skews]


def pool_families() -> list[GaugeMetricFamily]:
    """Per node pool (labelled by its unique name; pools are the platform's, not a tenant's): machines
    by launch state, and this month's node-hours and cost, busy vs idle (`endpoints.fleet.pool_costs`)."""
    nodes = GaugeMetricFamily("inferplane_pool_nodes", "Machines of each node pool by launch state.",
                              labels=["pool", "state"])
    node_hours = GaugeMetricFamily("inferplane_pool_node_hours",
                                   "Node-hours paid for this calendar month (UTC), busy or idle, per node pool.",
                                   labels=["pool", "kind"])
    cost = GaugeMetricFamily("inferplane_pool_cost", "This calendar month's cost (UTC) of each node pool's machines, "
                             "busy or idle, at its hourly price.", labels=["pool", "kind"])
    pools = list(NodePool.objects.all())
    names = {pool.pk: pool.name for pool in pools}
    rows = (NodeLaunch.objects.filter(state__in=LIVE_LAUNCH_STATES).values("pool_id", "state")
            .annotate(count=Count("id")).order_by())
    for row in rows:
        if row["pool_id"] in names:  # a pool created since the pools were read waits for the next scrape
            nodes.add_metric([names[row["pool_id"]], row["state"]], row["count"])
    for pool_id, usage in usage_by_pool(pools).items():
        node_hours.add_metric([names[pool_id], "busy"], usage.busy_node_hours)
        node_hours.add_metric([names[pool_id], "idle"], usage.idle_node_hours)
        cost.add_metric([names[pool_id], "busy"], float(usage.busy_cost))
        cost.add_metric([names[pool_id], "idle"], float(usage.idle_cost))
    return [nodes, node_hours, cost]


class Access(enum.Enum):
    """What a request for `/metrics` gets."""

    GRANTED = "granted"
    DENIED = "denied"  # 401: no token, or the wrong one
    OFF = "off"  # no token configured: `/metrics` does not exist (the ordinary 404)


def access(scope: dict) -> Access:
    """Whether an ASGI request may read `/metrics`.

    With `INFERPLANE_METRICS_TOKEN` set, only `Authorization: Bearer <that token>` (compared in
    constant time). Without one, metrics are off, except when debugging for a client on loopback
    that came through no proxy (`make run` on one machine).
    """
    token = settings.METRICS_TOKEN
    headers = dict(scope.get("headers") or [])
    if not token:
        return Access.GRANTED if settings.DEBUG and _direct_loopback_client(scope, headers) else Access.OFF
    return Access.GRANTED if token_granted(headers.get(b"authorization", b""), token) else Access.DENIED


def _direct_loopback_client(scope: dict, headers: dict[bytes, bytes]) -> bool:
    if b"x-forwarded-for" in headers or b"forwarded" in headers:
        return False
    client = scope.get("client")
    try:
        return client is not None and ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False


def _scraped_registry() -> CollectorRegistry:
    """What a scrape reads: this process's registry, or every process's files and the fleet."""
    if MULTIPROCESS_DIR is None:
        return REGISTRY
    registry = multiprocess_registry(MULTIPROCESS_DIR)
    registry.register(fleet)
    return registry


_SCRAPED = _scraped_registry()


def render() -> bytes:
    fold()
    if MULTIPROCESS_DIR is not None:
        forget_dead_processes(MULTIPROCESS_DIR)
    return generate_latest(_SCRAPED)
