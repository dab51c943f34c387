"""A model's parameter count from its safetensors headers, parsed in a child process with CPU and memory limits.

NOTE: the headers are the tenant's. Parsed in the agent, a header within every bound it could check before parsing
held the GIL for seconds (16 MiB of `[]`, its budget bought with repeated `"data_offsets"` keys: ~2 s and ~160 MB,
every thread of the agent stalled); a count of bytes gives no bound a tenant does not control. The child
(`python -m gpu_agent.runtime.safetensors_headers <folder>`) gets `MAX_READER_CPU_S` of CPU and `MAX_READER_MEMORY_BYTES`
of address space (`setrlimit`) and `READER_TIMEOUT_S` of wall time, and answers one line of JSON: the count, or why
the headers are refused. The agent's thread waits on a pipe, holding nothing.

NOTE: imports nothing but the standard library (the child starts in ~50 ms; engine.py imports `model_info`, and so
this module, into the standby and every engine).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 100 * 1024 * 1024
# All of a model's safetensors headers together: past this the parameter count is unknown (None), nothing parsed.
# A tensor's entry takes ~100-150 bytes (its name, dtype, shape, offsets): Llama 3.1 405B's ~1,100 tensors
# ~150 KB, DeepSeek-V3's ~91,000 (FP8 weights and their scales) ~12 MB, a Kimi-K2-like 1T mixture of experts'
# ~140,000 ~18 MB.
MAX_HEADERS_BYTES_PER_MODEL = 64 * 1024 * 1024
# JSON values a tensor's entry may hold (counted as the bytes `,` `[` `{` before a header is parsed): its three
# keys, a shape of up to 20 dimensions, two offsets; and containers (`[` `{`): its object, shape and offsets.
# Each tensor is counted by its `"data_offsets"` key. A model's headers get `HEADER_VALUES_SPARE` more of
# each besides (the top objects, `__metadata__`'s strings). NOTE: a first filter only (a tenant buys budget with
# repeated keys): the child's limits are the bound.
MAX_HEADER_VALUES_PER_TENSOR = 32
MAX_HEADER_CONTAINERS_PER_TENSOR = 3
HEADER_VALUES_SPARE = 4096
# A tensor size in a safetensors header is a u64 (which safetensors itself checks).
MAX_HEADER_SIZE = 2**64 - 1
# Parameters are counted to here at most (past the control plane's `MAX_MODEL_NUM_PARAMS`, which clamps them).
PARAMS_COUNTED_TO = 2**63
# The reader child's limits: 64 MiB of real headers (~520,000 tensors) take ~3 s and ~470 MB (2 shared cores); 35 MiB
# of `[]`s bought with repeated keys ~1.7 s and ~380 MB. A header past them refuses its model.
MAX_READER_CPU_S = 20
MAX_READER_MEMORY_BYTES = 1024**3
READER_TIMEOUT_S = 60
OUT_OF_MEMORY_EXIT = 3  # the child's exit status at its memory limit


class HeadersRefused(ValueError):
    """A model's safetensors headers are not what safetensors would load, or cost more than the reader may spend."""


@dataclass(slots=True, frozen=True)
class HeadersReading:
    """What the reader child found: the parameter count (None: unknown), or why the headers are refused; or, in
    `unsettled`, why it gave no answer this time (past its wall time, killed from outside, not started): nothing is
    known of the headers then, nothing refused, and they are read again later."""

    num_params: int | None = None
    problem: str = ""
    unsettled: str = ""


