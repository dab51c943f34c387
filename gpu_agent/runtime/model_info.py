"""What a model's own files say about it: context length, architecture, size, quantization, tokenizer normalizer.

Read from a cached model directory (`config.json` and the safetensors headers), after the weights
are fetched and before the engine starts, so the agent can refuse a spec the model cannot run
(a `max_model_len` past the model's context, `awq` on a checkpoint that is not AWQ) at once, with the reason, instead of letting vLLM
fail after a minute of loading. The control plane learns the figures from the heartbeat and uses
them as the endpoint's defaults and limits.

NOTE: these files are the tenant's: any value may be of any type. A figure that is not what vLLM reads
(`"architectures": 5`, a YaRN window of 0, an infinite RoPE factor, a negative tensor dimension) makes the
model `MalformedModel`: it has no `ModelInfo`, and its replicas fail before launch with the reason
(`ModelReading.problem`), since the engine would refuse it too; so does a config.json too large to read
(`model_json.MAX_MODEL_JSON_BYTES`). Nothing read here may raise into the heartbeat or the supervisor's loop:
every reader returns None or a problem.

NOTE: a model whose files send its engine to read files outside its folder (`MODEL_FILE_PATHS`: another tenant's
cached weights, anything on the node) is refused the same way, before anything else is read.

NOTE: imports nothing but the standard library, the protocol and the agent's own path checks (the agent ships
without Django).
"""

from __future__ import annotations

import fnmatch
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpu_agent.protocol import (
    MAX_MODEL_CONTEXT_TOKENS,
    CheckpointQuantization,
    ModelInfo,
    ModelTask,
    ReplicaSpec,
    checkpoint_quantization_problem,
    task_of_architecture,
)
from gpu_agent.runtime.model_json import ModelJsonTooLarge, file_holds, read_model_json
from gpu_agent.runtime.safetensors_headers import read_headers
from gpu_agent.runtime.tokenizer_normalizer import FAST_TOKENIZER_FILES_KEY, read_tokenizer_normalizer

logger = logging.getLogger(__name__)

