"""An engine alive but answering nothing (every process of it stopped, as SIGSTOP or a deadlock leaves it): its agent
kills it once it has been silent and idle for `hung_after_s` and restarts it, and the call waiting on it is answered
(a 502 in OpenAI's shape: the engine may have read it, so it is not sent elsewhere) and billed nothing, not held until
the gateway's read timeout (10 minutes; before, the agent noticed after 5)."""

import os
import signal
import threading
import time
from concurrent.futures import Future

import httpx
import pytest

from billing.models import UsageRecord
from gpu_agent.protocol import ReplicaSpec, ReplicaState
from tests.conftest import vllm_processes_of, wait_until
from tests.engines import stop_engine, wait_for_ready
from tests.gateway.conftest import ENGINE_CONTEXT, ENGINE_KEY, serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

HUNG_AFTER_S = 3.0
NAME = "hung-tiny"


@pytest.fixture
def hung_engine(engine_node, tiny_model_dir, monkeypatch):
    """An engine of its own on the test process's engine node (it is killed here: the shared one is not), its agent
    asking a READY engine's /health every second and taking one silent and idle for `HUNG_AFTER_S` for hung."""
    monkeypatch.setattr(engine_node.policy, "hung_after_s", HUNG_AFTER_S)
    monkeypatch.setattr(engine_node.policy, "ready_health_interval_s", 1.0)
    spec = ReplicaSpec(replica_id="hung-engine", endpoint_id=NAME, served_model_name=NAME,
                       model_source=str(tiny_model_dir), max_model_len=ENGINE_CONTEXT, max_num_seqs=4,
                       engine_api_key=ENGINE_KEY)
    engine_node.start(spec, tiny_model_dir)
    try:
        yield engine_node, wait_for_ready(engine_node, spec.replica_id)
    finally:
        for stopped in vllm_processes_of(spec.replica_id):
            stopped.resume()
        stop_engine(engine_node, spec.replica_id)


def _call_in_a_thread(gateway: str, key: str) -> Future:
    answer: Future = Future()

    def call():
        try:
            answer.set_result(httpx.post(
                f"{gateway}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                json={"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}, timeout=120))
        except Exception as error:  # noqa: BLE001 - handed to the test through the future
            answer.set_exception(error)

    threading.Thread(target=call, daemon=True).start()
    return answer


def test_a_hung_engine_is_killed_and_restarted_and_the_call_waiting_on_it_answered_unbilled(hung_engine, gateway,
                                                                                             tenant):
    node, replica = hung_engine
    serve_endpoint(tenant.org, replica.address, name=NAME, engine_key=ENGINE_KEY)
    restarts_before = replica.num_restarts
    for process in vllm_processes_of(replica.spec.replica_id):
        os.kill(process.pid, signal.SIGSTOP)
    hung_at = time.monotonic()
    answer = _call_in_a_thread(gateway, tenant.key)

    wait_until(lambda: node.poll() or replica.state != ReplicaState.READY, HUNG_AFTER_S + 15, interval_s=0.1,
               message="the hung engine to be killed")
    assert time.monotonic() - hung_at < HUNG_AFTER_S + 10
    assert replica.state == ReplicaState.STARTING and replica.num_restarts == restarts_before + 1
    assert "not healthy while READY" in replica.failure_reason

    response = answer.result(timeout=15)
    assert response.status_code == 502, response.text
    assert response.json()["error"]["type"] == "server_error"
    assert not UsageRecord.objects.filter(organization=tenant.org).exists()