def read_headers(model_dir: Path) -> HeadersReading:
    """The parameters in the model's safetensors files, counted by a child process within the reader's limits.

    Never raises. Only the reader's own limits refuse a model (its CPU: SIGXCPU; its memory: `OUT_OF_MEMORY_EXIT`):
    a child past its wall time or killed from outside (the OOM killer, an operator) on a loaded node, or one that could
    not start, says nothing of the headers (`HeadersReading.unsettled`); before, each refused a legitimate model on
    that node for the agent's life.
    """
    # NOTE: the child imports this same agent (its folder first on the path), wherever the agent was started.
    package_root = Path(__file__).resolve().parents[2]
    try:
        finished = subprocess.run(  # noqa: S603 - our own interpreter and module, the folder as one argument
            [
                sys.executable, "-E", "-s", "-m", __name__,
                os.fspath(model_dir), str(MAX_READER_CPU_S), str(MAX_READER_MEMORY_BYTES),
            ],
            cwd=package_root, stdin=subprocess.DEVNULL, capture_output=True, timeout=READER_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return HeadersReading(unsettled=f"its safetensors headers took more than {READER_TIMEOUT_S} s to read")
    except OSError as exc:
        logger.exception("could not start the safetensors header reader for %s", model_dir.name)
        return HeadersReading(unsettled=f"the safetensors header reader could not start ({exc.strerror or 'error'})")
    if finished.returncode != 0:
        logger.warning(
            "the safetensors header reader for %s ended with %s: %s",
            model_dir.name, finished.returncode, finished.stderr[-2000:].decode(errors="replace"),
        )
        if finished.returncode == -signal.SIGKILL:
            return HeadersReading(unsettled="the safetensors header reader was killed (the node short of memory?)")
        if finished.returncode not in (-signal.SIGXCPU, OUT_OF_MEMORY_EXIT):
            return HeadersReading()  # the reader's own bug (its traceback is logged): nothing refused
        return HeadersReading(
            problem=f"its safetensors headers take more than the node's reader may spend ({MAX_READER_CPU_S} s of "
            f"CPU, {MAX_READER_MEMORY_BYTES // 1024**2} MiB of memory)"
        )
    try:
        answer = json.loads(finished.stdout)
        return HeadersReading(num_params=answer["num_params"], problem=answer["problem"])
    except (ValueError, KeyError, TypeError):
        logger.warning("the safetensors header reader for %s answered %r", model_dir.name, finished.stdout[:200])
        return HeadersReading()


class _HeaderBudget:
    """What a model's safetensors headers may hold before they are parsed: values and containers per tensor.

    NOTE: a header of `[0,0,…]` or `[{},{},…]` passed every byte bound: parsed, it took a Python call per
    integer (a check of its digits: ~11 s for 60 MB) or 1.5 GB of empty objects. Counting its bytes takes ~4 ms a
    MB; integers are parsed by `json` alone and the sizes checked after (`MAX_HEADER_SIZE`).
    """

    def __init__(self) -> None:
        self.num_tensors = self.num_values = self.num_containers = 0

    def check(self, name: str, data: bytes) -> None:
        """Count `data` (one file's header) in; raise `HeadersRefused` when the model's headers pass the budget."""
        self.num_tensors += data.count(b'"data_offsets"')
        num_containers = data.count(b"[") + data.count(b"{")
        self.num_containers += num_containers
        self.num_values += num_containers + data.count(b",")
        if (
            self.num_values > MAX_HEADER_VALUES_PER_TENSOR * self.num_tensors + HEADER_VALUES_SPARE
            or self.num_containers > MAX_HEADER_CONTAINERS_PER_TENSOR * self.num_tensors + HEADER_VALUES_SPARE
        ):
            raise HeadersRefused(
                f"the safetensors header of {name} holds more values than its tensors "
                f"({self.num_tensors} in the model's headers so far) can have"
            )


def count_parameters(model_dir: Path) -> int | None:
    """Parameters in the model's safetensors files, from their headers alone (no tensor is read), counted up to
    `PARAMS_COUNTED_TO`, in this process: the child's work (`read_headers` elsewhere).

    None when a header cannot be read; `HeadersRefused` when one is not what safetensors would load.

    NOTE: a shape of a few hundred 4,000-digit sizes was multiplied out in full (`math.prod`, quadratic: a 4 MB
    header froze every thread of the agent for a minute); sizes past a u64 are refused before any product, and a
    product stops growing at the cap. A header holding more values than its tensors can (`_HeaderBudget`) is
    refused before it is parsed.
    """
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    total, header_bytes = 0, 0
    budget = _HeaderBudget()
    for path in files:
        try:
            with open(path, "rb") as handle:
                (header_len,) = struct.unpack("<Q", handle.read(8))
                header_bytes += header_len
                if header_len > MAX_HEADER_BYTES or header_bytes > MAX_HEADERS_BYTES_PER_MODEL:
                    return None
                data = handle.read(header_len)
            budget.check(path.name, data)
            header = json.loads(data)
        except HeadersRefused:
            raise
        except (OSError, ValueError, RecursionError, struct.error):
            logger.warning("could not read the safetensors header of %s", path.name)
            return None
        if not isinstance(header, dict):
            raise HeadersRefused(f"the safetensors header of {path.name} is not a JSON object")
        for name, tensor in header.items():
            if name == "__metadata__" or not isinstance(tensor, dict):
                continue
            shape = tensor.get("shape", [])
            if not isinstance(shape, list) or not all(_is_size(size) for size in shape):
                raise HeadersRefused(f"a tensor in {path.name} has a shape that is not a list of sizes")
            if any(size > MAX_HEADER_SIZE for size in shape):
                raise HeadersRefused(f"the safetensors header of {path.name} has a number too large for safetensors")
            total = min(total + _num_elements(shape), PARAMS_COUNTED_TO)
    return total


def _num_elements(shape: list[int]) -> int:
    """The product of `shape`'s sizes, or `PARAMS_COUNTED_TO` when it would pass it."""
    count = 1
    for size in shape:
        count = min(count * size, PARAMS_COUNTED_TO)
    return count


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _main(model_dir: str, cpu_s: int, memory_bytes: int) -> None:
    """The child: limit itself, count, print one line of JSON."""
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        answer = {"num_params": count_parameters(Path(model_dir)), "problem": ""}
    except HeadersRefused as exc:
        answer = {"num_params": None, "problem": str(exc)}
    except MemoryError:
        sys.exit(OUT_OF_MEMORY_EXIT)
    sys.stdout.write(json.dumps(answer))


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