# The config keys vLLM 0.32 reads for the context length (`derive_max_model_len_and_key`): the smallest wins, but
# Command-R's `model_max_length` replaces the others when it is set.
CONTEXT_LENGTH_KEYS = (
    "max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
    "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len",
)
# RoPE scalings whose factor vLLM does not multiply the context by (`_get_and_verify_max_len`): the figure already
# holds it (YaRN's too, as transformers' `_compute_yarn_parameters` assumes). Every other type's factor multiplies it,
# "default" and "linear" included.
ROPE_TYPES_WITHOUT_EXTENSION = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
# What vLLM assumes of a config that names no context at all.
VLLM_DEFAULT_CONTEXT_TOKENS = 2048
# sentence-transformers' own config files, in vLLM's order (`get_sentence_transformer_tokenizer_config`): the first
# that holds anything sets the context by its `max_seq_length`, whatever config.json says.
SENTENCE_TRANSFORMERS_CONFIG_FILES = (
    "sentence_bert_config.json", "sentence_roberta_config.json", "sentence_distilbert_config.json",
    "sentence_camembert_config.json", "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)
# Mistral's own format: with a `consolidated*.safetensors` in the folder, vLLM reads `params.json` in place of
# config.json (`get_config`, config format "auto"), with its defaults (`configs.mistral._remap_general_mistral_args`).
MISTRAL_CONFIG_FILE = "params.json"
MISTRAL_WEIGHTS_PATTERN = "consolidated*.safetensors"
MISTRAL_DEFAULT_CONTEXT_TOKENS = 128_000
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


class MalformedModel(ValueError):
    """A model's own files say what no engine of this node may run; the message is the replica's reason."""


class ReadingUnsettled(Exception):
    """The files could not be read this time (the header reader past its wall time, or killed): nothing is known of
    them, nothing refused; the message says why."""


@dataclass(slots=True, frozen=True)
class ModelReading:
    """What a model directory's files say, read once: its figures, or why no engine may start on it; or, in
    `unsettled`, why they could not be read this time (not kept: read again later, `WeightsCache.read_model`)."""

    info: ModelInfo | None = None  # None: no readable config.json, or a `problem`
    problem: str = ""  # the replica's failure reason; "" when nothing in the files is refused
    unsettled: str = ""


def read_model(model_dir: str | Path) -> ModelReading:
    """The model's context length, architecture, parameter count and checkpoint quantization, or its problem.

    Never raises: a directory without a readable config.json has neither (the engine says what is wrong).
    NOTE: a directory that is not there is refused: nothing of it was checked (see `WeightsCache._still_cached`).
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return ModelReading(problem="the model's files are not on this node (its folder is gone)")
    try:
        config = load_served_config(model_dir)
        refuse_paths_outside_model(model_dir)
    except (ModelJsonTooLarge, MalformedModel) as exc:
        logger.warning("model %s refused: %s", model_dir.name, exc)
        return ModelReading(problem=f"the model's files cannot be served: {exc}")
    except Exception:  # noqa: BLE001 - NOTE: a reader's bug must not stop the heartbeat: the replica fails instead
        logger.exception("reading the files of model %s failed", model_dir.name)
        return ModelReading(problem="the model's files could not be read (the node's log has details)")
    if config is None:
        return ModelReading()
    try:
        refuse_model_redirect(config)
        info = ModelInfo(
            max_model_len=described_context(model_dir, config),
            architecture=architecture(config),
            num_params=count_parameters(model_dir),
            quantization=checkpoint_quantization(config),
            tokenizer_normalizer=read_tokenizer_normalizer(model_dir),
        )
    except MalformedModel as exc:
        logger.warning("model %s refused: %s", model_dir.name, exc)
        return ModelReading(problem=f"the model's files cannot be served: {exc}")
    except ReadingUnsettled as exc:
        logger.warning("model %s not read this time: %s", model_dir.name, exc)
        return ModelReading(unsettled=str(exc))
    except Exception:  # noqa: BLE001 - NOTE: a reader's bug must not stop the heartbeat: the replica fails instead
        logger.exception("reading the files of model %s failed", model_dir.name)
        return ModelReading(problem="the model's files could not be read (the node's log has details)")
    return ModelReading(info=info)


def read_model_info(model_dir: str | Path) -> ModelInfo | None:
    """What `read_model` finds; None without a readable config, or for a refused model."""
    return read_model(model_dir).info


def read_config_info(model_dir: str | Path) -> ModelInfo | None:
    """What the config says (context length, architecture, quantization; no parameter count), or None when it is
    missing, unreadable or refused. Never raises. The config is the one vLLM reads (`load_served_config`), the context
    as vLLM derives it (`described_context`: a few small JSON files beside it).

    NOTE: for what an engine's command needs (`engine.build_engine_command`, under the supervisor's lock that every
    heartbeat waits on): no safetensors header is parsed. A refused model is never launched (`read_model`, before).
    """
    try:
        config = load_served_config(model_dir)
        if config is None:
            return None
        return ModelInfo(
            max_model_len=described_context(Path(model_dir), config),
            architecture=architecture(config),
            quantization=checkpoint_quantization(config),
        )
    except (ModelJsonTooLarge, MalformedModel):
        return None
    except Exception:  # noqa: BLE001 - NOTE: a reader's bug must not stop a launch: `read_model` says why
        logger.exception("reading the config of model %s failed", Path(model_dir).name)
        return None


def load_config(model_dir: str | Path) -> dict | None:
    """The model's config.json as a JSON object; None when missing, unreadable or anything else.

    Raises `ModelJsonTooLarge` past `model_json.MAX_MODEL_JSON_BYTES` (never read whole).
    """
    try:
        config = read_model_json(Path(model_dir) / "config.json")
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested thousands deep
        return None
    return config if isinstance(config, dict) else None


def refuse_model_redirect(config: dict) -> None:
    """Raise `MalformedModel` for a config that makes vLLM serve another model than this directory.

    NOTE: vLLM 0.32 (`maybe_override_with_speculators`, before it reads anything else) replaces the model
    and its tokenizer with `speculators_config.verifier.name_or_path` of a speculators checkpoint: a hub
    name it would download itself, or the path of any directory on the node (another tenant's cached
    weights). The agent fetches the one model a replica names, so such a checkpoint is never started.
    """
    if config.get("speculators_config") is not None:
        raise MalformedModel(
            "its config.json is a speculators checkpoint (speculators_config), which makes the engine load "
            "another model (its verifier); serve the verifier model and set speculative decoding on the endpoint"
        )


# vLLM's `_ST_POOLING_MODULE_TYPES`.
ST_POOLING_MODULE_TYPES = (
    "sentence_transformers.models.Pooling",
    "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
)


def _sentence_transformers_module_paths(modules: object) -> Iterator[str]:
    """The folder of each sentence-transformers module in a modules.json (a list, or an object with `modules`).

    vLLM reads `{path}/config.json` of its Pooling module (`get_pooling_config`) and `{path}/config.json` and
    `{path}/model.safetensors` of each Dense one (`try_get_dense_modules`, `adapters._load_st_projector`).
    """
    if isinstance(modules, dict):
        modules = modules.get("modules")
    if not isinstance(modules, list):
        return  # vLLM finds no module in it either
    for module in modules:
        if not isinstance(module, dict):
            continue
        path = module.get("path", "")
        if not isinstance(path, str):
            raise MalformedModel("its modules.json gives a module a path that is not a folder name")
        if path == "" and module.get("type") in ST_POOLING_MODULE_TYPES:
            # NOTE: vLLM reads `"{path}/config.json"` of a Pooling module: "/config.json", at the node's root.
            raise MalformedModel("its modules.json gives its Pooling module no folder (path)")
        if path:  # "": the model's folder itself
            yield path


def _fast_tokenizer_files(tokenizer_config: object) -> Iterator[str]:
    """The versioned tokenizer files of a tokenizer_config.json: transformers loads the newest one it supports
    (`tokenization_utils_base.get_fast_tokenizer_file`) in place of tokenizer.json."""
    names = tokenizer_config.get("fast_tokenizer_files") if isinstance(tokenizer_config, dict) else None
    if names is None:
        return
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise MalformedModel("fast_tokenizer_files in its tokenizer_config.json is not a list of file names")
    yield from names


def _audio_tokenizer(processor_config: object) -> Iterator[str]:
    """None: transformers' processors load an audio tokenizer from a processor_config.json's
    `audio_tokenizer.audio_tokenizer_name_or_path` (`ProcessorMixin.get_processor_dict`), with whatever class it
    names (AutoModel: any model's weights), resolved against the engine's working folder, not the model's: refused
    whatever it names (no model served here needs one)."""
    if isinstance(processor_config, dict) and "audio_tokenizer" in processor_config:
        raise MalformedModel("its processor_config.json names an audio tokenizer to load (audio_tokenizer), which a "
                             "processor would read from outside the model's folder: refused")
    yield from ()


def _audio_tokenizer_file(_content: object) -> Iterator[str]:
    """The same, named by a file of its own (`audio_tokenizer_config.json`, which transformers prefers)."""
    raise MalformedModel("its audio_tokenizer_config.json names an audio tokenizer to load, which a processor would "
                         "read from outside the model's folder: refused")
    yield from ()


# NOTE: every field of a model's own files that its engine (vLLM 0.32, transformers 5.19) joins to the model's
# folder and reads, by the file that holds it. `Path(model) / name` takes an absolute name as it is and follows
# `..` and links, so a tenant's `"path": "../<another tenant's folder>/2_Dense"` loaded that tenant's tensor
# into its own projection layer, to read back through /v1/embeddings; each must name a file inside the folder
# (`refuse_paths_outside_model`). Harmless, as read: the other files vLLM reads name none (config.json's
# `_name_or_path` is replaced by the folder; sentence_bert_config.json and config_sentence_transformers.json
# hold settings; jina's adapter folder is one of four task names; a safetensors index only narrows the files
# found in the folder); a tokenizer_config.json's `tokenizer_file`, `vocab_file` and the like are replaced by
# the folder's own files (transformers' `_from_pretrained`); an adapter's `base_model_name_or_path` is never
# loaded; `auto_map` needs trust_remote_code, which no engine gets; a speculators checkpoint's verifier is
# refused by `refuse_model_redirect`; a processor's audio tokenizer, which names a folder to load anything from, is
# refused whatever it names. Each file's entry: its reader, and the key its paths are under (a file past
# `MAX_MODEL_JSON_BYTES` that holds no such key leads nowhere: a tokenizer_config.json grows with its added tokens).
MODEL_FILE_PATHS = {
    "modules.json": (_sentence_transformers_module_paths, b'"path"'),
    "tokenizer_config.json": (_fast_tokenizer_files, FAST_TOKENIZER_FILES_KEY),
    "processor_config.json": (_audio_tokenizer, b'"audio_tokenizer"'),
    "audio_tokenizer_config.json": (_audio_tokenizer_file, b""),
}


def refuse_paths_outside_model(model_dir: Path) -> None:
    """Raise `MalformedModel` when a file named in `MODEL_FILE_PATHS` sends the engine outside `model_dir`.

    A name must be one the agent would download (`weights_paths.model_file_parts`: relative, normal, no `..`)
    and, links followed, stay inside the folder. Raises `ModelJsonTooLarge` for such a file too large to read.
    """
    # NOTE: imported here, not with the module: engine.py imports this module into the standby and every
    # engine, which import neither boto3 nor httpx (weights_access's, where UnsafeModelPath lives).
    from gpu_agent.runtime.weights_access import UnsafeModelPath
    from gpu_agent.runtime.weights_paths import model_file_parts

    root = model_dir.resolve()
    for file_name, (paths_in, key) in MODEL_FILE_PATHS.items():
        try:
            content = read_model_json(model_dir / file_name)
        except OSError:
            continue  # absent, or not a file: the engine reads nothing from it either
        except (ValueError, RecursionError):
            raise MalformedModel(f"its {file_name} is not JSON") from None
        except ModelJsonTooLarge:
            if not key or file_holds(model_dir / file_name, key):
                raise
            continue  # NOTE: names no path: read whole by transformers alone, as before
        for name in paths_in(content):
            try:
                model_file_parts(name)
                resolved = (model_dir / name).resolve()
            except UnsafeModelPath as exc:
                raise MalformedModel(
                    f"its {file_name} names a file outside the model's folder ({exc})"
                ) from None
            except (OSError, RuntimeError):  # RuntimeError: a loop of links
                resolved = None
            if resolved is None or (resolved != root and root not in resolved.parents):
                raise MalformedModel(
                    f"its {file_name} names a file outside the model's folder ({name[:200]!r} leads out of it)"
                )


def architecture(config: dict) -> str:
    """The first of config.json's `architectures` (else its `model_type`), as vLLM picks the model class."""
    architectures = config.get("architectures")
    if architectures is not None and (
        not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures)
    ):
        raise MalformedModel("architectures in its config.json is not a list of names")
    if architectures:
        return architectures[0]
    model_type = config.get("model_type", "")
    return model_type if isinstance(model_type, str) else ""


