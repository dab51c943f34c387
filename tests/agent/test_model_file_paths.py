"""A model whose own files send its engine to read files outside its folder is refused before its engine starts.

vLLM joins a sentence-transformers module's `path` (modules.json) to the model's folder and reads that module's
config.json and model.safetensors: `"../<another tenant's folder>/2_Dense"` or an absolute path loaded another
tenant's cached tensor into this tenant's projection layer, readable through /v1/embeddings.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from gpu_agent.protocol import ModelTask, ReplicaState
from gpu_agent.runtime.model_info import read_model

from .conftest import bytes_read_by_this_process, make_spec, processes_with_marker
from .test_agent_loop import control_plane, running_agent  # noqa: F401  (fixtures)
from .test_weights_agent import reported
from .test_weights_cache import s3, s3_endpoint  # noqa: F401  (fixtures)

TRANSFORMER = "sentence_transformers.models.Transformer"
POOLING = "sentence_transformers.models.Pooling"
DENSE = "sentence_transformers.models.Dense"
SERVED_NOT = "the model's files cannot be served:"
REFUSED = f"{SERVED_NOT} its modules.json names a file outside the model's folder"


def write_dense(folder: Path, seed: int) -> object:
    """A sentence-transformers Dense layer (8 to 4 features) in `folder`; its weight tensor."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    weight = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    save_file({"linear.weight": weight}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"in_features": 8, "out_features": 4, "bias": False}))
    return weight


def write_modules(model: Path, *modules: tuple[str, str], wrapped: bool = False) -> None:
    """A modules.json of a Transformer at the folder's root, then `modules` as (type, path)."""
    entries = [{"idx": 0, "name": "0", "path": "", "type": TRANSFORMER}] + [
        {"idx": idx, "name": str(idx), "path": path, "type": kind}
        for idx, (kind, path) in enumerate(modules, 1)
    ]
    (model / "modules.json").write_text(json.dumps({"modules": entries} if wrapped else entries))


def st_projector(model: Path):
    """The projection layers vLLM's engine builds from the model's Dense modules (`adapters._load_st_projector`)."""
    from types import SimpleNamespace

    import torch
    from vllm.model_executor.models.adapters import _load_st_projector
    from vllm.transformers_utils.config import try_get_dense_modules

    try_get_dense_modules.cache_clear()
    return _load_st_projector(SimpleNamespace(model=str(model), revision=None, head_dtype=torch.float32))


