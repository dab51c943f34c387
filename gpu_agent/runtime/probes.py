"""Probes of a running engine: its health check and its Prometheus metrics.

The supervisor asks `healthy()` to turn a STARTING replica READY (and to adopt an engine a previous
agent left running), and `metrics()` for the load each heartbeat reports and to tell a draining
engine is idle. Both answer quickly or not at all: a timeout is "not healthy" or "no metrics".
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass

import httpx


@dataclass(slots=True)
class EngineMetrics:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    generation_tokens_total: float = 0.0
    # Prompt tokens looked up in / found in the prefix cache since the engine started (vLLM's counters).
    prefix_cache_queries_total: float = 0.0
    prefix_cache_hits_total: float = 0.0


class EngineProbe:
    """One HTTP client for every probe of this agent's engines."""

    def __init__(self, timeout_s: float) -> None:
        self._http = httpx.Client(timeout=timeout_s)

    def healthy(self, address: str) -> bool:
        try:
            return self._http.get(f"{address}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self, address: str, engine_api_key: str) -> EngineMetrics | None:
        """The engine's metrics, or None when it did not answer."""
        try:
            response = self._http.get(f"{address}/metrics", headers={"Authorization": f"Bearer {engine_api_key}"})
            response.raise_for_status()
        except httpx.HTTPError:
            return None
        return parse_engine_metrics(response.text)

    def close(self) -> None:
        self._http.close()


_METRIC_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


def parse_engine_metrics(text: str) -> EngineMetrics:
    """Sum vLLM's Prometheus gauges over engines (one per data-parallel rank)."""
    values: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = _METRIC_LINE.match(line)
        if match:
            try:
                values[match["name"]] += float(match["value"])
            except ValueError:
                continue
    kv_cache = values.get("vllm:kv_cache_usage_perc", values.get("vllm:gpu_cache_usage_perc", 0.0))
    return EngineMetrics(
        num_running=int(values.get("vllm:num_requests_running", 0)),
        num_waiting=int(values.get("vllm:num_requests_waiting", 0)),
        kv_cache_usage=float(kv_cache),
        generation_tokens_total=values.get("vllm:generation_tokens_total", 0.0),
        prefix_cache_queries_total=values.get("vllm:prefix_cache_queries_total", values.get("vllm:prefix_cache_queries", 0.0)),
        prefix_cache_hits_total=values.get("vllm:prefix_cache_hits_total", values.get("vllm:prefix_cache_hits", 0.0)),
    )
