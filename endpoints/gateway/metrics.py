"""Prometheus metrics of the gateway, served at `/metrics` by every web process."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REGISTRY = CollectorRegistry(auto_describe=True)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

requests_total = Counter("inferplane_requests_total", "Inference requests by endpoint and outcome.",
                         ["endpoint", "status"], registry=REGISTRY)
request_duration = Histogram("inferplane_request_duration_seconds", "Whole request latency.", ["endpoint"],
                             buckets=LATENCY_BUCKETS, registry=REGISTRY)
time_to_first_token = Histogram("inferplane_time_to_first_token_seconds", "Time to the first streamed token.",
                                ["endpoint"], buckets=LATENCY_BUCKETS, registry=REGISTRY)
tokens_total = Counter("inferplane_tokens_total", "Tokens by endpoint and kind (prompt, cached, completion).",
                       ["endpoint", "kind"], registry=REGISTRY)
inflight = Gauge("inferplane_inflight_requests", "Requests being served by this process.", ["endpoint"], registry=REGISTRY)
waiting = Gauge("inferplane_waiting_requests", "Requests held for a cold start in this process.", ["endpoint"], registry=REGISTRY)
cold_start = Histogram("inferplane_cold_start_seconds", "Seconds a request waited for a replica.", ["endpoint"],
                       buckets=(0.5, 1, 2, 5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600), registry=REGISTRY)


@dataclass(slots=True)
class EndpointMetrics:
    """One endpoint's children of the request metrics, looked up once (`labels()` takes a lock each call)."""

    name: str
    inflight: Gauge
    waiting: Gauge
    cold_start: Histogram
    time_to_first_token: Histogram
    request_duration: Histogram
    tokens: tuple[Counter, Counter, Counter]  # prompt, cached, completion
    outcomes: dict[str, Counter]

    def observe_request(self, outcome: str, duration_s: float, prompt: int, cached: int, completion: int) -> None:
        counter = self.outcomes.get(outcome)
        if counter is None:
            counter = self.outcomes[outcome] = requests_total.labels(self.name, outcome)
        counter.inc()
        self.request_duration.observe(duration_s)
        for child, value in zip(self.tokens, (prompt, cached, completion), strict=True):
            if value:
                child.inc(value)


_by_endpoint: dict[str, EndpointMetrics] = {}


def of_endpoint(name: str) -> EndpointMetrics:
    found = _by_endpoint.get(name)
    if found is None:
        found = _by_endpoint[name] = EndpointMetrics(
            name=name, inflight=inflight.labels(name), waiting=waiting.labels(name), cold_start=cold_start.labels(name),
            time_to_first_token=time_to_first_token.labels(name), request_duration=request_duration.labels(name),
            tokens=tuple(tokens_total.labels(name, kind) for kind in ("prompt", "cached", "completion")), outcomes={},
        )
    return found


# Fleet state from the database, refreshed at each scrape (every web pod reports the same values).
replicas = Gauge("inferplane_replicas", "Replicas by endpoint and state.", ["endpoint", "state"], registry=REGISTRY)
node_gpu_utilization = Gauge("inferplane_node_gpu_utilization", "GPU utilisation (0-1) per node and GPU.",
                             ["node", "gpu"], registry=REGISTRY)


def refresh_fleet_gauges() -> None:
    """Read replica counts and GPU use from the database (sync: run it off the event loop)."""
    from django.db.models import Count

    from endpoints.models import ACTIVE_REPLICA_STATES, Replica
    from gpu_agent.models import Node
    from gpu_agent.protocol import NodeState

    replicas.clear()
    rows = (Replica.objects.filter(state__in=ACTIVE_REPLICA_STATES, endpoint__deleted_at__isnull=True)
            .values("endpoint__name", "state").annotate(count=Count("id")))
    for row in rows:
        replicas.labels(row["endpoint__name"], row["state"]).set(row["count"])
    node_gpu_utilization.clear()
    for name, status in Node.objects.exclude(state=NodeState.OFFLINE).values_list("name", "last_status"):
        for gpu in (status or {}).get("gpus", []):
            node_gpu_utilization.labels(name, str(gpu.get("index", 0))).set(float(gpu.get("utilization_percent", 0)) / 100)


def render() -> bytes:
    return generate_latest(REGISTRY)
