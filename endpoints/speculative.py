"""Speculative decoding of an endpoint: the spec's rules and what its replicas are told.

An endpoint guesses tokens ahead either by prompt lookup (n-gram: the last few generated tokens
are looked up in the prompt and what followed them there is proposed, which pays off when the
output repeats the input, as in editing or extraction), or with a small draft model of the same
tokenizer. The target model checks every guess in one forward pass, so the output is what the
target alone would give; only the speed changes.

The draft model is read like the endpoint's weights, with the endpoint's own credential (never
another's), the fleet's only when the draft itself is on the public catalogue.
"""

from __future__ import annotations

from endpoints.models import CredentialKind, is_catalogue_source, organization_scope, source_kind
from gpu_agent.protocol import MAX_PROMPT_LOOKUP, MAX_SPECULATIVE_TOKENS, SpeculativeMethod, SpeculativeSpec

SPECULATIVE_FIELDS = (
    "speculative_method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "draft_model_source",
)


def spec_errors(values: dict, *, model_source: str, credential) -> dict[str, list[str]]:
    """Field errors of an endpoint's speculative settings (`values` holds each SPECULATIVE_FIELDS name)."""
    method = values["speculative_method"]
    errors: dict[str, list[str]] = {}
    if not 1 <= values["num_speculative_tokens"] <= MAX_SPECULATIVE_TOKENS:
        errors["num_speculative_tokens"] = [f"Must be between 1 and {MAX_SPECULATIVE_TOKENS}."]
    low, high = values["prompt_lookup_min"], values["prompt_lookup_max"]
    if not 1 <= high <= MAX_PROMPT_LOOKUP:
        errors["prompt_lookup_max"] = [f"Must be between 1 and {MAX_PROMPT_LOOKUP}."]
    if not 1 <= low <= high:
        errors["prompt_lookup_min"] = ["Must be between 1 and prompt_lookup_max."]
    draft = values["draft_model_source"]
    if method == SpeculativeMethod.DRAFT:
        if not draft:
            errors["draft_model_source"] = ["A draft model needs a source (hf:, s3:// or a local path)."]
        elif draft == model_source:
            errors["draft_model_source"] = ["The draft must be a smaller model than the endpoint's own."]
        elif credential is not None and source_kind(draft) not in (None, credential.kind):
            # NOTE: the draft is read with the endpoint's credential, which cannot read another kind of source.
            errors["draft_model_source"] = [
                f"The draft is read with the endpoint's credential ({CredentialKind(credential.kind).label}); "
                "put it where that credential reads."
            ]
    elif draft:
        errors["draft_model_source"] = ["Only a draft-model endpoint takes a draft source; set speculative_method to draft."]
    return errors


def speculative_spec(endpoint) -> SpeculativeSpec | None:
    """What a replica of `endpoint` is told (None: speculative decoding off)."""
    method = SpeculativeMethod(endpoint.speculative_method)
    if method == SpeculativeMethod.NONE:
        return None
    draft = endpoint.draft_model_source if method == SpeculativeMethod.DRAFT else ""
    fleet = bool(draft) and endpoint.credential_id is None and is_catalogue_source(draft)
    return SpeculativeSpec(
        method=method,
        num_speculative_tokens=endpoint.num_speculative_tokens,
        prompt_lookup_max=endpoint.prompt_lookup_max,
        prompt_lookup_min=endpoint.prompt_lookup_min,
        draft_source=draft,
        draft_use_fleet_credentials=fleet,
        draft_weights_scope="" if fleet else organization_scope(endpoint.organization_id),
    )
