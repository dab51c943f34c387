"""A standby process whose torch says CUDA is initialised: what a CUDA call in the import path would do.

Started by a test in `standby.STANDBY_MODULE`'s place (`python -m tests.agent.cuda_poisoned_standby
--device ...`). It skips the slow preload (nothing in it matters here) and runs the real `main()`.
"""

from __future__ import annotations

import sys

import torch

from gpu_agent.runtime import standby_process

if __name__ == "__main__":
    torch.cuda.is_initialized = lambda: True
    standby_process.PRELOAD_MODULES = ()
    standby_process.PRELOAD_MODULES_BY_DEVICE = {}
    sys.exit(standby_process.main())
