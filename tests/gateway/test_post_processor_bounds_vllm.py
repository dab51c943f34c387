"""A tenant's tokenizer whose post-processor lengthens every prompt is bounded by what a real vLLM engine counts.

A post-processor (tokenizer.json's `post_processor`) runs after the model splits the text: `TemplateProcessing`'s
`single` lays out one sequence's tokens, special tokens and the text itself (`$A`). `tokenizers` takes `$A` as many
times as the template names it, and does so even when no special tokens are asked for (chat prompts, which vLLM
tokenizes with `add_special_tokens` false). And a chat may ask for the special tokens (vLLM's `add_special_tokens`):
a tenant's 500 of them were added to the rendered conversation, which the chat bound never counted.

Each model is a copy of the tiny model with that post-processor; the engine's `/tokenize` counts, and the gateway's
bound comes from what the agent reports of the same folder (`read_model`). A prompt past the context is refused by
the engine, so a bound of the context bounds whatever it would accept: `min(count, CONTEXT)`.
"""

from __future__ import annotations

import json

import httpx
import pytest

from endpoints.gateway.estimate import worst_case
from endpoints.gateway.normalizers import prompt_normalizer
from gpu_agent.runtime.model_info import read_model
from tests.engines import serve_small_engine, tiny_model_copy

pytestmark = [pytest.mark.vllm]

KEY, CONTEXT = "key-of-the-post-processors", 2048
BOS = {"SpecialToken": {"id": "<s>", "type_id": 0}}
TEXT = {"Sequence": {"id": "A", "type_id": 0}}
MODELS = {
    "its text twenty times": [BOS] + [TEXT] * 20,
    "500 special tokens": [BOS] * 500 + [TEXT],
}
WORDS = "hello world " * 10


def _with_single(single):
    def change(model_dir):
        path = model_dir / "tokenizer.json"
        tokenizer = json.loads(path.read_text())
        tokenizer["post_processor"] = tokenizer["post_processor"] | {"single": single}
        path.write_text(json.dumps(tokenizer))

    return change


@pytest.fixture(scope="module", params=list(MODELS))
def post_processing_engine(request, engine_node, tiny_model_dir, tmp_path_factory):
    name = request.param
    model_dir = tiny_model_copy(tiny_model_dir, tmp_path_factory.mktemp("post-processor"))
    _with_single(MODELS[name])(model_dir)
    served = "post-" + "-".join(name.split())
    with serve_small_engine(engine_node, served, model_dir, KEY, CONTEXT) as address:
        yield name, served, model_dir, address


REQUESTS = {
    "a chat": ("chat", {"messages": [{"role": "user", "content": WORDS}]}),
    "a chat asking for special tokens": (
        "chat",
        {"messages": [{"role": "user", "content": WORDS}], "add_special_tokens": True},
    ),
    "a completions prompt": ("completion", {"prompt": WORDS}),
}


def _engine_count(address: str, served: str, kind: str, fields: dict) -> int:
    body = {"model": served, **fields}
    if kind == "chat":
        body["add_generation_prompt"] = True
    answer = httpx.post(
        f"{address}/tokenize", headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=60
    )
    answer.raise_for_status()
    return answer.json()["count"]


@pytest.mark.parametrize("request_name", list(REQUESTS))
def test_a_post_processors_prompts_are_bounded_by_what_the_engine_counts(
    post_processing_engine, request_name
):
    name, served, model_dir, address = post_processing_engine
    kind, fields = REQUESTS[request_name]
    normalizer = prompt_normalizer(read_model(model_dir).info.tokenizer_normalizer.to_dict())

    counted = _engine_count(address, served, kind, fields)
    bound = worst_case({"model": served, "max_tokens": 1, **fields}, kind, CONTEXT, normalizer=normalizer)

    assert bound.num_prompt_tokens >= min(counted, CONTEXT), (
        f"{name}, {request_name}: vLLM {counted} > bound {bound.num_prompt_tokens}"
    )
