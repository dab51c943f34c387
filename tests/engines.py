"""Real vLLM engines for tests, started as the agent's supervisor starts them.

`serve_engine` is the one place a test fixture starts an engine outside an agent: the shared chat
engine (`vllm_engine`, tests/conftest.py) and the embedding engine (tests/gateway) both use it.
An engine takes most of a minute to start on two cores, so each starts once, from a warm standby
(one vLLM import, not three: about half the CPU of a plain start).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpu_agent.protocol import ReplicaSpec, ReplicaState
from gpu_agent.runtime.supervisor import Supervisor
from tests.processes import wait_until

# The shared chat engine: its served name (an endpoint of this name routes to it), its key (it answers
# no other) and its context (the tiny model's own).
ENGINE_NAME = "tiny"
ENGINE_KEY = "key-of-the-gateway-tests-engine"
ENGINE_CONTEXT = 2048


@contextmanager
def serve_engine(spec: ReplicaSpec, model_dir: Path, data_dir: Path, *, standby: bool = True) -> Iterator[str]:
    """Start `spec` on `model_dir` under a supervisor on `data_dir`; yield its address once READY; stop it."""
    supervisor = Supervisor(data_dir, standby=standby)
    supervisor.start(spec, model_dir)

    def ready():
        supervisor.poll()
        replica = supervisor.get(spec.replica_id)
        if replica.state == ReplicaState.FAILED:
            raise AssertionError(f"engine {spec.replica_id} FAILED: {replica.failure_reason}")
        return replica.state == ReplicaState.READY

    try:
        wait_until(ready, 600, message=f"engine {spec.replica_id} to be READY")
        yield supervisor.get(spec.replica_id).address
    finally:
        supervisor.shutdown(timeout_s=30)


def shared_engine_spec(model_dir: Path) -> ReplicaSpec:
    """The shared chat engine: what every module using it needs (the tiny model's whole context,
    prefix caching, the `hermes` tool-call parser)."""
    return ReplicaSpec(replica_id="gateway-tests-engine", endpoint_id="gateway-tests", served_model_name=ENGINE_NAME,
                       model_source=str(model_dir), max_model_len=ENGINE_CONTEXT, max_num_seqs=16,
                       enable_prefix_caching=True, engine_api_key=ENGINE_KEY, tool_call_parser="hermes")
