"""Token ids in a `/v1` body: what an integer is (JSON's `true` is not one) and the widest id an engine takes.

One rule for completions' `prompt`, embeddings' `input` and the sampling fields that list ids
(`endpoints.gateway.request`, `endpoints.gateway.embeddings`)."""

from __future__ import annotations

MAX_TOKEN_ID = 2**31 - 1  # a signed 32-bit id, what vLLM's tokenizers and tensors hold


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def are_token_ids(items: list) -> bool:
    return all(is_int(item) and 0 <= item <= MAX_TOKEN_ID for item in items)
