"""What an agent is told at start: where the control plane is, its join token, its data dir and limits.

`AgentConfig` is filled from the command line (`cli.py`) or by a test, and read by the agent's
parts (`agent`, `control_plane`); nothing changes it after start.
"""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass
from pathlib import Path

from gpu_agent.protocol import DEFAULT_ENGINE_PORT_MAX, DEFAULT_ENGINE_PORT_MIN
from gpu_agent.runtime import engine, sandbox
from gpu_agent.runtime.engine_disk import EngineDiskBounds
from gpu_agent.runtime.weights import DEFAULT_ADAPTER_MAX_BYTES, DEFAULT_PRIVATE_WEIGHTS_GRACE_S


@dataclass(slots=True)
class AgentConfig:
    control_plane_url: str
    join_token: str
    data_dir: Path
    name: str = ""
    force_cpu: bool = False
    weights_budget_bytes: int | None = None
    # The share of the weights disk no download takes (`WeightsCache.disk_reserve_fraction`).
    weights_disk_reserve_fraction: float = 0.0
    # The most an adapter's files may take (`WeightsCache.fetch_adapter`; None: no bound).
    adapter_max_bytes: int | None = DEFAULT_ADAPTER_MAX_BYTES
    s3_endpoint_url: str | None = None
    # How long an organisation's own cached weights no desired replica names stay (`WeightsCache.release_unwanted`).
    private_weights_grace_s: float = DEFAULT_PRIVATE_WEIGHTS_GRACE_S
    request_timeout_s: float = 10.0
    min_backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    cpu_kv_cache_gib: int = engine.DEFAULT_CPU_KV_CACHE_GIB
    # The address the gateway uses to reach this node's engines (the pod or host IP on a fleet).
    # Engines listen on exactly this address, never on every interface.
    advertise_host: str = "127.0.0.1"
    # The ports engines may use; registered with the node, which accepts no address outside them.
    engine_ports: tuple[int, int] = (DEFAULT_ENGINE_PORT_MIN, DEFAULT_ENGINE_PORT_MAX)
    # Leave engines running when the agent exits (agent upgrades): no PR_SET_PDEATHSIG, and the
    # next agent on this data dir adopts them. Off by default: an exiting agent stops its engines.
    keep_engines_on_exit: bool = False
    # Keep a warm standby engine process (vLLM already imported) for fast cold starts.
    # Off here so library users and tests opt in; the `run` command turns it on.
    standby: bool = False
    # With the standby on: a fork server (zygote.py) that forks every replica's engine, so concurrent
    # cold starts never wait for a refill; off, the one-shot standby that becomes the engine itself.
    zygote: bool = True
    # The slowest a store may send each part of a download (`weights_transfer.TransferSettings.min_bytes_per_s`).
    min_download_bytes_per_s: int = 64 * 1024
    # What confines each engine (`sandbox.py`): where Landlock is missing, `best-effort` starts engines unconfined
    # (said in their logs and the node's facts), `required` fails their replicas, `off` confines none.
    engine_sandbox: sandbox.SandboxMode = sandbox.DEFAULT_MODE
    # What engines may keep on the disk (`engine_disk.py`): each live engine's folders, and the endpoints' caches.
    engine_disk: EngineDiskBounds = EngineDiskBounds()

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).resolve()
        self.control_plane_url = self.control_plane_url.rstrip("/")
        if not self.name:
            self.name = socket.gethostname()[:128]

    def backoff_s(self, num_failures: int) -> float:
        """How long to wait after `num_failures` failed calls to the control plane in a row."""
        ceiling = min(self.max_backoff_s, self.min_backoff_s * 2 ** (num_failures - 1))
        return random.uniform(ceiling / 2, ceiling)  # jitter: a fleet must not retry in lockstep