def model_task(model_dir: str | Path) -> ModelTask:
    """EMBED for an embedding model: a sentence-transformers layout (`modules.json`) or an embedding
    architecture in config.json (`protocol.task_of_architecture`); else GENERATE."""
    model_dir = Path(model_dir)
    if (model_dir / "modules.json").is_file():
        return ModelTask.EMBED
    info = read_config_info(model_dir)  # NOTE: config.json alone, never a safetensors header
    return task_of_architecture(info.architecture) if info else ModelTask.GENERATE


def checkpoint_quantization(config: dict) -> CheckpointQuantization:
    """The checkpoint's own `quantization_config` (quant_method, bits, group size), as vLLM reads it.

    Multimodal configs may keep it in `text_config`, as vLLM's `get_quant_config` looks.
    """
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) and isinstance(config.get("text_config"), dict):
        quant = config["text_config"].get("quantization_config")
    if not isinstance(quant, dict):
        return CheckpointQuantization()

    def number(*keys: str) -> int | None:
        for key in keys:
            value = quant.get(key)
            if _is_count(value):
                return value
        return None

    method = quant.get("quant_method")
    return CheckpointQuantization(
        quant_method=method.strip().lower()[:64] if isinstance(method, str) else "",
        bits=number("bits", "w_bit"),
        group_size=number("group_size", "q_group_size"),
    )


