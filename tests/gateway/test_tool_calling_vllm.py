"""Tool calling through the gateway with the official `openai` client, on a real vLLM engine.

The tiny model's chat template renders tools as Hermes does; the engine runs with the `hermes`
tool-call parser, as an endpoint with `tool_call_parser="hermes"` gets it from its replica spec.
Random weights never call a tool by themselves, so `tool_choice="auto"` shows that the engine
accepts tools (without `--enable-auto-tool-choice` vLLM answers 400), and a named tool choice
(structured output forces a valid call) shows a call parsed into the client's objects.
The package's shared engine (`vllm_engine`) serves the module: the agent's supervisor starts it from
a spec with `tool_call_parser="hermes"`.
"""

from __future__ import annotations

import json

import pytest

from tests.gateway.conftest import ENGINE_KEY, ENGINE_NAME, serve_endpoint

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

NAME = ENGINE_NAME
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        # Strict: the engine holds the arguments to the schema (else only the call's envelope).
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def tools_endpoint(tenant, vllm_engine):
    return serve_endpoint(tenant.org, vllm_engine, name=NAME, tool_call_parser="hermes", engine_key=ENGINE_KEY)


def test_tools_with_tool_choice_auto_are_answered(gateway, tenant, tools_endpoint):
    chat = tenant.client(gateway).chat.completions.create(
        model=NAME, messages=MESSAGES, tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=8, temperature=0,
    )
    assert chat.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert chat.usage.prompt_tokens > 0


def whitespace_token_ids(model_dir) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [i for i in range(tokenizer.get_vocab_size()) if (text := tokenizer.decode([i])) and not text.strip()]


def test_a_named_tool_choice_returns_a_tool_call_the_client_parses(gateway, tenant, tools_endpoint, tiny_model_dir):
    # NOTE: the grammar allows whitespace inside the JSON, which random weights would repeat until
    # max_tokens; a bias against whitespace tokens lets the forced call complete.
    chat = tenant.client(gateway).chat.completions.create(
        # The tiny vocabulary spells the call nearly a character per token.
        model=NAME, messages=MESSAGES, tools=[WEATHER_TOOL], max_tokens=256, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        logit_bias={str(i): -100 for i in whitespace_token_ids(tiny_model_dir)},
    )
    calls = chat.choices[0].message.tool_calls
    assert calls and calls[0].type == "function" and calls[0].function.name == "get_weather"
    assert calls[0].id
    assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Oslo")