@pytest.fixture
def node_weights(tiny_embedding_model_dir, tmp_path) -> dict:
    """Two tenants' cached models side by side, as in a node's weights folder: the victim's has a Dense layer."""
    weights = tmp_path / "weights"
    victim = shutil.copytree(tiny_embedding_model_dir, weights / "b0c1d2-victim-cache-key")
    victim_weight = write_dense(victim / "2_Dense", seed=1)
    (victim / "1_Pooling").mkdir()
    (victim / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    attacker = shutil.copytree(tiny_embedding_model_dir, weights / "a9f8-attacker-cache-key")
    return {"victim": victim, "attacker": attacker, "victim_weight": victim_weight}


def test_a_sentence_transformers_layout_inside_its_folder_is_read_and_vllm_loads_its_own_dense_layer(
    node_weights,
):
    import torch

    model = node_weights["attacker"]
    own_weight = write_dense(model / "2_Dense", seed=2)
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    write_modules(model, (POOLING, "1_Pooling"), (DENSE, "2_Dense"))
    reading = read_model(model)
    assert reading.problem == "" and reading.info.architecture == "LlamaModel"
    assert torch.equal(st_projector(model)[0].weight.data, own_weight)


@pytest.mark.parametrize(
    "layout",
    ["a relative path up", "an absolute path", "an object of modules", "a pooling folder up", "a link out"],
)
def test_a_module_path_that_leads_out_of_the_models_folder_is_refused_with_a_reason(node_weights, layout):
    model, victim = node_weights["attacker"], node_weights["victim"]
    if layout == "a relative path up":
        write_modules(model, (POOLING, "1_Pooling"), (DENSE, f"../{victim.name}/2_Dense"))
    elif layout == "an absolute path":
        write_modules(model, (POOLING, "1_Pooling"), (DENSE, str(victim / "2_Dense")))
    elif layout == "an object of modules":
        write_modules(model, (DENSE, f"../{victim.name}/2_Dense"), wrapped=True)
    elif layout == "a pooling folder up":
        write_modules(model, (POOLING, f"../{victim.name}/1_Pooling"))
    else:
        os.symlink(victim / "2_Dense", model / "2_Dense")
        write_modules(model, (POOLING, "1_Pooling"), (DENSE, "2_Dense"))
    reading = read_model(model)
    assert reading.info is None and reading.problem.startswith(REFUSED)
    if layout in ("a relative path up", "an absolute path", "a link out"):
        import torch

        # What the engine would have served: the other tenant's tensor as this tenant's projection layer.
        assert torch.equal(st_projector(model)[0].weight.data, node_weights["victim_weight"])


def test_a_pooling_module_without_a_folder_is_refused_since_vllm_would_read_the_nodes_root(node_weights):
    # vLLM reads `f"{path}/config.json"` of the Pooling module: "/config.json".
    write_modules(node_weights["attacker"], (POOLING, ""))
    reading = read_model(node_weights["attacker"])
    assert reading.problem == f"{SERVED_NOT} its modules.json gives its Pooling module no folder (path)"


def test_versioned_tokenizer_files_outside_the_folder_are_refused(node_weights):
    # transformers loads the newest of `fast_tokenizer_files` in place of tokenizer.json, joined to the folder.
    model, victim = node_weights["attacker"], node_weights["victim"]
    shutil.copy(victim / "tokenizer.json", victim / "tokenizer.4.0.json")
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config["fast_tokenizer_files"] = [f"../{victim.name}/tokenizer.4.0.json"]
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert read_model(model).problem.startswith(
        f"{SERVED_NOT} its tokenizer_config.json names a file outside the model's folder"
    )
    tokenizer_config["fast_tokenizer_files"] = ["tokenizer.4.0.json"]
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert read_model(model).problem == ""


def test_an_embedding_model_reading_another_tenants_dense_layer_fails_its_replica_before_launch(
    control_plane,  # noqa: F811
    running_agent,  # noqa: F811
    node_weights,
):
    model, victim = node_weights["attacker"], node_weights["victim"]
    write_modules(model, (POOLING, "1_Pooling"), (DENSE, f"../{victim.name}/2_Dense"))
    control_plane.desired = [
        make_spec("r-st-paths", model_source=str(model), task=ModelTask.EMBED, max_model_len=None)
    ]
    running_agent()
    status = reported(control_plane, "r-st-paths", ReplicaState.FAILED)
    assert status.failure_permanent and status.failure_reason.startswith(REFUSED)
    assert f"../{victim.name}/2_Dense" in status.failure_reason
    assert processes_with_marker("r-st-paths") == []


def _llama(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    return folder


@pytest.mark.parametrize("files", [
    {"processor_config.json": {"audio_tokenizer": {"audio_tokenizer_class": "AutoModel",
                                                   "audio_tokenizer_name_or_path": "/data/weights/victim"}}},
    {"processor_config.json": {"audio_tokenizer": {"audio_tokenizer_class": "AutoConfig",
                                                   "audio_tokenizer_name_or_path": "audio"}}},
    {"audio_tokenizer_config.json": {"audio_tokenizer_class": "AutoModel", "audio_tokenizer_name_or_path": "../victim"}},
], ids=["processor-absolute", "processor-relative", "audio-tokenizer-file"])
def test_an_audio_tokenizer_a_processor_would_load_from_elsewhere_is_refused(tmp_path, files):
    # transformers' processors load an audio tokenizer from `audio_tokenizer_name_or_path` with whatever class the
    # file names (AutoModel: any model's weights), resolved against the engine's working folder, not the model's
    # (found by the review of this stop's last merges).
    model = _llama(tmp_path / "model")
    for name, content in files.items():
        (model / name).write_text(json.dumps(content))
    problem = read_model(model).problem
    assert problem is not None and "audio tokenizer" in problem, problem


def test_a_tokenizer_config_past_the_size_cap_is_refused_only_if_it_names_tokenizer_files(tmp_path):
    # A tokenizer_config.json grows with its added tokens (some are megabytes): one past the cap that names no
    # versioned tokenizer file leads nowhere and is served; one that does is refused unread.
    model = _llama(tmp_path / "model")
    tokens = {str(n): {"content": f"<tok{n:07d}>" + "x" * 40, "special": True} for n in range(80_000)}
    (model / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": tokens}))
    assert (model / "tokenizer_config.json").stat().st_size > 4 * 1024 * 1024
    assert not read_model(model).problem

    other = _llama(tmp_path / "other")
    (other / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": tokens,
                                                             "fast_tokenizer_files": ["tokenizer.9.json"]}))
    problem = read_model(other).problem
    assert problem is not None and "tokenizer_config.json" in problem, problem


def test_a_tokenizer_config_past_the_size_cap_naming_tokenizer_files_under_an_escaped_key_is_refused(node_weights):
    # JSON may escape any character of a key, and transformers' `json.load` decodes `"fast\u005ftokenizer_files"` to
    # the field: a scan of the bytes for the field's name missed it, and another tenant's tokenizer was loaded.
    model, victim = node_weights["attacker"], node_weights["victim"]
    config = json.dumps(json.loads((model / "tokenizer_config.json").read_text()))
    named = r'"fast\u005ftokenizer_files": ["../' + victim.name + '/tokenizer.json"]'
    (model / "tokenizer_config.json").write_text(config[:-1] + f', {named}, "padding": "{"a" * 5 * 1024**2}"}}')
    problem = read_model(model).problem
    assert problem is not None and "tokenizer_config.json" in problem, problem


def test_a_tokenizer_config_past_the_scanned_bound_is_refused_without_being_read(tmp_path):
    # Before, it was scanned to its end for a field's name (4 GiB, sparse: 58 s of a node's agent).
    model = _llama(tmp_path / "model")
    (model / "tokenizer_config.json").touch()
    os.truncate(model / "tokenizer_config.json", 257 * 1024**2)  # sparse, past the 256 MiB scanned

    bytes_read_before = bytes_read_by_this_process()
    problem = read_model(model).problem
    assert problem is not None and "tokenizer_config.json" in problem, problem
    assert bytes_read_by_this_process() - bytes_read_before < 64 * 1024**2
