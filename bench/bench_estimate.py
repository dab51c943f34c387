"""The gateway's prompt bound (`endpoints.gateway.estimate.worst_case`) per request, on the hot path's shapes.

A short ASCII chat and a short Japanese one, to a model whose tokenizer adds nothing (the bound as for every model)
and, where the tree has it, to one whose tokenizer decomposes, prepends and replaces (`endpoints.gateway.normalizers`,
NFD then Llama's `Prepend("▁")` and `Replace(" ", "▁")`); and the same chats as the gateway takes their bound
(`InferenceRequest.worst_case`, where an endpoint's learned prompt factor applies), without a factor and with one. Each tree is timed in its own process, the trees
alternated round by round so that a busy machine slows each alike; the best of each round's repeats is kept, and the
median of the rounds printed, in µs per call.

    .venv/bin/python bench/bench_estimate.py [--tree DIR ...] [--rounds 5] [--number 100000]

`--tree` (repeatable): a checkout to import the estimate from (default: this one), e.g. `git worktree add` of the
commit before a change, to measure before and after in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

ASCII_CHAT = {
    "model": "m",
    "max_tokens": 64,
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France? Answer briefly."},
    ],
}
JAPANESE_CHAT = {
    "model": "m",
    "max_tokens": 64,
    "messages": [
        {"role": "system", "content": "あなたは親切なアシスタントです。"},
        {"role": "user", "content": "日本の首都はどこですか？簡単に答えてください。"},
    ],
}
NORMALIZER = {
    "steps": [
        {"kind": "decompose"},
        {"kind": "prepend", "content": "\u2581"},
        {"kind": "replace", "pattern": " ", "content": "\u2581"},
    ]
}

_CHILD = """
import json, sys, timeit
from endpoints.gateway.estimate import worst_case
try:
    from endpoints.gateway.normalizers import prompt_normalizer
except ImportError:
    prompt_normalizer = None
shapes, normalizer, number = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
results = {}
for name, payload in shapes.items():
    results[name] = min(timeit.repeat(lambda: worst_case(payload, "chat", 4096, (64, 16)), number=number, repeat=3))
    if prompt_normalizer is not None:
        rewrites = prompt_normalizer(normalizer)
        results[name + ", rewriting tokenizer"] = min(timeit.repeat(
            lambda: worst_case(payload, "chat", 4096, (64, 16), normalizer=rewrites), number=number, repeat=3))
# The request's bound as the gateway takes it (`InferenceRequest.worst_case`, where an endpoint's learned prompt
# factor applies): at an endpoint without one, and, where the tree has them, with one.
import dataclasses, django
from decimal import Decimal
django.setup()
from endpoints.gateway.directory import EndpointInfo
from endpoints.gateway.request import InferenceRequest
info = EndpointInfo(id="e", name="m", organization_id=1, paused=False, max_model_len=4096, cold_start_timeout_s=60,
                    price_input_per_million=Decimal(1), price_cached_input_per_million=Decimal(1),
                    price_output_per_million=Decimal(1), created_at=0.0, max_held_requests=8, template_tokens=(64, 16))
for name, payload in shapes.items():
    request = InferenceRequest("chat", "/v1/chat/completions", b"", payload)
    results[name + ", request"] = min(timeit.repeat(lambda: request.worst_case(info), number=number, repeat=3))
    if hasattr(info, "prompt_factor"):
        scaled = dataclasses.replace(info, prompt_factor=Decimal("6.125"))
        results[name + ", request, learned factor"] = min(timeit.repeat(
            lambda: request.worst_case(scaled), number=number, repeat=3))
print(json.dumps({name: seconds / number * 1e6 for name, seconds in results.items()}))
"""


def _time(tree: Path, number: int) -> dict[str, float]:
    shapes = {"ASCII chat": ASCII_CHAT, "Japanese chat": JAPANESE_CHAT}
    output = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(shapes), json.dumps(NORMALIZER), str(number)],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "DJANGO_SETTINGS_MODULE": "controlplane.settings"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--number", type=int, default=100_000)
    args = parser.parse_args()
    trees = args.tree or [REPO]
    rounds: dict[Path, list[dict[str, float]]] = {tree: [] for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            rounds[tree].append(_time(tree, args.number))
    for tree, results in rounds.items():
        print(tree)
        for name in results[0]:
            print(f"  {name:40} {statistics.median(result[name] for result in results):6.2f} µs")


if __name__ == "__main__":
    main()
