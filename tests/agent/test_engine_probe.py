"""`EngineProbe.chat_template_tokens`: what a model's chat template adds, from the engine's `/tokenize`.

Against a stand-in for the engine's HTTP API (the real engine: `test_vllm_replica.py`)."""

from __future__ import annotations

import json

import httpx
import pytest

from gpu_agent.protocol import ChatTemplateTokens, ReplicaState, ReplicaStatus
from gpu_agent.runtime.probes import EngineProbe

# A template that renders 40 tokens of its own around a conversation, 3 around a user's or system message and 7
# around an assistant's.
PREAMBLE, PER_MESSAGE, PER_ASSISTANT = 40, 3, 7


def probe_with(answer) -> EngineProbe:
    probe = EngineProbe(timeout_s=1)
    probe._http = httpx.Client(transport=httpx.MockTransport(answer))
    return probe


def template(request: httpx.Request) -> httpx.Response:
    assert request.url.path == "/tokenize" and request.headers["authorization"] == "Bearer key"
    body = json.loads(request.content)
    assert body["model"] == "m" and body["add_generation_prompt"] is True
    assert all(message["content"] == "" for message in body["messages"])
    return httpx.Response(200, json={"count": _rendered(body["messages"]), "max_model_len": 2048})


def flags_alike(per_conversation: int, per_message: int) -> ChatTemplateTokens:
    """A measure of a template no flag changes (these stand-ins ignore `chat_template_kwargs`)."""
    return ChatTemplateTokens(per_conversation, per_message, flagged_per_conversation=per_conversation,
                              flagged_per_message=per_message)


def _rendered(messages, preamble=PREAMBLE) -> int:
    return preamble + sum(PER_ASSISTANT if message["role"] == "assistant" else PER_MESSAGE for message in messages)


def test_the_template_is_counted_per_conversation_and_per_message_of_the_costliest_role():
    measured = probe_with(template).chat_template_tokens("http://engine", "key", "m")
    assert measured == flags_alike(PREAMBLE + PER_MESSAGE, PER_ASSISTANT)


def test_a_template_that_refuses_a_system_role_is_measured_from_the_other_probes():
    def no_system(request):
        if any(message["role"] == "system" for message in json.loads(request.content)["messages"]):
            return httpx.Response(400, json={"error": {"message": "System role not supported"}})
        return template(request)

    measured = probe_with(no_system).chat_template_tokens("http://engine", "key", "m")
    assert measured == flags_alike(PREAMBLE + PER_MESSAGE, PER_ASSISTANT)


def test_a_template_that_refuses_to_end_with_the_assistant_bounds_a_message_by_a_user_and_assistant_pair():
    def no_trailing_assistant(request):
        if json.loads(request.content)["messages"][-1]["role"] == "assistant":
            return httpx.Response(400, json={"error": {"message": "the last message must be the user's"}})
        return template(request)

    measured = probe_with(no_trailing_assistant).chat_template_tokens("http://engine", "key", "m")
    assert measured == flags_alike(PREAMBLE + PER_MESSAGE, PER_ASSISTANT + PER_MESSAGE)


def test_a_default_system_prompt_dropped_when_one_is_given_never_makes_a_message_count_below_zero():
    def default_system_prompt(request):
        messages = json.loads(request.content)["messages"]
        preamble = 5 if messages[0]["role"] == "system" else 300  # the default is used only without a system message
        return httpx.Response(200, json={"count": _rendered(messages, preamble)})

    measured = probe_with(default_system_prompt).chat_template_tokens("http://engine", "key", "m")
    assert measured == flags_alike(300 + PER_MESSAGE, PER_ASSISTANT)


@pytest.mark.parametrize("answer", [
    httpx.Response(404, json={"detail": "Not Found"}),
    httpx.Response(400, json={"error": {"message": "this model has no chat template"}}),
    httpx.Response(200, content=b"not json"),
    httpx.Response(200, json=["count", 5]),
    httpx.Response(200, json={"count": -1}),
    httpx.Response(200, json={"count": True}),
], ids=["no-route", "no-template", "not-json", "not-an-object", "negative", "a-bool"])
def test_an_engine_that_cannot_say_is_not_measured(answer):
    assert probe_with(lambda request: answer).chat_template_tokens("http://engine", "key", "m") is None


def test_a_report_of_the_template_is_clamped_and_checked():
    status = ReplicaStatus.from_dict({"replica_id": "r", "state": "READY",
                                      "chat_template_tokens": {"per_conversation": 2**40, "per_message": -3}})
    assert status.state == ReplicaState.READY
    assert status.chat_template_tokens == ChatTemplateTokens(per_conversation=2**31 - 1, per_message=0)
    assert status.chat_template_tokens.model_source == ""  # an agent that does not say which copy: never kept
    with pytest.raises(ValueError, match="per_conversation: must be an integer"):
        ReplicaStatus.from_dict({"replica_id": "r", "state": "READY", "chat_template_tokens": {"per_conversation": "9"}})
    assert ReplicaStatus.from_dict({"replica_id": "r", "state": "READY"}).chat_template_tokens is None


@pytest.mark.parametrize("answered", [0, 1, 3])
def test_an_engine_that_stops_answering_in_time_ends_the_measure_with_what_it_counted(answered):
    calls = []

    def slow_after(request):
        calls.append(request)
        if len(calls) > answered:
            raise httpx.ReadTimeout("timed out", request=request)
        return template(request)

    measured = probe_with(slow_after).chat_template_tokens("http://engine", "key", "m")
    assert len(calls) == answered + 1 + (answered > 0)  # then the first flagged count, unanswered too
    expected = {0: None, 1: ChatTemplateTokens(PREAMBLE + PER_MESSAGE, 0),
                3: ChatTemplateTokens(PREAMBLE + PER_MESSAGE, PER_ASSISTANT)}
    assert measured == expected[answered]


def test_a_flag_that_switches_on_a_long_block_is_measured_with_it():
    # Granite's `thinking: true` adds ~600 tokens of system prompt to every conversation; a reasoning effort reaches
    # the template as `enable_thinking` too. A variant the engine refuses is left out, as requests with it are.
    def flagged_template(request):
        body = json.loads(request.content)
        kwargs = body.get("chat_template_kwargs") or {}
        if kwargs.get("reasoning_effort") == "max":
            return httpx.Response(400, json={"error": {"message": "reasoning_effort='max' is not supported"}})
        extra = 600 if kwargs.get("thinking") else 0
        extra += 2 * len(body["messages"]) if kwargs.get("enable_thinking") else 0
        return httpx.Response(200, json={"count": _rendered(body["messages"]) + extra})

    measured = probe_with(flagged_template).chat_template_tokens("http://engine", "key", "m")
    assert (measured.per_conversation, measured.per_message) == (PREAMBLE + PER_MESSAGE, PER_ASSISTANT)
    assert measured.flagged_per_conversation == PREAMBLE + PER_MESSAGE + 600 + 2
    assert measured.flagged_per_message == PER_ASSISTANT + 2


def test_flags_an_engine_stops_answering_for_are_left_unmeasured():
    def plain_only(request):
        if "chat_template_kwargs" in json.loads(request.content):
            raise httpx.ReadTimeout("timed out", request=request)
        return template(request)

    measured = probe_with(plain_only).chat_template_tokens("http://engine", "key", "m")
    assert measured == ChatTemplateTokens(PREAMBLE + PER_MESSAGE, PER_ASSISTANT)
    assert measured.flagged_per_conversation is None