def context_length(config: dict, *, tokenizer_limit: int | None = None) -> int:
    """The context vLLM 0.32 derives from this config (`_get_and_verify_max_len` with no `--max-model-len`), which the
    engine is then launched with (`engine.engine_context_length`).

    The smallest of `CONTEXT_LENGTH_KEYS` (a `model_max_length` replaces them), else vLLM's 2,048; at most
    `tokenizer_limit` (a pooling model's tokenizer_config, `described_context`); times the RoPE factor of every
    scaling that is not already in the figure (`ROPE_TYPES_WITHOUT_EXTENSION`).

    Raises `MalformedModel` for a RoPE scaling vLLM could not compute with, or a context of no token (at most
    `MAX_MODEL_CONTEXT_TOKENS` otherwise, as the control plane keeps it).
    """
    # Multimodal configs keep the language model's figures in `text_config`.
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    lengths = [
        value for key in CONTEXT_LENGTH_KEYS
        for value in (text_config.get(key), config.get(key))
        if _is_count(value) and value > 0
    ]
    derived = min(lengths) if lengths else math.inf
    # NOTE: Command-R's key replaces the others (vLLM takes it as it is, larger or smaller).
    override = (text_config or config).get("model_max_length")
    if _is_count(override) and override > 0:
        derived = override
    if tokenizer_limit is not None:
        derived = min(derived, tokenizer_limit)
    if derived == math.inf:
        derived = VLLM_DEFAULT_CONTEXT_TOKENS
    model_type = (text_config or config).get("model_type")
    if "gemma3" not in (model_type if isinstance(model_type, str) else ""):  # vLLM: Gemma 3's figure holds its factor
        derived *= _rope_factor(text_config or config)
    if derived < 1:
        raise MalformedModel("its config.json gives a context of no token (a RoPE factor below 1)")
    return int(min(derived, MAX_MODEL_CONTEXT_TOKENS))


