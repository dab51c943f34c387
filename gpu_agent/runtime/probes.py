"""Probes of a running engine: its health check, its Prometheus metrics and its chat template's size.

The supervisor asks `healthy()` to turn a STARTING replica READY (and to adopt an engine a previous
agent left running), `health()` whether a READY one still is (a late answer: busy, not unhealthy), `served_context()` whether it serves no more context than it was launched with, `metrics()` for the load each heartbeat reports and to tell a draining
engine is idle, and `chat_template_tokens()` once, at READY. Each answers quickly or not at all: a
timeout is "not healthy", "no metrics", "not measured".
"""

from __future__ import annotations

import collections
import math
import re
from dataclasses import dataclass

import httpx

from gpu_agent.protocol import TEMPLATE_KWARG_VARIANTS, ChatTemplateTokens

# Conversations of empty messages: what a template renders for them is its own text alone, and each probe adds one
# message of one role to the one before. Some templates refuse some shapes (a system role, a conversation that ends
# with the assistant); those are measured another way or left out.
_USER = {"role": "user", "content": ""}
_ASSISTANT = {"role": "assistant", "content": ""}
_ONE = [_USER]
_TWO = [_USER, _ASSISTANT]
_THREE = [_USER, _ASSISTANT, _USER]
_WITH_SYSTEM = [{"role": "system", "content": ""}, *_THREE]


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

    def health(self, address: str) -> bool | None:
        """A READY engine's /health: True healthy, False an answer that is not (vLLM's EngineCore gone) or no server
        there at all, None no answer in time (busy: a long prefill, a saturated API server, a CPU engine's workers on
        every core; vLLM's own check only reads a flag)."""
        try:
            return self._http.get(f"{address}/health").status_code == 200
        except httpx.TimeoutException:
            return None
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

    def served_context(self, address: str, engine_api_key: str) -> int | None:
        """The longest context the engine serves: the largest `max_model_len` of the models its `/v1/models` lists.
        None when it did not answer in time; `ValueError` when it answered without one."""
        try:
            response = self._http.get(f"{address}/v1/models", headers={"Authorization": f"Bearer {engine_api_key}"})
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            raise ValueError(f"its /v1/models answered {response.status_code}")
        try:
            listed = response.json().get("data")
        except (ValueError, AttributeError):
            raise ValueError("its /v1/models answer is not a list of models") from None
        lengths = [card.get("max_model_len") for card in listed if isinstance(card, dict)] if isinstance(
            listed, list) else []
        if not lengths or not all(isinstance(length, int) and not isinstance(length, bool) for length in lengths):
            raise ValueError("its /v1/models answer does not say the context of every model it serves")
        return max(lengths)

    def chat_template_tokens(self, address: str, engine_api_key: str, model: str) -> ChatTemplateTokens | None:
        """What the model's chat template adds to a conversation, as the engine itself counts it (`/tokenize`
        of conversations of empty messages); None when it cannot say (no chat template, not answering).

        Per message: the most any role's message adds (an assistant's markers may cost more than a user's); a
        system message that makes a default system prompt go away adds less than nothing, and counts nothing.
        An engine that stops answering in time (a template slow to render some shape) ends the measure there,
        with what was counted before it.

        Then the same with each template argument a request may set (`protocol.TEMPLATE_KWARG_VARIANTS`), keeping the most: a variant the
        engine refuses is left out (a request with it is refused too); one it does not answer leaves the flags
        unmeasured (a request that sets one then reserves the context)."""
        try:
            plain = self._measure(address, engine_api_key, model, None)
        except httpx.TransportError:
            return None
        if plain is None:
            return None
        flagged: tuple[int, int] | None = plain
        try:
            for kwargs in TEMPLATE_KWARG_VARIANTS:
                measured = self._measure(address, engine_api_key, model, kwargs)
                if measured is not None:
                    flagged = (max(flagged[0], measured[0]), max(flagged[1], measured[1]))
        except httpx.TransportError:
            flagged = None
        return ChatTemplateTokens(per_conversation=plain[0], per_message=plain[1],
                                  flagged_per_conversation=flagged[0] if flagged else None,
                                  flagged_per_message=flagged[1] if flagged else None)

    def _measure(self, address: str, engine_api_key: str, model: str, kwargs: dict | None) -> tuple[int, int] | None:
        """(per conversation, per message) with `kwargs` as `chat_template_kwargs`; None when refused."""
        counts: dict[int, int | None] = {}
        try:
            counts[1] = self._count(address, engine_api_key, model, _ONE, kwargs)
            if counts[1] is None:
                return None
            for size, messages in ((2, _TWO), (3, _THREE), (4, _WITH_SYSTEM)):
                counts[size] = self._count(address, engine_api_key, model, messages, kwargs)
        except httpx.TransportError:
            if kwargs is not None or 1 not in counts:
                raise
        one, two, three, four = (counts.get(size) for size in (1, 2, 3, 4))
        if one is None:
            return None
        added = []
        if two is not None and three is not None:
            added += [two - one, three - two]  # an assistant's message, a user's
        elif three is not None:
            added.append(three - one)  # both together: a bound on either
        if four is not None and three is not None:
            added.append(four - three)  # a system message's
        return one, max([0, *added])

    def _count(self, address: str, engine_api_key: str, model: str, messages: list[dict],
               kwargs: dict | None = None) -> int | None:
        """The engine's count of `messages` rendered; None when it refused them."""
        body = {"model": model, "messages": messages, "add_generation_prompt": True}
        if kwargs is not None:
            body["chat_template_kwargs"] = kwargs
        response = self._http.post(f"{address}/tokenize", headers={"Authorization": f"Bearer {engine_api_key}"},
                                   json=body)
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
                value = float(match["value"])
            except ValueError:
                continue
            # NOTE: Prometheus writes NaN and +Inf; the protocol refuses a report that carries one (whole heartbeat).
            if math.isfinite(value):
                values[match["name"]] += value
    kv_cache = values.get("vllm:kv_cache_usage_perc", values.get("vllm:gpu_cache_usage_perc", 0.0))
    return EngineMetrics(
        num_running=int(values.get("vllm:num_requests_running", 0)),
        num_waiting=int(values.get("vllm:num_requests_waiting", 0)),
        kv_cache_usage=float(kv_cache),
        generation_tokens_total=values.get("vllm:generation_tokens_total", 0.0),
        prefix_cache_queries_total=values.get("vllm:prefix_cache_queries_total", values.get("vllm:prefix_cache_queries", 0.0)),
        prefix_cache_hits_total=values.get("vllm:prefix_cache_hits_total", values.get("vllm:prefix_cache_hits", 0.0)),
    )
