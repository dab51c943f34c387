"""The web process: N uvicorn workers of the ASGI application sharing one port.

    python -m controlplane.serve --host 0.0.0.0 --port 8000 [other uvicorn options]

`WEB_CONCURRENCY` workers (default: one per core this process may use, its CPU affinity and its
cgroup's CPU limit, v2 or v1, both counted) accept on the same socket. Each is a whole gateway: its own event
loop, caches and ledger writer; limits, spend and usage are exact across them because they live in
Redis and PostgreSQL, never in a process (README, "Warm call").

With more than one worker, Prometheus counters live in files shared by the workers
(`PROMETHEUS_MULTIPROC_DIR`, prometheus_client's multiprocess mode): `/metrics`, whichever worker
answers it, reports their sums (`endpoints/gateway/metrics.py`). The folder is emptied here
(`controlplane.metrics_processes.prepare_metrics_dir`), before
any worker starts, so a restarted container never adds a previous run's counts or gauges. Without
the variable a private folder is made under the temporary directory and removed on exit.

glibc's malloc serves the process's threads from at most `MALLOC_ARENA_MAX` arenas (2 unless the environment names
its own, `limit_malloc_arenas`): every Django request runs in a thread of its own, and glibc gave those threads up to
8 arenas per core, each keeping the free space of its busiest moment (README, "The web process's memory").

uvicorn's access line is off unless `--access-log` is passed: the application writes its own
(`controlplane.access_log`), and none on an inference call, which has the gateway's request line. uvicorn's graceful
wait after the gateway's drain is `GRACEFUL_SHUTDOWN_S` unless `--timeout-graceful-shutdown` is passed. No `server`
header names uvicorn unless `--server-header` is passed.

NOTE: uvicorn (uvloop, httptools), not granian: granian cost the gateway more CPU per request, not less,
measured side by side (`bench/results/gateway_profile.md`, round 4).

NOTE: this module reads its two variables itself rather than through `controlplane.env`: it runs
before Django, and only in the web process, so they are not settings every process must receive.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import sys
from pathlib import Path

import uvicorn

from controlplane.metrics_processes import prepare_metrics_dir

APPLICATION = "controlplane.asgi:application"
GRACEFUL_SHUTDOWN_S = 10  # unless `--timeout-graceful-shutdown` is passed (infra/k8s/base/web.yaml passes the same)
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>", or "max <period>"
# cgroup v1 (nodes and Docker hosts still on it): the same limit in two files, quota -1 for none.
CGROUP_V1_CPU_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_CPU_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
# glibc malloc's arenas for the process's threads, unless `MALLOC_ARENA_MAX` is set (`limit_malloc_arenas`).
MALLOC_ARENA_MAX = 2
M_ARENA_MAX = -8  # glibc's `mallopt` parameter for it (malloc.h)


def cgroup_cpu_limit() -> float | None:
    """The container's CPU limit in cores (a pod's `limits.cpu`), from cgroup v2 or v1; None without one."""
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota, period = CGROUP_V1_CPU_QUOTA.read_text().strip(), CGROUP_V1_CPU_PERIOD.read_text().strip()
        except OSError:
            return None
    if quota == "max" or not quota.lstrip("-").isdigit() or int(quota) <= 0 or not period.isdigit() or int(period) <= 0:
        return None
    return int(quota) / int(period)


def available_cores() -> int:
    """Cores this process may run on: its affinity, capped by the container's CPU limit."""
    cores = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit()
    return cores if limit is None else max(1, min(cores, math.ceil(limit)))


def num_workers(environ: dict[str, str] = os.environ) -> int:
    raw = (environ.get("WEB_CONCURRENCY") or "").strip()
    if not raw:
        return available_cores()
    if not raw.isdigit() or int(raw) < 1:
        raise SystemExit(f"WEB_CONCURRENCY must be a whole number of worker processes (1 or more), not {raw!r}")
    return int(raw)


def limit_malloc_arenas(environ: dict[str, str] = os.environ) -> None:
    """At most `MALLOC_ARENA_MAX` glibc malloc arenas in this process and the workers it starts, unless the
    environment already names a number (glibc read it as the process started; the workers inherit it).

    NOTE: a Django request's synchronous code runs in a thread of its own (asgiref's `ThreadSensitiveContext`), and
    glibc gives a new thread an arena of its own while fewer than 8 per core exist (16 on 2 cores after 72 requests,
    24 at a time), each keeping the free space of its busiest moment: the process's RSS climbed ~0.35 KB a request
    over its first 10,000 before it settled, higher the more cores; from request 4,000 to 9,500 it grew ~0.19 KB a
    request, ~0.05 with 2 arenas (README, "The web process's memory")."""
    if (environ.get("MALLOC_ARENA_MAX") or "").strip():
        return
    environ["MALLOC_ARENA_MAX"] = str(MALLOC_ARENA_MAX)  # read by glibc as each spawned worker starts
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:  # this process, which serves itself with one worker: no thread has an arena yet
        mallopt(M_ARENA_MAX, MALLOC_ARENA_MAX)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `--workers` on the command line wins over WEB_CONCURRENCY, as for uvicorn itself.
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--workers", type=int)
    known, uvicorn_args = parser.parse_known_args(argv)
    workers = known.workers if known.workers is not None else num_workers()
    limit_malloc_arenas()
    prepare_metrics_dir(workers)
    if not any(arg in ("--access-log", "--no-access-log") for arg in uvicorn_args):
        # The application writes its own access lines (`controlplane.access_log`); uvicorn's cost the
        # gateway ~150-300 us of CPU per inference call and repeated the gateway's own request line.
        uvicorn_args.append("--no-access-log")
    if not any(arg.startswith("--timeout-graceful-shutdown") for arg in uvicorn_args):
        # NOTE: what is left after the gateway's own drain of its inference calls (`endpoints.gateway.drain`):
        # uploads and console requests. uvicorn's default waits for them for ever, until the pod's SIGKILL.
        uvicorn_args.append(f"--timeout-graceful-shutdown={GRACEFUL_SHUTDOWN_S}")
    if not any(arg in ("--server-header", "--no-server-header") for arg in uvicorn_args):
        # NOTE: `server: uvicorn` names the software to every caller (a scanner's first finding) and cost each
        # response a header's checks in uvicorn's `send`.
        uvicorn_args.append("--no-server-header")
    uvicorn.main([APPLICATION, "--workers", str(workers), *uvicorn_args])


if __name__ == "__main__":
    main()
