"""`/v1/embeddings`: what the gateway checks of an embeddings call, and which endpoints serve one.

An embeddings call goes the way of a chat call (`endpoints.gateway.call`: auth, admission, the
reservation, one usage row, settlement); only its body and its task differ, and both are here:

- `check_payload`: OpenAI's shapes and limits, a 400 in OpenAI's shape naming the parameter:
  `input` a non-empty string, an array of at most `MAX_INPUTS` non-empty strings, an array of
  token ids (one input, however long), or an array of at most `MAX_INPUTS` non-empty arrays of
  token ids; `encoding_format` "float" or "base64"; `dimensions` a positive integer. Whether the
  model can shorten its vectors to `dimensions` (Matryoshka) only its engine knows: its refusal is
  relayed naming `dimensions` (`engine_refusal`).
- `refuse_wrong_task`: an embedding endpoint serves no chat or completions, a generating one no
  embeddings (an engine runs one runner); a clear 400 either way, before anything is reserved.

Metering: an embedding has input tokens only, billed at the endpoint's input price
(`price_input_per_million`); the engine's `usage.prompt_tokens` is what the usage row records.
"""

from __future__ import annotations

from endpoints.gateway import errors
from endpoints.gateway.token_ids import are_token_ids, is_int

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
ENCODING_FORMATS = frozenset({"float", "base64"})
EMBEDDING = "embedding"  # the request kind (`endpoints.gateway.request.KINDS`)
EMBED_TASK = "embed"  # `protocol.ModelTask.EMBED` (the gateway reads the endpoint's value as a string)
GENERATE_TASK = "generate"


def check_payload(payload: dict) -> None:
    """The 400 that refuses an embeddings body, if any (which fields it may carry: `endpoints.gateway.fields`)."""
    _check_input(payload.get("input"))
    encoding = payload.get("encoding_format")
    if encoding is not None and (not isinstance(encoding, str) or encoding not in ENCODING_FORMATS):  # a list: unhashable
        raise errors.invalid_request(
            f"Invalid value for 'encoding_format': expected one of {', '.join(sorted(ENCODING_FORMATS))}.",
            param="encoding_format", code="invalid_value")
    dimensions = payload.get("dimensions")
    if dimensions is not None and (not is_int(dimensions) or dimensions < 1):
        raise errors.invalid_request("Invalid value for 'dimensions': expected a positive integer.",
                                     param="dimensions", code="invalid_value")
    if payload.get("user") is not None and not isinstance(payload["user"], str):
        raise errors.invalid_request("Invalid type for 'user': expected a string.", param="user", code="invalid_type")


def _check_input(value) -> None:
    if value is None:
        raise errors.invalid_request("You must provide an input parameter.", param="input")
    if isinstance(value, str):
        if not value:
            raise _invalid_input("'input' must not be an empty string.")
        return
    if not isinstance(value, list) or not value:
        raise _invalid_input("'input' must be a non-empty string or array.")
    # NOTE: a flat array of token ids is one input, as a string is: its length is the engine's to judge (OpenAI takes
    # 8191 tokens an input), not a count of inputs.
    if len(value) > MAX_INPUTS and not are_token_ids(value):
        raise _invalid_input(f"'input' has {len(value)} items; at most {MAX_INPUTS} may be embedded in one request.")
    if all(isinstance(item, str) for item in value):
        if not all(value):
            raise _invalid_input("'input' must not contain empty strings.")
        return
    if are_token_ids(value):
        return
    if all(isinstance(item, list) and item and are_token_ids(item) for item in value):
        return
    raise errors.invalid_request(
        "Invalid type for 'input': expected a string, an array of strings, an array of token ids or an array "
        "of non-empty arrays of token ids.", param="input", code="invalid_type")


def _invalid_input(message: str) -> errors.OpenAIError:
    return errors.invalid_request(message, param="input", code="invalid_value")


def refuse_wrong_task(kind: str, endpoint) -> None:
    """A 400 when `endpoint` cannot serve a call of `kind`; "" (a task not known yet) lets the engine judge."""
    refusal = wrong_task(kind, endpoint.task, endpoint.name)
    if refusal is not None:
        raise refusal


def wrong_task(kind: str, task: str, name: str) -> errors.OpenAIError | None:
    """The 400 refusing a call of `kind` to the endpoint `name` serving `task` (`Endpoint.serving_task`), if any:
    the gateway's, and a batch's whose `endpoint` asks what its lines' model does not serve."""
    if kind == EMBEDDING and task == GENERATE_TASK:
        return errors.invalid_request(
            f"The model '{name}' generates text and serves no embeddings; call /v1/chat/completions "
            "or /v1/completions, or deploy an embedding model (task \"embed\").", param="model",
            code="model_not_embedding")
    if kind != EMBEDDING and task == EMBED_TASK:
        return errors.invalid_request(
            f"The model '{name}' is an embedding model; call /v1/embeddings.", param="model",
            code="model_is_embedding")
    return None


def engine_refusal(status: int, body: bytes, payload: dict) -> errors.OpenAIError:
    """The engine's 4xx in OpenAI's shape; a refused `dimensions` (a model without Matryoshka
    representations, or a size it does not offer) names the parameter, as OpenAI does."""
    refusal = errors.engine_refused(status, body, prompt_param="input")
    if refusal.param is None and payload.get("dimensions") is not None and "dimensions" in refusal.message:
        refusal.param = "dimensions"
    return refusal
