"""A request's metrics are counted as plain numbers and folded into prometheus_client
(`endpoints.gateway.metrics.fold`): what a scrape reads must be exactly what observing each request
directly would have given, once, whatever the fold's timing."""

from __future__ import annotations

import asyncio
import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from endpoints.gateway import metrics

# Values on, just below and just above bucket bounds, the smallest and largest, and ones past the last.
OBSERVATIONS = [0.0, 0.005, 0.0051, 0.01, 0.3, 1, 1.0000001, 2.5, 29.999, 300, 300.5, 10_000, math.inf, 0.02]


def _samples(registry: CollectorRegistry) -> dict:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for sample in family.samples if not sample.name.endswith("_created")}


def test_a_folded_tally_exposes_what_observing_each_value_gives():
    direct_registry, folded_registry = CollectorRegistry(), CollectorRegistry()
    direct = Histogram("latency", "", ["endpoint_id"], buckets=metrics.LATENCY_BUCKETS, registry=direct_registry)
    folded = Histogram("latency", "", ["endpoint_id"], buckets=metrics.LATENCY_BUCKETS, registry=folded_registry)
    tally = metrics.Tally(metrics.LATENCY_BUCKETS)
    for value in OBSERVATIONS[:5]:
        direct.labels("e").observe(value)
        tally.observe(value)
    tally.fold_into(folded.labels("e"))
    tally.fold_into(folded.labels("e"))  # a fold with nothing new adds nothing
    for value in OBSERVATIONS[5:]:
        direct.labels("e").observe(value)
        tally.observe(value)
    tally.fold_into(folded.labels("e"))
    assert _samples(folded_registry) == _samples(direct_registry)
    assert _samples(folded_registry)[("latency_count", (("endpoint_id", "e"),))] == len(OBSERVATIONS)


def _fresh_metrics(monkeypatch) -> CollectorRegistry:
    registry = CollectorRegistry()
    fresh = {
        "requests_total": Counter("requests", "", ["endpoint_id", "organization_id", "status"], registry=registry),
        "request_duration": Histogram("duration", "", ["endpoint_id", "organization_id"],
                                      buckets=metrics.LATENCY_BUCKETS, registry=registry),
        "time_to_first_token": Histogram("ttft", "", ["endpoint_id", "organization_id"],
                                         buckets=metrics.LATENCY_BUCKETS, registry=registry),
        "tokens_total": Counter("tokens", "", ["endpoint_id", "organization_id", "kind"], registry=registry),
        "inflight": Gauge("inflight", "", ["endpoint_id", "organization_id"], registry=registry),
        "waiting": Gauge("waiting", "", ["endpoint_id", "organization_id"], registry=registry),
        "cold_start": Histogram("cold", "", ["endpoint_id", "organization_id"], registry=registry),
        "usage_past_reservation": Counter("past", "", ["endpoint_id", "organization_id"], registry=registry),
    }
    for name, metric in fresh.items():
        monkeypatch.setattr(metrics, name, metric)
    monkeypatch.setattr(metrics, "_by_endpoint", {})
    return registry


def test_an_endpoints_requests_tokens_and_in_flight_are_published_once(monkeypatch):
    registry = _fresh_metrics(monkeypatch)
    endpoint = metrics.of_endpoint("e1", 7)
    labels = (("endpoint_id", "e1"), ("organization_id", "7"))

    endpoint.inflight.inc()
    endpoint.inflight.inc()
    endpoint.observe_request("ok", 0.2, 10, 4, 3)
    endpoint.observe_request("client_aborted", 0.01, 5, 0, 0)
    endpoint.time_to_first_token.observe(0.05)
    endpoint.inflight.dec()
    assert ("requests_total", (*labels, ("status", "ok"))) not in _samples(registry)  # nothing before a fold

    metrics.fold()
    metrics.fold()  # twice: each count is published once
    samples = _samples(registry)
    assert samples[("requests_total", (*labels, ("status", "ok")))] == 1
    assert samples[("requests_total", (*labels, ("status", "client_aborted")))] == 1
    assert samples[("tokens_total", (("endpoint_id", "e1"), ("kind", "prompt"), ("organization_id", "7")))] == 15
    assert samples[("tokens_total", (("endpoint_id", "e1"), ("kind", "cached"), ("organization_id", "7")))] == 4
    assert samples[("tokens_total", (("endpoint_id", "e1"), ("kind", "completion"), ("organization_id", "7")))] == 3
    assert samples[("duration_count", labels)] == 2
    assert samples[("duration_sum", labels)] == pytest.approx(0.21)
    assert samples[("ttft_count", labels)] == 1
    assert samples[("inflight", labels)] == 1

    endpoint.inflight.dec()
    endpoint.observe_request("ok", 0.3, 1, 0, 1)
    metrics.fold()
    samples = _samples(registry)
    assert samples[("requests_total", (*labels, ("status", "ok")))] == 2
    assert samples[("duration_count", labels)] == 3
    assert samples[("inflight", labels)] == 0


