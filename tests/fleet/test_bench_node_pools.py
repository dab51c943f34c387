"""The node-pool benchmark's simulator (`bench/bench_node_pools.py`) on a tiny trace: it runs in
seconds, drives the real pool rules, and its books balance (busy + idle = node-hours)."""

from __future__ import annotations

import time

import pytest

from bench import bench_node_pools as bench
from endpoints.autoscaler import Load, decide

# Seconds: short timeouts and a short boot, so the whole life of a fleet fits in a few simulated minutes.
TINY = ["--hours", "0.5", "--idle-timeout-s", "60", "--node-idle-timeout-s", "120", "--provision-s", "30",
        "--provision-jitter-s", "5", "--weights-pull-s", "20", "--cold-start-s", "10", "--cold-start-jitter-s", "2",
        "--gpus-per-node", "2", "--max-replicas", "2", "--hourly-price", "3.0", "--warmup-s", "0"]


def tiny_traces() -> list[list[tuple[float, float]]]:
    """A burst on one endpoint from the start, a trickle on another later, one never called; then
    quiet until the trace ends (half an hour), long enough for every machine to time out."""
    burst = [(10.0 + index * 0.5, 3.0) for index in range(200)]
    trickle = [(120.0 + index * 10.0, 2.0) for index in range(20)]
    return [burst, trickle, []]


@pytest.fixture(scope="module")
def results() -> dict:
    args = bench.parse_args(TINY)
    started = time.perf_counter()
    outcome = bench.compare(tiny_traces(), args, decide, Load)
    outcome["_wall_s"] = time.perf_counter() - started
    return outcome


def policies(results: dict) -> dict:
    return {name: result for name, result in results.items() if not name.startswith("_")}


def test_every_policy_runs_the_tiny_trace_in_seconds_and_answers_every_request(results):
    assert results["_wall_s"] < 10
    assert set(policies(results)) == {"always_on_max", "always_on_peak", "node_scale_to_zero", "warm_node", "min_one"}
    for name, result in policies(results).items():
        assert result["num_requests"] == 220, name
        assert result["num_served"] == 220 and result["num_refused"] == 0, name


def test_busy_and_idle_node_hours_add_up_to_the_node_hours_of_every_policy(results):
    for name, result in policies(results).items():
        exact = result["node_seconds_exact"]
        assert exact["total"] > 0, name
        assert exact["busy"] + exact["idle"] == pytest.approx(exact["total"], abs=1e-6), name
        assert result["booting_node_hours"] <= result["idle_node_hours"], name
        assert result["cost"] == pytest.approx(result["node_hours"] * 3.0, abs=0.05), name


def test_an_always_on_fleet_launches_nothing_after_the_start_and_keeps_every_node(results):
    for name in ("always_on_max", "always_on_peak"):
        result = results[name]
        assert result["num_launches"] == 0, name
        assert result["num_nodes_at_end"] == result["policy"]["min_nodes"] == result["peak_nodes"], name
        assert result["node_wait_share"] == 0, name
    assert results["always_on_max"]["policy"]["min_nodes"] == 3  # 3 endpoints × 2 replicas on 2-GPU machines
    assert results["always_on_peak"]["node_hours"] <= results["always_on_max"]["node_hours"]


def test_node_scale_to_zero_ends_with_no_machine_and_its_first_requests_wait_for_one(results):
    result = results["node_scale_to_zero"]
    assert result["num_nodes_at_end"] == 0
    assert result["num_launches"] >= 1
    assert result["node_wait_share"] > 0
    assert result["node_hours"] < results["always_on_peak"]["node_hours"]
    assert result["wait_p99_s"] > 30  # a machine's boot, the weights and the engine's start


def test_a_warm_node_spares_requests_the_wait_for_a_machine_and_is_kept_at_the_end(results):
    warm, cold = results["warm_node"], results["node_scale_to_zero"]
    assert warm["node_wait_share"] == 0
    assert warm["wait_p99_s"] < cold["wait_p99_s"]
    assert warm["num_nodes_at_end"] == 1
    assert results["min_one"]["num_nodes_at_end"] == 1


def test_a_shorter_node_idle_timeout_pays_for_fewer_idle_node_hours_and_boots_more_machines():
    args = bench.parse_args(TINY + ["--sweep-node-idle-timeouts-s", "30,300"])
    swept = bench.sweep_idle_timeouts(tiny_traces(), args, decide, Load)
    short, long = swept["30"], swept["300"]
    assert short["idle_node_hours"] < long["idle_node_hours"]
    assert short["num_launches"] >= long["num_launches"]
    assert short["num_nodes_at_end"] == long["num_nodes_at_end"] == 0  # the tail outlasts the longest timeout
