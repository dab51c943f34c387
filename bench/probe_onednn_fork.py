"""Does oneDNN's kernel cache survive fork? (issue #17, the zygote's kernel warm-up question)

Creates vLLM's CPU matmul handlers (`create_onednn_mm`, as a CPU engine does for each linear layer) for the tiny
model's layer shapes and runs them, optionally first in the parent, then in a forked child, and prints the CPU
seconds of each step. `parent1`: the parent runs them with one OpenMP thread (no libgomp pool started) and
restores the thread count; `parentN`: with all threads (the child then hangs in libgomp: run under `timeout`);
`none`: the child alone. The second argument lists the row counts (M) to run: the parent's, then each child's.

    timeout 60 .venv/bin/python bench/probe_onednn_fork.py {none|parent1|parentN} [7,1]
"""

from __future__ import annotations

import os
import sys
import time

import torch
from vllm import _custom_ops as ops

SHAPES = [(128, 384), (128, 128), (128, 512), (256, 128), (128, 1024)]  # (K, N): the tiny model's linears


def run(tag: str, row_counts: list[int]) -> None:
    started = time.process_time()
    handlers = [(ops.create_onednn_mm(torch.randn(n, k).t(), 32), k) for k, n in SHAPES]
    created = time.process_time()
    for rows in row_counts:
        for handler, k in handlers:
            ops.onednn_mm(handler, torch.randn(rows, k), None)
    first = time.process_time()
    for rows in row_counts:
        for handler, k in handlers:
            ops.onednn_mm(handler, torch.randn(rows, k), None)
    print(f"{tag} M={row_counts}: create {created - started:.3f} first {first - created:.3f} "
          f"second {time.process_time() - first:.3f} CPU s", flush=True)  # fmt: skip


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "parent1"
    row_counts = [int(m) for m in (sys.argv[2] if len(sys.argv) > 2 else "7,1").split(",")]
    threads = torch.get_num_threads()
    if mode == "parent1":
        torch.set_num_threads(1)
        run("parent (1 thread)", row_counts)
        torch.set_num_threads(threads)
    elif mode == "parentN":
        run(f"parent ({threads} threads)", row_counts)
    for child_rows in (row_counts, [13], [1]):
        pid = os.fork()
        if pid == 0:
            run(f"child ({torch.get_num_threads()} threads)", child_rows)
            os._exit(0)
        os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
