"""The agent with a draft-model replica: it fetches the draft like the weights, starts the engine on
the cached copy, and fails the replica before any engine starts when the draft cannot be read or
has another vocabulary than the model."""

from __future__ import annotations

import json

from gpu_agent.protocol import ReplicaState, SpeculativeSpec
from gpu_agent.runtime.model_json import MAX_MODEL_JSON_BYTES
from gpu_agent.runtime.speculative import draft_problem

from .conftest import (
    make_spec,
    processes_with_marker,
    wait_until,
    with_peak_memory,
    write_json_of_empty_objects,
)
from .test_agent_loop import control_plane, running_agent  # noqa: F401  (fixtures)
from .test_weights_cache import s3, s3_endpoint  # noqa: F401  (fixtures)


def model_dir(path, vocab_size):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size}))
    return path


def draft_spec(replica_id, model, draft_source):
    return make_spec(replica_id, model_source=str(model), max_model_len=None,
                     speculative=SpeculativeSpec(method="draft", num_speculative_tokens=3, draft_source=draft_source))


def failure_of(plane, replica_id):
    return next(s for s in plane.heartbeats[-1].replicas if s.replica_id == replica_id).failure_reason


def test_a_draft_model_replica_runs_on_the_fetched_draft(control_plane, running_agent, tmp_path):  # noqa: F811
    model, draft = model_dir(tmp_path / "model", 1024), model_dir(tmp_path / "draft", 1024)
    control_plane.desired = [draft_spec("r-draft", model, str(draft))]
    agent, _stop, _thread = running_agent()
    # NOTE: a bound for a hang, not a speed check: the model's files are read in a child before the engine starts
    # (~4 s alone on this machine), and the whole suite on 2 loaded cores took past 15 s once.
    wait_until(lambda: control_plane.last_states().get("r-draft") == ReplicaState.READY, 60)
    replica = agent.supervisor.get("r-draft")
    assert replica.spec.speculative.draft_source == str(draft)


def test_a_draft_with_another_vocabulary_fails_the_replica_before_any_engine_starts(control_plane, running_agent, tmp_path):  # noqa: F811
    model, draft = model_dir(tmp_path / "model", 1024), model_dir(tmp_path / "draft", 32000)
    control_plane.desired = [draft_spec("r-vocab", model, str(draft))]
    agent, _stop, _thread = running_agent()
    wait_until(lambda: control_plane.last_states().get("r-vocab") == ReplicaState.FAILED, 15)
    assert "must share the model's tokenizer" in failure_of(control_plane, "r-vocab")
    assert agent.supervisor.get("r-vocab") is None and processes_with_marker("r-vocab") == []


def test_a_draft_that_cannot_be_fetched_fails_the_replica(control_plane, running_agent, tmp_path, s3):  # noqa: F811
    model = model_dir(tmp_path / "model", 1024)
    control_plane.desired = [draft_spec("r-nodraft", model, "s3://no-such-bucket/draft")]
    agent, _stop, _thread = running_agent()
    wait_until(lambda: control_plane.last_states().get("r-nodraft") == ReplicaState.FAILED, 15)
    assert "no-such-bucket" in failure_of(control_plane, "r-nodraft")
    assert agent.supervisor.get("r-nodraft") is None


def test_a_draft_config_past_the_size_cap_fails_the_check_unread(tmp_path):
    model = model_dir(tmp_path / "model", 1024)
    (tmp_path / "draft").mkdir()
    write_json_of_empty_objects(tmp_path / "draft" / "config.json",
                                {"architectures": ["LlamaForCausalLM"], "vocab_size": 1024})
    problem, peak = with_peak_memory(lambda: draft_problem(model, tmp_path / "draft"))
    assert problem == "the draft model's files cannot be served: its config.json is larger than 4 MiB"
    assert peak < MAX_MODEL_JSON_BYTES


def test_a_draft_whose_files_name_a_file_outside_its_folder_fails_the_check(tmp_path):
    # As a model's own (`model_info.refuse_paths_outside_model`): a draft is a tenant's files too, and its
    # modules.json or tokenizer_config.json could send the engine to another tenant's folder.
    model = model_dir(tmp_path / "model", 1024)
    draft = model_dir(tmp_path / "draft", 1024)
    (draft / "tokenizer_config.json").write_text(json.dumps({"fast_tokenizer_files": ["../victim/tokenizer.9.json"]}))
    problem = draft_problem(model, draft)
    assert problem.startswith("the draft model's files cannot be served: its tokenizer_config.json names a file "
                              "outside the model's folder"), problem
    (draft / "tokenizer_config.json").write_text(json.dumps({"fast_tokenizer_files": ["tokenizer.9.json"]}))
    assert draft_problem(model, draft) == ""