def _rope_factor(config: dict) -> float:
    """What vLLM multiplies the context by: the factor of the last RoPE scaling (of any layer type) whose figure does
    not already hold it, else 1: the older `rope_scaling` when it holds any (transformers takes it in place of
    `rope_parameters`, `convert_rope_params_to_dict`), else `rope_parameters`."""
    rope = config.get("rope_scaling")
    if not isinstance(rope, dict) or not rope:
        rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or not rope:
        return 1.0
    nested = "rope_type" not in rope and "type" not in rope and all(isinstance(value, dict) for value in rope.values())
    factor = 1.0
    for parameters in rope.values() if nested else (rope,):
        if not parameters:
            continue
        rope_type = parameters.get("rope_type") or parameters.get("type") or "default"
        window = parameters.get("original_max_position_embeddings")
        if rope_type in ("yarn", "deepseek_yarn") and window is not None and (not _is_count(window) or window <= 0):
            # NOTE: transformers divides by it (YaRN's attention factor): the engine would refuse the model
            raise MalformedModel(
                "rope_scaling's original_max_position_embeddings in its config.json is not a positive integer"
            )
        if rope_type in ROPE_TYPES_WITHOUT_EXTENSION:
            continue
        factor = parameters.get("factor", factor)
        if factor is None:
            factor = 1.0  # vLLM: a null factor is taken as 1
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not math.isfinite(factor) or factor <= 0:
            raise MalformedModel("rope_scaling's factor in its config.json is not a finite number above 0")
    return factor


