"""Which of a model's files an agent fetches and its engine loads: safetensors, never a pickle.

PyTorch's `.bin`, `.pt` and `.pth` checkpoints (and `.ckpt`, `.pkl`) are Python pickles: loading one runs what its
author put in it, held back only by torch's `weights_only` unpickler, which has been escaped before (CVE-2025-32434).
A tenant's bucket is hostile input, and its engine runs on a machine shared with other tenants' engines, so:

- **No pickle is downloaded** (`fetched`): a source listing both formats (most public repositories) costs one copy of
  its weights, not two, and nothing on the node can load the other.
- **A model whose weights are pickles only is refused before any byte is fetched** (`PickledWeights`), saying how to
  convert it; vLLM would otherwise load them (`load_format` "auto" falls back to `*.bin` and `*.pt`). So is one with a
  sentence-transformers module (`2_Dense/`) in pickles only: left out, its embeddings would change, unsaid.
- **Engines load safetensors only** (`engine.LOAD_FORMAT_FLAGS`): also for a local model directory, whose
  files the agent does not choose, and a speculative draft, loaded with its target's settings.
- **A LoRA adapter's weights must be `adapter_model.safetensors`** (`adapter_problem`): vLLM's adapter loader reads
  `adapter_model.bin` with `torch.load` when the safetensors file is missing.
- **Of an adapter's source, only what vLLM reads from an adapter folder is fetched** (`adapter_fetched`): its
  `adapter_config.json` and `adapter_model.safetensors`, refused before any byte is fetched when either is missing.

Weights for other frameworks (TensorFlow's `.h5`, Flax's `.msgpack`, ONNX, GGUF, Core ML), which vLLM does not load from
a model directory, are not fetched either.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TypeVar

from gpu_agent.runtime.weights_access import WeightsError

# The suffixes of PyTorch's (pickle) checkpoint files and of other pickles.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# Weights of other frameworks, and formats vLLM loads only as a single file named as the model.
OTHER_FRAMEWORK_SUFFIXES = (".h5", ".msgpack", ".onnx", ".onnx_data", ".gguf", ".tflite", ".mlmodel", ".ot")
SAFETENSORS_SUFFIX = ".safetensors"
# A trainer's own state beside a checkpoint: pickles, never weights (left out, never a reason to refuse).
_TRAINING_STATE = frozenset({"training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"})
_SENTENCE_TRANSFORMERS_MODULE = re.compile(r"\d+_[A-Za-z]\w*")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# What vLLM reads from an adapter folder: the config (`vllm.lora.peft_helper.PEFTHelper.from_local_dir`) and the
# weights (`vllm.lora.lora_model.LoRAModel.from_local_checkpoint`, whose pickled fallbacks are never fetched). It
# loads no tokenizer of an adapter's (the base model's serves every adapter).
ADAPTER_FILES = frozenset({ADAPTER_CONFIG, ADAPTER_WEIGHTS})
NO_ADAPTER_CONFIG = f"the adapter has no readable {ADAPTER_CONFIG} (a PEFT LoRA adapter's files are expected)"
NO_ADAPTER_WEIGHTS = (f"the adapter has no {ADAPTER_WEIGHTS}: Inferplane loads adapter weights in safetensors only (a "
                      "pickled adapter_model.bin can run code when it is read); save it with safe_serialization=True")

_File = TypeVar("_File")


class PickledWeights(WeightsError):
    """The model's weights are pickles only: refused, with how to convert them."""


class AdapterRefused(WeightsError):
    """An adapter's source lacks a file the engine needs, or its files are past the node's bound."""


def is_pickle(name: str) -> bool:
    return name.lower().endswith(PICKLE_SUFFIXES)


def _skipped(name: str) -> bool:
    return name.lower().endswith(PICKLE_SUFFIXES + OTHER_FRAMEWORK_SUFFIXES)


def _loaded_from(folder: str) -> bool:
    """Whether vLLM loads weights from this folder of a model: its root, and a sentence-transformers module's
    (`2_Dense`: an embedding model's projection, read by its pooler). Others (`original/`, a checkpoint's copy for
    another runtime) it never reads."""
    return folder == "" or _SENTENCE_TRANSFORMERS_MODULE.fullmatch(folder) is not None


def _pickled_weights(name: str, with_safetensors: set[str]) -> bool:
    """Whether `name` is a pickle the engine would load weights from: in a folder it loads from, with no safetensors
    there, and not a trainer's own state."""
    folder, base = posixpath.split(name)
    return (is_pickle(name) and base not in _TRAINING_STATE and not base.startswith("rng_state")
            and _loaded_from(folder) and folder not in with_safetensors)


def fetched(files: Iterable[_File]) -> list[_File]:
    """The files of a listing (each with its `name`) the agent downloads: all but pickles and other frameworks' weights.

    `PickledWeights` when a folder the engine loads weights from (`_loaded_from`) holds pickled weights and no
    safetensors file: the engine would have nothing to load there but them (or, for a sentence-transformers module,
    would leave the module out and answer other vectors, unsaid)."""
    files = list(files)
    kept = [f for f in files if not _skipped(f.name)]
    with_safetensors = {posixpath.dirname(f.name) for f in kept if f.name.lower().endswith(SAFETENSORS_SUFFIX)}
    pickles = [f.name for f in files if _pickled_weights(f.name, with_safetensors)]
    if pickles:
        shown = ", ".join(sorted(pickles)[:3])
        more = f" and {len(pickles) - 3} more" if len(pickles) > 3 else ""
        raise PickledWeights(
            f"the model's weights are PyTorch pickle files ({shown}{more}), which Inferplane never loads: a pickle can "
            "run code when it is read. Convert them to safetensors (transformers: save_pretrained(..., "
            "safe_serialization=True); PEFT adapters the same) and point the endpoint at the converted copy.")
    return kept


def adapter_fetched(files: Iterable[_File]) -> list[_File]:
    """The files of an adapter's listing the agent downloads: its `ADAPTER_FILES` at the top of the source, no other.

    NOTE: the whole prefix was fetched before, so a tenant's adapter with a tiny config and weights beside hundreds of
    gigabytes of other files filled the node's cache, evicting other tenants' models. `PickledWeights` as `fetched`
    says (pickled weights only), `AdapterRefused` when the config or the safetensors weights are not listed."""
    kept = [f for f in fetched(files) if f.name in ADAPTER_FILES]
    names = {f.name for f in kept}
    if ADAPTER_WEIGHTS not in names:
        raise AdapterRefused(NO_ADAPTER_WEIGHTS)
    if ADAPTER_CONFIG not in names:
        raise AdapterRefused(NO_ADAPTER_CONFIG)
    return kept


def adapter_problem(path: str | Path) -> str:
    """Why an adapter folder's weights are refused ("" if they are safetensors)."""
    if (Path(path) / ADAPTER_WEIGHTS).is_file():
        return ""
    return NO_ADAPTER_WEIGHTS
