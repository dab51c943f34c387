"""Prefix-aware replica choice: which READY replica most likely holds a request's prompt prefix.

vLLM keeps the KV cache of prompts it has seen (automatic prefix caching, in blocks of 16 tokens) and
serves a later prompt that starts the same way from it: a shared system prompt or a conversation's
history is computed once per replica. Least-outstanding routing scatters such requests, so each replica
recomputes what another already holds. This module gives each request:

- a **prefix key**: a hash of the first `PREFIX_NUM_BLOCKS` blocks of its rendered prompt, a block being
  `BLOCK_CHARS` characters (16 tokens at ~4 characters a token: the engine's block size, approximated in
  characters because the gateway does not tokenize). For chat it is the messages' roles and text in
  order, so a shared system prompt, or a conversation's history, maps to the same key; for completions
  the prompt. A prompt shorter than that shares no prefix worth routing for: no key, least-outstanding.
- an **order of preference** over the candidates: rendezvous (highest random weight) hashing of the key
  over replica ids, so every gateway ranks them the same way and a replica coming or going moves only the
  prefixes it ranks first; replicas in `prefer` (e.g. those holding the request's LoRA adapter) rank first.

The admission script (`traffic.PICK`) takes the order and chooses the first candidate whose outstanding
count is at most the least-loaded one's plus `margin` (the endpoint's target concurrency), else the least
loaded: a hot prefix spills over instead of queueing on one replica. Learning: when a replica reports
prefix-cache hits for a request (`usage.prompt_tokens_details.cached_tokens`), the finish script records
it under the prefix (`LEARN`, a TTL'd key per endpoint and prefix, so bounded by the prefixes seen in
`HINT_TTL_S`), and the next pick moves that replica to the front: placement follows the evidence when
replicas come and go, rather than the hash alone.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass

from controlplane.redis_keys import org_tag
from controlplane.script_parts import ScriptPart

BLOCK_CHARS = 64  # vLLM's default block of 16 tokens, at ~4 characters a token
PREFIX_NUM_BLOCKS = 4  # the key covers the first 256 characters (~64 tokens): a system prompt's worth
PREFIX_CHARS = BLOCK_CHARS * PREFIX_NUM_BLOCKS
HINT_TTL_S = 600  # how long a replica's reported cache hit steers its prefix (caches evict; replicas change)

# Records which replica last served a prefix from its cache. K: the prefix's hint key (or a placeholder);
# A: the outstanding counter of the replica that served it, TTL, learn (1: it reported cached tokens).
LEARN_LUA = """
local function routing_learn(K, A)
  if A[3] == '1' then redis.call('SET', K[1], A[1], 'EX', A[2]) end