def described_context(model_dir: Path, config: dict) -> int:
    """The context vLLM derives for the model in `model_dir` whose config (as vLLM reads it: `load_served_config`)
    is `config`: `context_length`, at most a pooling tokenizer's `model_max_length`, and replaced by a
    sentence-transformers config's `max_seq_length`.

    NOTE: vLLM bounds a context by tokenizer_config.json's `model_max_length` only on its pooling runner, for a model
    of absolute position embeddings; the agent does for any such model (a shorter context, never a refused one).
    """
    tokenizer_limit = None
    if config.get("position_embedding_type") == "absolute":
        tokenizer_limit = _json_count(model_dir / "tokenizer_config.json", "model_max_length")
    derived = context_length(config, tokenizer_limit=tokenizer_limit)
    for name in SENTENCE_TRANSFORMERS_CONFIG_FILES:
        try:
            encoder = read_model_json(model_dir / name)
        except (OSError, ValueError, RecursionError, ModelJsonTooLarge):
            continue
        if not encoder:
            continue  # vLLM looks on to the next file
        if isinstance(encoder, dict) and "max_seq_length" in encoder:
            length = encoder["max_seq_length"]
            if not _is_count(length) or length <= 0:
                raise MalformedModel(f"max_seq_length in its {name} is not a positive integer")
            derived = min(length, MAX_MODEL_CONTEXT_TOKENS)
        break
    return derived


def _json_count(path: Path, key: str) -> int | None:
    """A positive integer under `key` of a JSON object file; None when it holds none (or cannot be read)."""
    try:
        content = read_model_json(path)
    except (OSError, ValueError, RecursionError, ModelJsonTooLarge):
        return None
    value = content.get(key) if isinstance(content, dict) else None
    return value if _is_count(value) and value > 0 else None


def load_served_config(model_dir: str | Path) -> dict | None:
    """The config vLLM reads for the model in `model_dir`: a Mistral-format folder's params.json (as vLLM adapts it,
    `mistral_config`), else config.json (`load_config`). None when there is none, or it is not a JSON object.

    Raises `ModelJsonTooLarge` past `model_json.MAX_MODEL_JSON_BYTES`.
    """
    model_dir = Path(model_dir)
    if is_mistral_format(model_dir):
        try:
            params = read_model_json(model_dir / MISTRAL_CONFIG_FILE)
        except (OSError, ValueError, RecursionError):
            return None
        return mistral_config(params, load_config(model_dir) or {}) if isinstance(params, dict) else None
    return load_config(model_dir)


def is_mistral_format(model_dir: Path) -> bool:
    """Whether vLLM reads this folder as Mistral's own format (`is_mistral_model_repo` and a params.json)."""
    if not (model_dir / MISTRAL_CONFIG_FILE).is_file():
        return False
    try:
        with os.scandir(model_dir) as entries:
            return any(fnmatch.fnmatchcase(entry.name, MISTRAL_WEIGHTS_PATTERN) for entry in entries)
    except OSError:
        return False


