"""A tiny random-weight Llama with a locally trained tokenizer, for tests and benchmarks.

It builds in seconds with no download, and vLLM's OpenAI server serves it
(`/v1/completions` and `/v1/chat/completions`). The output is gibberish; what
matters is that the engine, batching, quantization and the agent around them run
for real. Everything is seeded, so two builds give the same files.

`build_tiny_embedding_model` writes its embedding sibling: the same body as a bare `LlamaModel`
(no language-model head), the architecture e5-mistral-style embedding models declare, which vLLM
serves with its pooling runner (`/v1/embeddings`, last-token pooling, normalised). Its config
declares Matryoshka dimensions, so `dimensions` may shorten its vectors.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 1234
VOCAB_SIZE = 1024
HIDDEN_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 2  # head_dim 64: vLLM CPU attention supports 32, 64, 80, ... not 16
MAX_POSITION_EMBEDDINGS = 2048

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
PAD_TOKEN = "<pad>"

# Llama-2 style, kept to what Jinja in vLLM and transformers both accept. Tools render as Hermes
# does (a `<tools>` list; calls as `<tool_call>{json}</tool_call>`), so vLLM's `hermes` tool-call
# parser reads this model's output. Without tools the prompt is unchanged.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|system|>\\nYou may call functions. <tools>' }}"
    "{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
    "{{ '</tools> Answer a call as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>' + eos_token + '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>{\"name\": \"' + function['name'] + '\", \"arguments\": ' }}"
    "{% if function['arguments'] is string %}{{ function['arguments'] }}{% else %}{{ function['arguments'] | tojson }}{% endif %}"
    "{{ '}</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_WORDS = (
    "the a an model token engine replica batch cache request stream node gpu cpu memory "
    "serve scale zero cold warm start stop drain ready failed weights bucket prefix key "
    "hello world how are you today tell me a story about llamas and inference platforms "
    "one two three four five six seven eight nine ten quick brown fox jumps over lazy dog"
).split()


def _corpus(num_lines: int = 4000) -> list[str]:
    rng = random.Random(SEED)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ","]) + f" {rng.randint(0, 9999)}")
    return lines


def _build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": PAD_TOKEN,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": UNK_TOKEN, "pad_token": PAD_TOKEN}
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


# The embedding model's vector size is HIDDEN_SIZE; `dimensions` may ask for any of these.
EMBEDDING_MATRYOSHKA_DIMENSIONS = (32, 64, HIDDEN_SIZE)


def build_tiny_model(directory: str | Path, *, dtype: str = "bfloat16") -> Path:
    """Write a tiny Llama checkpoint (config, safetensors, tokenizer) into `directory`."""
    return _build(directory, dtype=dtype, embedding=False)


def build_tiny_embedding_model(directory: str | Path, *, dtype: str = "bfloat16") -> Path:
    """Write a tiny embedding checkpoint (a bare `LlamaModel`, HIDDEN_SIZE-wide vectors) into `directory`."""
    return _build(directory, dtype=dtype, embedding=True)


def _build(directory: str | Path, *, dtype: str, embedding: bool) -> Path:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=HIDDEN_SIZE * 4,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        bos_token_id=tokenizer.token_to_id(BOS_TOKEN),
        eos_token_id=tokenizer.token_to_id(EOS_TOKEN),
        pad_token_id=tokenizer.token_to_id(PAD_TOKEN),
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    if embedding:
        config.matryoshka_dimensions = list(EMBEDDING_MATRYOSHKA_DIMENSIONS)
    model = (LlamaModel if embedding else LlamaForCausalLM)(config).to(getattr(torch, dtype))
    model.save_pretrained(str(path), safe_serialization=True)
    generation = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path


# The tiny adapter's rank and the projections it adapts (PEFT names).
TINY_LORA_RANK = 4
TINY_LORA_TARGET_MODULES = ("q_proj", "v_proj")


def build_tiny_lora_adapter(
    directory: str | Path, *, base_model: str = "tiny-llama", rank: int = TINY_LORA_RANK, seed: int = SEED
) -> Path:
    """Write a PEFT-layout LoRA adapter for the tiny model into `directory`.

    The files are what `peft`'s `save_pretrained` writes (`adapter_config.json` and
    `adapter_model.safetensors` with `base_model.model.model.layers.N.self_attn.X.lora_A/B.weight`),
    built here with torch and safetensors so the agent and the tests need no `peft`. `seed` changes
    the weights, so two adapters answer differently.
    """
    import torch
    from safetensors.torch import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(NUM_LAYERS):
        for module in TINY_LORA_TARGET_MODULES:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, HIDDEN_SIZE, generator=generator) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(HIDDEN_SIZE, rank, generator=generator) * 0.5
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": rank * 2,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(TINY_LORA_TARGET_MODULES),
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path
