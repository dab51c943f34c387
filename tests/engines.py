"""Real vLLM engines for tests, started as the agent's supervisor starts them.

Every test process keeps one engine node (the session fixture `engine_node`, tests/conftest.py): an
agent's supervisor with its zygote, which imports vLLM once and forks each engine in about a second. The
shared chat engine (`vllm_engine`), the embedding and LoRA engines, the speculative engines and the
quantized one all start on it (`serve_engine`), so the suite pays one vLLM import per test process, not
one to three per engine. A plain `vllm serve` (no standby, no zygote) still runs where it is the subject
(tests/agent/test_vllm_replica.py); the standby's and the zygote's own tests keep their own agents.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpu_agent.protocol import ReplicaSpec, ReplicaState
from gpu_agent.runtime.supervisor import ManagedReplica, Supervisor, SupervisorPolicy
from tests.processes import wait_until

# The shared chat engine: its served name (an endpoint of this name routes to it), its key (it answers
# no other) and its context (the tiny model's own).
ENGINE_NAME = "tiny"
ENGINE_KEY = "key-of-the-gateway-tests-engine"
ENGINE_CONTEXT = 2048
# A quick restart after a crash, and a short wait for an engine that ignores SIGTERM.
NODE_POLICY = SupervisorPolicy(restart_backoff_s=0.5, stop_timeout_s=20)
ENGINE_TIMEOUT_S = 600


@contextmanager
def engine_node(data_dir: Path) -> Iterator[Supervisor]:
    """A supervisor with a zygote, on `data_dir`, driven by whoever polls it (the test's main thread:
    PR_SET_PDEATHSIG ties the zygote's life to the thread that spawned it). Its zygote spawns now, with
    this process's environment, not with whatever a test has patched in when its first engine starts."""
    node = Supervisor(data_dir, policy=NODE_POLICY, standby=True, zygote=True)
    node.standby.ensure()
    try:
        yield node
    finally:
        node.shutdown(timeout_s=30)


def wait_for_ready(node: Supervisor, replica_id: str, timeout_s: float = ENGINE_TIMEOUT_S) -> ManagedReplica:
    """Poll `node` until the replica is READY; a FAILED one fails the test at once, with its reason."""

    def ready():
        node.poll()
        replica = node.get(replica_id)
        if replica.state == ReplicaState.FAILED:
            raise AssertionError(f"engine {replica_id} FAILED: {replica.failure_reason}")
        return replica.state == ReplicaState.READY

    wait_until(ready, timeout_s, interval_s=0.1, message=f"engine {replica_id} to be READY")
    return node.get(replica_id)


def stop_engine(node: Supervisor, replica_id: str) -> None:
    """Drain the replica's engine, wait until it is gone and drop it from the node (the zygote stays)."""
    node.drain(replica_id, timeout_s=5)

    def stopped():
        node.poll()
        return node.get(replica_id).is_final

    wait_until(stopped, 60, message=f"engine {replica_id} to stop")
    node.forget(replica_id)


@contextmanager
def serve_engine(node: Supervisor, spec: ReplicaSpec, model_dir: Path) -> Iterator[ManagedReplica]:
    """Start `spec` on `model_dir` on the node; yield the replica once READY; stop it."""
    node.start(spec, model_dir)
    try:
        yield wait_for_ready(node, spec.replica_id)
    finally:
        stop_engine(node, spec.replica_id)


def tiny_model_copy(tiny_model_dir: Path, into: Path, changes: dict[str, dict] | None = None) -> Path:
    """A copy of the tiny model at `into`/model, each JSON file named in `changes` (`"tokenizer.json"`) updated with
    the fields given for it."""
    copy = into / "model"
    shutil.copytree(tiny_model_dir, copy)
    for name, fields in (changes or {}).items():
        path = copy / name
        path.write_text(json.dumps(json.loads(path.read_text()) | fields))
    return copy


@contextmanager
def serve_small_engine(node: Supervisor, served_model_name: str, model_dir: Path, engine_api_key: str,
                       max_model_len: int = ENGINE_CONTEXT) -> Iterator[str]:
    """A four-sequence engine of `model_dir` of its own, answering `served_model_name`; yields its address."""
    spec = ReplicaSpec(replica_id=f"{served_model_name}-engine", endpoint_id=served_model_name,
                       served_model_name=served_model_name, model_source=str(model_dir), max_model_len=max_model_len,
                       max_num_seqs=4, engine_api_key=engine_api_key)
    with serve_engine(node, spec, model_dir) as replica:
        yield replica.address


def shared_engine_spec(model_dir: Path) -> ReplicaSpec:
    """The shared chat engine: what every module using it needs (the tiny model's whole context,
    prefix caching, the `hermes` tool-call parser)."""
    return ReplicaSpec(replica_id="gateway-tests-engine", endpoint_id="gateway-tests", served_model_name=ENGINE_NAME,
                       model_source=str(model_dir), max_model_len=ENGINE_CONTEXT, max_num_seqs=16,
                       enable_prefix_caching=True, engine_api_key=ENGINE_KEY, tool_call_parser="hermes")
