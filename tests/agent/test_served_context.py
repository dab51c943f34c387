"""No engine serves more context than the control plane reserves and bills its calls by.

The gateway reserves, bounds and bills each call by `Endpoint.context_length`: the endpoint's `max_model_len`, else the
context the agent describes (`model_info.read_config_info`). Before, an endpoint that set none launched its engine
with no `--max-model-len`, and vLLM served what it derived itself from the tenant's files: 16,384 tokens for a config
the agent described as 2,048 (a RoPE "default" with a factor), so a 60k-token prompt was billed as about 2k.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading

import pytest

from gpu_agent.protocol import UNKNOWN_CONTEXT_TOKENS, ReplicaAction, ReplicaState
from gpu_agent.runtime.engine import build_engine_command, engine_context_length
from gpu_agent.runtime.engine_environment import engine_environment
from gpu_agent.runtime.model_info import read_config_info
from gpu_agent.runtime.reconciler import Reconciler
from gpu_agent.runtime.supervisor import Supervisor, SupervisorPolicy

from .conftest import fake_engine_factory, make_spec, processes_with_marker, wait_until

FAST = SupervisorPolicy(restart_backoff_s=0.2, max_consecutive_crashes=3, stop_timeout_s=2.0)


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.fixture
def stretched_model(tiny_model_dir, tmp_path):
    """The tiny model, its config stretched by a RoPE factor vLLM multiplies its 2,048 positions by."""
    model = tmp_path / "stretched"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "default", "factor": 8.0}
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_engine_is_launched_with_the_context_the_agent_describes_when_the_endpoint_sets_none(
        stretched_model, tmp_path, device):
    described = read_config_info(stretched_model).max_model_len
    assert described == 16384
    command = build_engine_command(make_spec(max_model_len=None), stretched_model, port=1, device=device)
    assert flag(command.argv, "--max-model-len") == "16384" and command.max_model_len == 16384
    # The endpoint's own limit, when it sets one; a model no agent can describe: what the control plane assumes.
    command = build_engine_command(make_spec(max_model_len=1024), stretched_model, port=1, device=device)
    assert flag(command.argv, "--max-model-len") == "1024" and command.max_model_len == 1024
    command = build_engine_command(make_spec(max_model_len=None), tmp_path / "no-config", port=1, device=device)
    assert flag(command.argv, "--max-model-len") == str(UNKNOWN_CONTEXT_TOKENS)


def test_no_engine_inherits_the_switch_that_lets_vllm_serve_past_what_it_derives():
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" not in engine_environment({"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    assert engine_environment({"VLLM_LOGGING_LEVEL": "INFO"})["VLLM_LOGGING_LEVEL"] == "INFO"


@pytest.mark.vllm
def test_vllm_refuses_a_context_past_what_it_derives_so_a_replica_fails_rather_than_serves_it(tiny_model_dir):
    """What an engine launched with more than vLLM derives does (the agent's description ahead of vLLM): it stops at
    its configuration, with the reason in its log, which the replica fails with."""
    from vllm.config import ModelConfig

    described = read_config_info(tiny_model_dir).max_model_len
    assert ModelConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=described).max_model_len == described
    with pytest.raises(ValueError, match="VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        ModelConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=described * 2)


@pytest.mark.parametrize(("served", "state"), [(4096, ReplicaState.FAILED), (512, ReplicaState.READY)])
def test_an_engine_serving_more_context_than_it_was_launched_with_fails_with_the_reason(tmp_path, served, state):
    supervisor = Supervisor(tmp_path / "agent", policy=FAST,
                            command_factory=fake_engine_factory("--served-context", str(served), max_model_len=512))
    try:
        supervisor.start(make_spec("r-context"), "/models/x")
        wait_until(lambda: supervisor.get("r-context").state in (ReplicaState.READY, ReplicaState.FAILED), 10,
                   poll=supervisor.poll)
        replica = supervisor.get("r-context")
        assert replica.state == state
        if state == ReplicaState.FAILED:
            assert "serves a context of 4096 tokens, more than the 512 its calls are billed by" in replica.failure_reason
            assert replica.num_restarts == 0  # failed at once: a restart would serve the same
    finally:
        supervisor.shutdown(timeout_s=1)


def test_an_engine_that_does_not_say_its_context_never_turns_ready(tmp_path):
    """One whose /v1/models answers without a context fails (one that does not answer in time stays STARTING, asked
    again at the next poll, until its start's timeout ends it)."""
    supervisor = Supervisor(tmp_path / "agent", policy=FAST, command_factory=fake_engine_factory(max_model_len=512))
    try:
        supervisor.start(make_spec("r-silent"), "/models/x")
        wait_until(lambda: supervisor.get("r-silent").state == ReplicaState.FAILED, 10, poll=supervisor.poll)
        assert "did not say the context it serves" in supervisor.get("r-silent").failure_reason
    finally:
        supervisor.shutdown(timeout_s=1)


def test_an_engine_healthy_but_never_saying_its_context_is_restarted_at_its_start_timeout(tmp_path):
    # Its /health answers, its /v1/models never does: each poll asked again and returned before the start's timeout
    # was looked at, so the agent held it STARTING (its GPU with it) for as long as the control plane let it.
    policy = dataclasses.replace(FAST, startup_timeout_s=2.0, health_timeout_s=0.5)
    supervisor = Supervisor(tmp_path / "agent", policy=policy,
                            command_factory=fake_engine_factory("--models-unanswered", max_model_len=512))
    try:
        supervisor.start(make_spec("r-hung"), "/models/x")
        wait_until(lambda: supervisor.get("r-hung").num_restarts >= 1, 20, poll=supervisor.poll)
        assert supervisor.get("r-hung").state != ReplicaState.READY
    finally:
        supervisor.shutdown(timeout_s=1)


@pytest.mark.parametrize(("served", "older_record", "desired_at", "state"), [
    (4096, False, "recover", ReplicaState.FAILED), (4096, True, "recover", ReplicaState.FAILED),
    (4096, True, "first heartbeat", ReplicaState.FAILED), (1024, False, "recover", ReplicaState.READY),
    (1024, True, "first heartbeat", ReplicaState.READY)])
def test_an_engine_adopted_by_a_restarted_agent_serving_more_than_its_calls_are_billed_by_fails_with_the_reason(
        tmp_path, served, older_record, desired_at, state):
    """A previous agent's engine, launched with `served` tokens, adopted where its calls are now billed by 1,024 (its
    desired spec's: handed to `recover`, or, as the agent does, with its first heartbeat's answer after adopting it
    by its recorded spec). Before, an adopted engine turned READY unchecked; an older agent's record (no launch
    figure: its engine may have had no --max-model-len) is checked alike."""
    data_dir = tmp_path / "agent"
    first = Supervisor(data_dir, policy=FAST, command_factory=fake_engine_factory(
        "--served-context", str(served), max_model_len=served))
    second = Supervisor(data_dir, policy=FAST, command_factory=fake_engine_factory())
    try:
        first.start(make_spec("r-adopted", max_model_len=None, billed_context_tokens=served), "/models/x")
        wait_until(lambda: first.get("r-adopted").state == ReplicaState.READY, 10, poll=first.poll)
        first._probe.close()  # the old agent vanishes without stopping its engine
        first._replicas.clear()
        if older_record:
            records = json.loads((data_dir / "replicas.json").read_text())
            records["r-adopted"].pop("max_model_len", None)
            (data_dir / "replicas.json").write_text(json.dumps(records))

        desired = make_spec("r-adopted", max_model_len=None, billed_context_tokens=1024)
        if desired_at == "recover":
            adopted, killed = second.recover({"r-adopted": desired})
        else:
            adopted, killed = second.recover(None)
            assert second.get("r-adopted").state == ReplicaState.READY  # as recorded: its calls billed by `served`
            second.check_adopted_context(dataclasses.replace(desired, action=ReplicaAction.DRAIN))
            assert second.get("r-adopted").state == ReplicaState.READY  # a draining one finishes its calls
            second.check_adopted_context(desired)

        replica = second.get("r-adopted")
        assert (adopted, killed, replica.state) == (["r-adopted"], [], state)
        if state == ReplicaState.FAILED:
            assert replica.failure_reason == (
                "its engine serves a context of 4096 tokens, more than the 1024 its calls are billed by")
            wait_until(lambda: processes_with_marker("r-adopted") == [], 5)
    finally:
        second.shutdown(timeout_s=1)
        first.shutdown(timeout_s=1)


def _adopted_with_late_answers(tmp_path, num_unanswered: int):
    """A previous agent's engine serving 4,096 tokens, adopted by its recorded spec; its first `num_unanswered` asks
    for the context it serves get no answer (a busy engine). Returns the new supervisor, the old, the asks made and
    the probe's own answer; the new supervisor launches as the agent does, its engines serving 1,024 tokens."""
    data_dir = tmp_path / "agent"
    first = Supervisor(data_dir, policy=FAST, command_factory=fake_engine_factory(
        "--served-context", "4096", max_model_len=4096))
    fake = fake_engine_factory("--served-context", "1024")

    def launched_as_the_agent_does(spec, model_path, port):  # with the context `build_engine_command` gives
        return dataclasses.replace(fake(spec, model_path, port), max_model_len=engine_context_length(spec, model_path))
    second = Supervisor(data_dir, policy=FAST, command_factory=launched_as_the_agent_does)
    first.start(make_spec("r-adopted", max_model_len=None, billed_context_tokens=4096), "/models/x")
    wait_until(lambda: first.get("r-adopted").state == ReplicaState.READY, 10, poll=first.poll)
    first._probe.close()  # the old agent vanishes without stopping its engine
    first._replicas.clear()
    second.recover(None)
    answer = second._probe.served_context
    asks = []

    def late_at_first(address, key):
        asks.append(address)
        return None if len(asks) <= num_unanswered else answer(address, key)
    second._probe.served_context = late_at_first
    return second, first, asks, answer


def test_an_adopted_engine_whose_first_context_check_gets_no_answer_is_asked_again(tmp_path):
    """Before, the figure believed replaced the launched one before the engine answered: the next desired spec found
    4,096 >= 1,024 "checked" and never asked again, so the engine served 4,096 tokens to calls billed by 1,024."""
    second, first, asks, _ = _adopted_with_late_answers(tmp_path, num_unanswered=1)
    try:
        desired = make_spec("r-adopted", max_model_len=None, billed_context_tokens=1024)
        second.check_adopted_context(desired)  # first heartbeat's answer: no answer in time
        assert second.get("r-adopted").state == ReplicaState.READY
        second.check_adopted_context(desired)
        assert len(asks) == 2
        assert second.get("r-adopted").failure_reason == (
            "its engine serves a context of 4096 tokens, more than the 1024 its calls are billed by")
    finally:
        second.shutdown(timeout_s=1)
        first.shutdown(timeout_s=1)


def test_an_adopted_engine_that_never_says_its_context_is_restarted_with_the_figure_billed(tmp_path):
    """Asked once per desired spec, an engine that never answers is killed as unhealthy after
    `max_unanswered_context_checks` asks and launched again, as after a crash, with the context its calls are billed by."""
    second, first, asks, answer = _adopted_with_late_answers(tmp_path, num_unanswered=10**6)
    try:
        desired = make_spec("r-adopted", max_model_len=None, billed_context_tokens=1024)
        old_pid = second.get("r-adopted").pid
        for _ in range(FAST.max_unanswered_context_checks):
            assert second.get("r-adopted").pid == old_pid
            second.check_adopted_context(desired)
        second.check_adopted_context(desired)  # no longer asked: it is restarting
        assert len(asks) == FAST.max_unanswered_context_checks
        second._probe.served_context = answer  # the new engine answers
        wait_until(lambda: second.get("r-adopted").state == ReplicaState.READY and second.get("r-adopted").pid != old_pid,
                   10, poll=second.poll)
        replica = second.get("r-adopted")
        assert (replica.num_restarts, replica.command.max_model_len) == (1, 1024)
    finally:
        second.shutdown(timeout_s=1)
        first.shutdown(timeout_s=1)


@pytest.mark.parametrize(("billed_now", "state"), [(1024, ReplicaState.STOPPED), (4096, ReplicaState.READY),
                                                   (None, ReplicaState.READY)])
def test_a_running_engine_whose_billed_context_drops_below_its_launch_is_drained_to_be_replaced(
        tmp_path, billed_now, state):
    """A replica launched with 4,096 tokens whose desired spec now bills its calls by `billed_now` (the control plane
    replaced a disputed catalogue context). Before, no running engine took a figure that dropped: it served 4,096
    tokens to calls billed by 1,024 until it stopped. Now it drains (its calls finish; the control plane places
    another, launched with the figure, once it is STOPPED); its restarts take the figure either way."""
    fake = fake_engine_factory("--served-context", "4096")

    def launched_as_the_agent_does(spec, model_path, port):
        return dataclasses.replace(fake(spec, model_path, port), max_model_len=engine_context_length(spec, model_path))
    supervisor = Supervisor(tmp_path / "agent", policy=FAST, command_factory=launched_as_the_agent_does)
    reconciler = Reconciler(supervisor, weights=None, wake=threading.Event())
    try:
        spec = make_spec("r-run", max_model_len=None, billed_context_tokens=4096)
        supervisor.start(spec, "/models/x")
        wait_until(lambda: supervisor.get("r-run").state == ReplicaState.READY, 10, poll=supervisor.poll)
        reconciler.reconcile([dataclasses.replace(spec, billed_context_tokens=billed_now)])
        wait_until(lambda: supervisor.get("r-run").state == state, 10, poll=supervisor.poll)
        assert supervisor.get("r-run").spec.billed_context_tokens == billed_now
        if state == ReplicaState.STOPPED:
            wait_until(lambda: processes_with_marker("r-run") == [], 5)
    finally:
        supervisor.shutdown(timeout_s=1)


@pytest.mark.vllm
@pytest.mark.parametrize(("billed", "served"), [(None, 1024), (512, 512)])
def test_a_real_engine_serves_the_context_described_not_the_one_vllm_would_derive(engine_node, tiny_model_dir,
                                                                                    tmp_path, billed, served):
    """A model of absolute positions whose tokenizer allows 1,024 of its 2,048: described as 1,024 (vLLM's bound on
    its pooling runner, taken by the agent for any such model), which a generating vLLM left to itself would not
    apply. Launched with the figure, the engine serves 1,024, the context its calls are billed by; or 512 where the
    control plane bills by 512 (a catalogue copy another node described first with less)."""
    import httpx

    from tests.engines import serve_engine, tiny_model_copy

    model = tiny_model_copy(tiny_model_dir, tmp_path, {"config.json": {"position_embedding_type": "absolute"},
                                                       "tokenizer_config.json": {"model_max_length": 1024}})
    assert read_config_info(model).max_model_len == 1024
    spec = make_spec("r-described", model_source=str(model), max_model_len=None, max_num_seqs=4,
                     billed_context_tokens=billed)
    with serve_engine(engine_node, spec, model) as replica:
        listed = httpx.get(f"{replica.address}/v1/models", timeout=30,
                           headers={"Authorization": f"Bearer {spec.engine_api_key}"}).json()["data"]
        assert [card["max_model_len"] for card in listed] == [served]
        assert flag(replica.command.argv, "--max-model-len") == str(served)