def mistral_config(params: dict, hf_config: dict) -> dict:
    """A Mistral params.json as vLLM turns it into a config (`MistralConfigParser`, `configs.mistral.adapt_config_dict`),
    as far as the context and the architecture go: its window, else config.json's (`hf_config`), else 128,000 tokens;
    its YaRN already in it; and what it leaves out taken from config.json."""
    config = dict(params)
    window = params.get("max_position_embeddings")
    if window is None:
        text_config = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), dict) else hf_config
        window = text_config.get("max_position_embeddings") or MISTRAL_DEFAULT_CONTEXT_TOKENS
    config["max_seq_len"] = params.get("max_seq_len", window)
    config["max_position_embeddings"] = window
    if params.get("yarn"):
        config["rope_parameters"] = {"rope_type": "yarn"}
    moe = params.get("moe")
    if params.get("model_type") == "mamba":
        config["architectures"] = ["Mamba2ForCausalLM"]
    elif moe and isinstance(moe, dict) and (moe.get("num_shared_experts") or 0) > 0:
        config["architectures"] = ["MistralLarge3ForCausalLM"]
    elif moe:
        config["architectures"] = ["MixtralForCausalLM"]
    else:
        config["architectures"] = ["MistralForCausalLM"]
    multimodal = params.get("multimodal") if isinstance(params.get("multimodal"), dict) else {}
    if multimodal.get("vision_encoder_args") or params.get("vision_encoder"):
        config["architectures"] = ["PixtralForConditionalGeneration"]
    for key, value in hf_config.items():
        config.setdefault(key, value)
    return config


def kv_cache_bytes_per_token(model_dir: str | Path, dtype: str) -> int | None:
    """Bytes of K and V a token takes over every layer, for a plain attention decoder in `dtype`.

    None when the config says anything else (multimodal, state-space or hybrid layers, an unknown
    dtype): the caller then keeps its fixed size. Sliding-window and latent (MLA) attention take less
    than this, so it is an upper bound for them.
    """
    try:
        config = load_config(model_dir)
    except ModelJsonTooLarge:  # `read_model` refused the model: no engine is started on it
        return None
    if config is None or "text_config" in config:
        return None
    layer_types = config.get("layer_types") or []
    if not isinstance(layer_types, list) or not all(isinstance(kind, str) for kind in layer_types):
        return None
    if any("mamba" in key or "ssm" in key for key in config) or set(layer_types) - {
        "full_attention", "sliding_attention",
    }:  # fmt: skip
        return None
    values = {
        key: config.get(key) for key in ("num_hidden_layers", "num_attention_heads", "hidden_size")
    }
    values["num_key_value_heads"] = config.get("num_key_value_heads", values["num_attention_heads"])
    if not all(_is_count(value) and value > 0 for value in values.values()):
        return None
    head_dim = config.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    element_bytes = DTYPE_BYTES.get(dtype)
    if not _is_count(head_dim) or head_dim <= 0 or element_bytes is None:
        return None
    return 2 * values["num_hidden_layers"] * values["num_key_value_heads"] * head_dim * element_bytes


def count_parameters(model_dir: Path) -> int | None:
    """Parameters in the model's safetensors files, from their headers alone, counted in a child process within
    its limits (`safetensors_headers.read_headers`). None when unknown; `MalformedModel` when they are refused;
    `ReadingUnsettled` when the reader gave no answer this time.

    NOTE: a tenant's header is read once, when its weights are cached (`WeightsCache.read_model`), never by a launch
    (`read_config_info`) nor in the agent's own process.
    """
    reading = read_headers(model_dir)
    if reading.unsettled:
        raise ReadingUnsettled(reading.unsettled)
    if reading.problem:
        raise MalformedModel(reading.problem)
    return reading.num_params


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def spec_problem(spec: ReplicaSpec, info: ModelInfo | None) -> str:
    """Why an engine started for this spec would refuse this model; "" when it would not (or unknown)."""
    return context_problem(spec.max_model_len, info) or checkpoint_quantization_problem(
        spec.quantization, info.quantization if info else None
    )


def context_problem(requested: int | None, info: ModelInfo | None) -> str:
    """Why an engine asked for `requested` tokens of context would refuse this model; "" when it would not."""
    if requested is None or info is None or info.max_model_len is None or requested <= info.max_model_len:
        return ""
    return (
        f"max_model_len {requested} is above this model's context of {info.max_model_len} tokens "
        f"(its config.json); lower max_model_len or leave it unset to use the model's own"
    )
