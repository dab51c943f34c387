"""vLLM's sampling lists are capped at the gateway, as `stop` is: a 400 in OpenAI's shape naming the field.

Before, `bad_words`, `stop_token_ids` and `allowed_token_ids` went to the engine at any length the body's bounds let
through (hundreds of thousands of items), and `logit_bias` with any number of tokens: every bad word is tokenized and
then checked against the output at every step, and vLLM's V2 model runner raises in its worker past 1,024 allowed
token ids or logit_bias entries and past 128 stop token ids.
"""

import json

import pytest

from endpoints.gateway.errors import OpenAIError
from endpoints.gateway.request import parse_payload

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def _parse(payload: dict, kind: str) -> dict:
    return parse_payload(json.dumps(payload).encode(), kind)


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(
    ("field", "at_limit", "past_limit"),
    [
        ("bad_words", ["w"] * 64, ["w"] * 65),
        ("stop_token_ids", [2] * 64, [2] * 65),
        ("allowed_token_ids", list(range(1024)), list(range(1025))),
        ("logit_bias", {str(token): 1 for token in range(1024)}, {str(token): 1 for token in range(1025)}),
    ],
)
def test_a_sampling_list_past_its_cap_is_a_400_naming_it(kind, field, at_limit, past_limit):
    body = CHAT if kind == "chat" else COMPLETION
    assert _parse(body | {field: at_limit}, kind)[field] == at_limit
    with pytest.raises(OpenAIError) as refused:
        _parse(body | {field: past_limit}, kind)
    assert refused.value.status == 400 and refused.value.param == field
    assert refused.value.message.startswith(f"Invalid value for '{field}': expected at most ")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("bad_words", "word"),
        ("bad_words", ["w", 7]),
        ("stop_token_ids", [2, "3"]),
        ("stop_token_ids", [-1]),
        ("allowed_token_ids", {"1": 1}),
    ],
)
def test_a_sampling_list_of_the_wrong_type_is_a_400_naming_it(field, value):
    with pytest.raises(OpenAIError) as refused:
        _parse(CHAT | {field: value}, "chat")
    assert refused.value.status == 400 and refused.value.param == field