end
"""
LEARN = ScriptPart("routing_learn", keys=("the prefix's hint key (or a placeholder)",),
                   args=("the serving replica's outstanding counter", "hint TTL", "learn (1: cache hit)"),
                   lua=LEARN_LUA)


@dataclass(slots=True, frozen=True)
class Route:
    """How the admission script should choose among the candidates (indices are 0-based here)."""

    hint_key: str  # where a replica's cache hit for this prefix is remembered (a placeholder without a key)
    order: tuple[int, ...]  # candidates in order of preference; empty: least outstanding
    num_preferred: int  # the first entries of `order` that are in `prefer`: a hint never jumps ahead of them
    margin: int  # how many more outstanding requests than the least loaded a preferred replica may hold

    def __post_init__(self) -> None:
        if self.margin < 0 or not 0 <= self.num_preferred <= len(self.order):
            raise ValueError("margin and num_preferred must be non-negative, num_preferred at most len(order)")


def prompt_text(kind: str, payload: dict, limit: int = PREFIX_CHARS) -> str:
    """The rendered prompt's text as far as routing needs it (roles and text in order), from the first
    `limit` characters on possibly cut short."""
    if kind == "chat":
        parts, num_chars = [], 0
        for message in payload.get("messages") or []:
            if num_chars >= limit:
                break
            content = message.get("content")
            if not isinstance(content, str):  # a list of parts: text as is, anything else as JSON
                # NOTE: only as far as the limit: every part of a message of 600,000 was dumped (~1.7 s of the loop).
                pieces, size = [], num_chars
                for part in content if isinstance(content, list) else []:
                    if size >= limit:
                        break
                    pieces.append(part.get("text", "") if isinstance(part, dict) and part.get("type") == "text"
                                  else json.dumps(part, sort_keys=True))
                    size += len(pieces[-1])
                content = "".join(pieces)
            parts.append(f"<{message.get('role', '')}>{content}")
            num_chars += len(parts[-1])
        return "".join(parts)
    if kind == "responses":  # rendered as a conversation: `instructions` a system message, each item a message
        instructions, items = payload.get("instructions"), payload.get("input")
        messages = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
        if isinstance(items, str):
            messages.append({"role": "user", "content": items})
        elif isinstance(items, list):
            messages.extend(item for item in items if isinstance(item, dict))
        return prompt_text("chat", {"messages": messages}, limit)
    if kind == "completion":
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of prompts: the first decides
        if isinstance(prompt, str):
            return prompt
        # NOTE: token ids as text, each at least one character and a space: `limit` of them reach the limit. Every id
        # was written out before: 500,000 of them held the event loop ~0.2 s for a key that reads 256 characters.
        return " ".join(str(token) for token in itertools.islice(prompt or [], limit))
    return ""  # embeddings keep no KV cache between requests


def prefix_key(kind: str, payload: dict) -> str | None:
    """The hash of the prompt's first `PREFIX_CHARS` characters, or None for a prompt shorter than that."""
    text = prompt_text(kind, payload)
    if len(text) < PREFIX_CHARS:
        return None
    return hashlib.blake2b(text[:PREFIX_CHARS].encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


def _weight(key: str, replica_id: str) -> bytes:
    return hashlib.blake2b(f"{key}|{replica_id}".encode(), digest_size=8).digest()


def preference(key: str | None, replica_ids: Sequence[str], prefer: frozenset[str] = frozenset()) -> list[int]:
    """Indices into `replica_ids` in order of preference: `prefer`'s first, each group by rendezvous
    weight of `key`. Without a key only `prefer`'s are ranked (in the order given); the rest is left to
    least-outstanding."""
    preferred = [i for i, replica_id in enumerate(replica_ids) if replica_id in prefer]
    if key is None:
        return preferred
    others = [i for i, replica_id in enumerate(replica_ids) if replica_id not in prefer]
    by_weight = lambda i: _weight(key, replica_ids[i])  # noqa: E731
    return sorted(preferred, key=by_weight, reverse=True) + sorted(others, key=by_weight, reverse=True)


@functools.lru_cache(maxsize=4096)
def hint_key(organization_id: int, endpoint_id: str, key: str | None) -> str:
    """Where the replica that last served `key` from its cache is remembered (org-tagged, TTL'd)."""
    return f"gw:{org_tag(organization_id)}:prefix_hint:{endpoint_id}:{key or '-'}"


def route(organization_id: int, endpoint_id: str, key: str | None, replica_ids: Sequence[str], *,
          margin: int, prefer: frozenset[str] = frozenset()) -> Route:
    """The admission script's instructions for one request over these candidates."""
    if key is None and not prefer:  # nothing to prefer: least outstanding (most requests; one per endpoint)
        return _least_outstanding(organization_id, endpoint_id, max(margin, 0))
    order = preference(key, replica_ids, prefer)
    num_preferred = sum(1 for i in order if replica_ids[i] in prefer)
    return Route(hint_key(organization_id, endpoint_id, key), tuple(order), num_preferred, max(margin, 0))


@functools.lru_cache(maxsize=4096)
def _least_outstanding(organization_id: int, endpoint_id: str, margin: int) -> Route:
    return Route(hint_key(organization_id, endpoint_id, None), (), 0, margin)


def choose(route: Route, counts: Sequence[int], hinted: int | None = None) -> int:
    """What `traffic.PICK` chooses, given the candidates' outstanding counts and the hinted candidate
    (the one that last reported a cache hit for this prefix): the script's rule, readable in Python."""
    least = min(range(len(counts)), key=lambda i: counts[i])
    order = list(route.order)
    if hinted in order and (route.num_preferred == 0 or order.index(hinted) < route.num_preferred):
        order.remove(hinted)
        order.insert(0, hinted)
    for i in order:
        if counts[i] <= counts[least] + route.margin:
            return i
    return least


def learn_keys_and_args(organization_id: int, endpoint_id: str, key: str | None, served_by_counter: str | None,
                        cached_tokens: int) -> tuple[list[str], list]:
    """`LEARN`'s keys and arguments: remember the replica if it served this prefix from its cache."""
    learn = key is not None and served_by_counter is not None and cached_tokens > 0
    return [hint_key(organization_id, endpoint_id, key)], [served_by_counter or "", HINT_TTL_S, "1" if learn else "0"]
