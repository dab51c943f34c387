"""A replica's speculative decoding on the node: its draft model's fetch and check, and vLLM's flag.

vLLM 0.32 takes one `--speculative-config` JSON (`vllm/config/speculative.py`): prompt lookup is
`{"method": "ngram", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}`, a draft
model `{"method": "draft_model", "model": <local dir>, "num_speculative_tokens"}`.

The draft is fetched like the replica's weights, with the replica's own credentials (the fleet's
only when the control plane said the draft is on the public catalogue: `SourceAccess.for_draft`), and checked before the
engine starts: a draft of another vocabulary would be refused by vLLM only after loading both.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from gpu_agent.protocol import ReplicaSpec, SpeculativeMethod
from gpu_agent.runtime.model_info import MalformedModel, load_config, refuse_paths_outside_model
from gpu_agent.runtime.model_json import ModelJsonTooLarge


def speculative_args(spec: ReplicaSpec) -> list[str]:
    """The engine flags for the spec's speculative decoding ([] when off)."""
    speculative = spec.speculative
    if speculative is None:
        return []
    if speculative.method == SpeculativeMethod.NGRAM:
        config = {
            "method": "ngram",
            "num_speculative_tokens": speculative.num_speculative_tokens,
            "prompt_lookup_max": speculative.prompt_lookup_max,
            "prompt_lookup_min": speculative.prompt_lookup_min,
        }
    else:
        config = {
            "method": "draft_model",
            "model": speculative.draft_source,
            "num_speculative_tokens": speculative.num_speculative_tokens,
        }
    return ["--speculative-config", json.dumps(config, sort_keys=True)]


def needs_draft(spec: ReplicaSpec) -> bool:
    return spec.speculative is not None and spec.speculative.method == SpeculativeMethod.DRAFT


def with_local_draft(spec: ReplicaSpec, draft_dir: Path) -> ReplicaSpec:
    """The spec the engine is started from: its draft is the cached copy, not the remote source."""
    return dataclasses.replace(spec, speculative=dataclasses.replace(spec.speculative, draft_source=str(draft_dir)))


def _vocab_size(model_dir: Path) -> int | None:
    """config.json's vocabulary size; None when it does not say. Raises `ModelJsonTooLarge`."""
    config = load_config(model_dir) or {}
    config = config.get("text_config", config)
    size = config.get("vocab_size") if isinstance(config, dict) else None
    return size if isinstance(size, int) else None


def draft_problem(model_dir: Path, draft_dir: Path) -> str:
    """Why vLLM would refuse this draft for this model; "" when it would not (or cannot tell)."""
    try:
        refuse_paths_outside_model(draft_dir)  # NOTE: a draft is a tenant's files too, as the model's own are checked
        draft = _vocab_size(draft_dir)
    except (ModelJsonTooLarge, MalformedModel) as exc:
        return f"the draft model's files cannot be served: {exc}"
    try:
        target = _vocab_size(model_dir)
    except ModelJsonTooLarge as exc:  # NOTE: `read_model` refuses such a model first; kept for any other caller
        return f"the model's files cannot be served: {exc}"
    if target is None or draft is None or target == draft:
        return ""
    return (
        f"the draft model's vocabulary ({draft} tokens) is not the model's ({target} tokens): "
        "a draft model must share the model's tokenizer"
    )
