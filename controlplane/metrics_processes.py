"""Prometheus metrics kept by several processes of a pod, and who may read them.

A web pod runs several gateway processes (`controlplane.serve`); a worker pod, a Celery main process and the prefork
children that run its tasks (`controlplane.worker_metrics`). Each process keeps its counters in files of one folder
(prometheus_client's multiprocess mode, `PROMETHEUS_MULTIPROC_DIR`), and a scrape, answered by any one of them, reports
their sums (`multiprocess_registry`). The folder is emptied at each start of the pod's main process, before any other
process writes there (`prepare_metrics_dir`), so a restarted container never adds a previous run's counts or gauges.

Either `/metrics` is read only with `Authorization: Bearer <INFERPLANE_METRICS_TOKEN>` (`token_granted`): it lists
every tenant's endpoints and traffic.

NOTE: prometheus_client reads `PROMETHEUS_MULTIPROC_DIR` once, when it is first imported, and `prepare_metrics_dir`
must run before that: this module imports prometheus_client only inside the functions that scrape.
"""

from __future__ import annotations

import atexit
import glob
import hmac
import os
import shutil
import tempfile
from pathlib import Path


def prepare_metrics_dir(num_processes: int, environ: dict[str, str] = os.environ) -> Path | None:
    """An empty `PROMETHEUS_MULTIPROC_DIR` for the processes started after, set in `environ`; None for one process
    without it."""
    configured = (environ.get("PROMETHEUS_MULTIPROC_DIR") or "").strip()
    if not configured and num_processes == 1:
        return None
    if configured:
        directory = Path(configured)
        if directory.is_dir():
            # NOTE: emptied, not removed: in a pod it may be the mount point of an emptyDir volume.
            for entry in directory.iterdir():
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        directory.mkdir(parents=True, exist_ok=True)
    else:
        directory = Path(tempfile.mkdtemp(prefix="inferplane-metrics-"))
        atexit.register(shutil.rmtree, directory, True)
    environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    return directory


def token_granted(authorization: bytes, token: str) -> bool:
    """Whether an `Authorization` header's value is `Bearer <token>` (compared in constant time); never without a
    token."""
    keyword, _, presented = authorization.partition(b" ")
    return bool(token) and keyword.lower() == b"bearer" and hmac.compare_digest(presented.strip(), token.encode())


def forget_dead_processes(directory: str) -> None:
    """Drop the live gauges of processes that are gone (a process killed without its shutdown)."""
    from prometheus_client.multiprocess import mark_process_dead

    for path in glob.glob(os.path.join(directory, "gauge_live*_*.db")):
        pid = int(path.rsplit("_", 1)[1].removesuffix(".db"))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            mark_process_dead(pid, directory)
        except PermissionError:
            pass  # alive, someone else's


def multiprocess_registry(directory: str):
    """A registry of what every process of the pod wrote into `directory`, read at each scrape."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, directory)
    return registry
