"""Runs the real standby process (`standby_process.main`) with a tripwire on CUDA's initialisation.

`python -m tests.agent.cuda_tripwire_standby REPORT [MODULE ...]`: every path that initialises CUDA
through torch, in Python (`torch.cuda.current_device()`, `mem_get_info`, ...) or in C++ (a tensor put on
a CUDA device), calls `torch.cuda._lazy_init`. The tripwire records the call and marks CUDA initialised,
as a GPU machine would, so the standby's own check sees it. The CPU build of torch would otherwise
refuse such calls without ever reporting CUDA initialised. MODULEs, if given, replace the preload list
(a test adds one that touches CUDA). The standby's `--device` is `cuda`; its stdin is the test's;
with TRIPWIRE_ZYGOTE set it runs as the zygote.
The REPORT (JSON) says what the standby returned and what the tripwire saw.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

ZYGOTE_ENV = "TRIPWIRE_ZYGOTE"  # set: run the standby as the zygote (`--zygote`)


def install_tripwire(calls: list[str]) -> None:
    original = torch.cuda._lazy_init

    def tripwire() -> None:
        calls.append("".join(traceback.format_stack(limit=12)[:-1]))
        torch.cuda._initialized = True

    for module in list(sys.modules.values()):
        if module is not None and vars(module).get("_lazy_init") is original:
            module._lazy_init = tripwire


def main() -> int:
    from gpu_agent.runtime import standby_process

    report_path, modules = sys.argv[1], tuple(sys.argv[2:])
    calls: list[str] = []
    install_tripwire(calls)
    if modules:
        standby_process.PRELOAD_MODULES = modules
        standby_process.PRELOAD_MODULES_BY_DEVICE = {}
    zygote = ["--zygote"] if os.environ.get(ZYGOTE_ENV) else []
    exit_code = standby_process.main(["--device", "cuda", *zygote])
    report = {
        "exit_code": exit_code,
        "cuda_initialised": torch.cuda.is_initialized(),
        "tripwire_calls": calls,
        "vllm_modules_imported": sorted(m for m in sys.modules if m.startswith("vllm.v1.")),
        "nvml_based_cuda_check": os.environ.get(standby_process.NVML_BASED_CUDA_CHECK_ENV),
    }
    with open(report_path, "w") as handle:
        json.dump(report, handle)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