def test_an_endpoint_unused_for_a_while_is_forgotten_with_its_series_and_one_in_use_is_kept(monkeypatch):
    # Before, every endpoint a process ever served kept its counts and series (~17 KB) and was folded every second for
    # the process's life, deleted ones too: 50 endpoints served once were all still held.
    registry = _fresh_metrics(monkeypatch)
    monkeypatch.setattr(metrics, "FORGET_AFTER_IDLE_FOLDS", 3)
    for number in range(50):
        metrics.of_endpoint(f"old{number}", 7).observe_request("ok", 0.1, 1, 0, 1)
    streaming, held = metrics.of_endpoint("streaming", 7), metrics.of_endpoint("held", 7)
    streaming.inflight.inc()  # a call in flight, nothing counted since
    held.waiting.inc()  # a call held for a cold start
    for _ in range(4):
        metrics.fold()
    assert sorted(metrics._by_endpoint) == ["held", "streaming"]
    assert not [key for key in _samples(registry) if ("endpoint_id", "old1") in key[1]]
    again = metrics.of_endpoint("old1", 7)  # called again: counted afresh
    again.observe_request("ok", 0.1, 1, 0, 1)
    metrics.fold()
    assert _samples(registry)[("requests_total", (("endpoint_id", "old1"), ("organization_id", "7"),
                                                  ("status", "ok")))] == 1


def test_an_endpoint_a_call_took_is_not_forgotten_under_it(monkeypatch):
    # Before, a call that took the endpoint's metrics after it had been idle, and counted nothing while a fold ran (its
    # admission, its settlement: awaits with nothing in flight), had them forgotten under it: its outcome and tokens
    # went to an object no fold read again (none published).
    registry = _fresh_metrics(monkeypatch)
    monkeypatch.setattr(metrics, "FORGET_AFTER_IDLE_FOLDS", 2)
    metrics.of_endpoint("e1", 7).observe_request("ok", 0.1, 1, 0, 1)
    metrics.fold()
    metrics.fold()  # idle since: one fold short of its forget
    taken = metrics.of_endpoint("e1", 7)  # a call begins
    metrics.fold()  # ... and awaits, nothing counted yet
    taken.observe_request("ok", 0.2, 100, 0, 50)
    metrics.fold()
    assert _samples(registry)[("requests_total", (("endpoint_id", "e1"), ("organization_id", "7"),
                                                  ("status", "ok")))] == 2


@pytest.mark.django_db(transaction=True)
def test_a_stopping_gateway_process_publishes_the_counts_it_had_not_folded(monkeypatch):
    # A process stops between two folds: what it counted since the last one reaches prometheus_client (its files, in a
    # pod) at the lifespan's shutdown, before it goes; nothing folds it afterwards.
    from controlplane.asgi import application

    registry = _fresh_metrics(monkeypatch)
    labels = (("endpoint_id", "e1"), ("organization_id", "7"))
    endpoint = metrics.of_endpoint("e1", 7)
    for _ in range(5):
        endpoint.inflight.inc()
        endpoint.observe_request("ok", 0.2, 10, 0, 3)
        endpoint.inflight.dec()
    assert ("requests_total", (*labels, ("status", "ok"))) not in _samples(registry)  # not folded yet
    sent = []

    async def receive():
        return {"type": "lifespan.shutdown"}

    async def send(message):
        sent.append(message)

    asyncio.run(application(
        {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}, receive, send))
    assert sent == [{"type": "lifespan.shutdown.complete"}]
    samples = _samples(registry)
    assert samples[("requests_total", (*labels, ("status", "ok")))] == 5
    assert samples[("duration_count", labels)] == 5
    assert samples[("tokens_total", (("endpoint_id", "e1"), ("kind", "prompt"), ("organization_id", "7")))] == 50
    assert samples[("tokens_total", (("endpoint_id", "e1"), ("kind", "completion"), ("organization_id", "7")))] == 15
    assert samples[("inflight", labels)] == 0
