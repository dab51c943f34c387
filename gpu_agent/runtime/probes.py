"""Probes of a running engine: its health check, its Prometheus metrics and its chat template's size.

The supervisor asks `healthy()` to turn a STARTING replica READY (and to adopt an engine a previous
agent left running), `metrics()` for the load each heartbeat reports and to tell a draining
engine is idle, and `chat_template_tokens()` once, at READY. Each answers quickly or not at all: a
timeout is "not healthy", "no metrics", "not measured".
"""

from __future__ import annotations

import collections
import math
import re
from dataclasses import dataclass

import httpx

from gpu_agent.protocol import ChatTemplateTokens

# Conversations of empty messages: what a template renders for them is its own text alone. Some templates refuse
# some shapes (a system role, say); those probes are left out.
_ONE_MESSAGE = [{"role": "user", "content": ""}]
_THREE_TURNS = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}, {"role": "user", "content": ""}]
_WITH_SYSTEM = [{"role": "system", "content": ""}, *_THREE_TURNS]


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

    def chat_template_tokens(self, address: str, engine_api_key: str, model: str) -> ChatTemplateTokens | None:
        """What the model's chat template adds to a conversation, as the engine itself counts it (`/tokenize`
        of conversations of empty messages); None when it cannot say (no chat template, not answering).

        NOTE: runs on the supervisor's loop: an engine that does not answer in time (a template slow to render)
        costs one timeout, not one per probe."""
        try:
            one = self._count(address, engine_api_key, model, _ONE_MESSAGE)
            if one is None:
                return None
            per_message = 0
            for messages in (_THREE_TURNS, _WITH_SYSTEM):
                count = self._count(address, engine_api_key, model, messages)
                if count is not None:
                    per_message = max(per_message, math.ceil((count - one) / (len(messages) - 1)))
        except httpx.TransportError:
            return None
        return ChatTemplateTokens(per_conversation=one, per_message=per_message)

    def _count(self, address: str, engine_api_key: str, model: str, messages: list[dict]) -> int | None:
        """The engine's count of `messages` rendered; None when it refused them."""
        response = self._http.post(f"{address}/tokenize", headers={"Authorization": f"Bearer {engine_api_key}"},
                                   json={"model": model, "messages": messages, "add_generation_prompt": True})
        if response.status_code != 200:
            return None
        try:
            count = response.json().get("count")
        except (ValueError, AttributeError):
            return None
        return count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else None

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
