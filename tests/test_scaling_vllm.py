"""Autoscaling and node failure with real agents and real vLLM engines."""

from __future__ import annotations

import signal
import threading

import httpx
import pytest

from endpoints.models import Endpoint, Replica
from endpoints.nodes.models import Node
from tests.conftest import start_celery_beat, start_celery_worker, vllm_processes_of, wait_until
from tests.test_platform_vllm import FAST, MESSAGES, platform  # noqa: F401 - the fixture

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

# NOTE: the sweep may wait behind the worker's other tasks here: past 20 s that is a gap, after which agents get
# INFERPLANE_NODE_HEARTBEAT_RETRY_S to beat again (70 s by default, more than this test waits for).
# The stable window is waited out once, after the burst (its callers keep three calls in flight until then, above the
# two of one replica's target): 3 s, not 5.
SCHEDULER_ENV = FAST | {"INFERPLANE_AUTOSCALER_STABLE_WINDOW_S": "3", "INFERPLANE_NODE_HEARTBEAT_GRACE_S": "4",
                        "INFERPLANE_NODE_HEARTBEAT_RETRY_S": "2"}


def active(endpoint_id: str, state: str | None = None) -> int:
    replicas = Replica.objects.filter(endpoint_id=endpoint_id)
    return replicas.filter(state=state).count() if state else replicas.filter(state__in=["PENDING", "STARTING", "READY", "DRAINING"]).count()


def test_a_burst_scales_one_to_two_replicas_and_back(platform, tiny_model_dir, tmp_path):  # noqa: F811
    worker = start_celery_worker(tmp_path, name="scheduler-worker", extra_env=SCHEDULER_ENV)
    beat = start_celery_beat(tmp_path, extra_env=SCHEDULER_ENV)
    stop = threading.Event()
    try:
        platform.add_agent("cpu-node-1")
        endpoint = platform.api.post("/api/v1/endpoints/", json={
            # NOTE: two replicas, not more: on two cores each extra engine competes with the one serving the burst.
            "name": "bursty", "model_source": str(tiny_model_dir), "gpu_type": "cpu", "min_replicas": 1, "max_replicas": 2,
            "target_concurrency": 2, "max_model_len": 1024, "max_num_seqs": 8,
        }).json()
        wait_until(lambda: active(endpoint["id"], "READY") == 1, 240, interval_s=0.5, message="the first replica")

        def caller():
            with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {platform.api_key}"}) as client:
                while not stop.is_set():
                    client.post(f"{platform.url}/v1/completions",
                                json={"model": "bursty", "prompt": "Go", "max_tokens": 200, "ignore_eos": True})

        threads = [threading.Thread(target=caller, daemon=True) for _ in range(3)]
        for thread in threads:
            thread.start()
        wait_until(lambda: active(endpoint["id"], "READY") == 2, 420, interval_s=0.5, message="two READY replicas")
        stop.set()
        for thread in threads:
            thread.join(120)
        # No request in flight: after the stable window it falls back to min_replicas, draining the rest.
        wait_until(lambda: active(endpoint["id"]) == 1, 120, interval_s=0.5, message="back to one replica")
        assert Replica.objects.filter(endpoint_id=endpoint["id"], state="STOPPED").count() == 1
    finally:
        stop.set()
        beat.stop()
        worker.stop()


def test_a_killed_agents_node_goes_offline_and_another_agent_takes_its_replica(platform, tiny_model_dir, tmp_path):  # noqa: F811
    worker = start_celery_worker(tmp_path, name="scheduler-worker", extra_env=SCHEDULER_ENV)
    beat = start_celery_beat(tmp_path, extra_env=SCHEDULER_ENV)
    try:
        first = platform.add_agent("cpu-node-1")
        endpoint = platform.api.post("/api/v1/endpoints/", json={
            "name": "sturdy", "model_source": str(tiny_model_dir), "gpu_type": "cpu", "min_replicas": 1, "max_replicas": 1,
            "max_model_len": 512, "max_num_seqs": 4,
        }).json()
        doomed = wait_until(lambda: Replica.objects.filter(endpoint_id=endpoint["id"], state="READY").first(), 240, interval_s=0.5,
                            message="a READY replica")
        platform.add_agent("cpu-node-2")
        first.process.send_signal(signal.SIGKILL)  # the agent alone; its engines must not outlive it
        wait_until(lambda: Node.objects.get(name="cpu-node-1").state == "OFFLINE", 120, interval_s=0.5,
                   message="OFFLINE (the heartbeat grace is 4 s; the sweep waits behind the worker's other tasks)")
        doomed.refresh_from_db()
        assert doomed.state == "FAILED" and "heartbeats" in doomed.failure_reason
        wait_until(lambda: not vllm_processes_of(str(doomed.pk)), 30, message="the dead agent's engine to exit")
        replacement = wait_until(lambda: Replica.objects.filter(endpoint_id=endpoint["id"], state="READY").first(), 240,
                                 interval_s=0.5, message="a replacement")
        assert replacement.node.name == "cpu-node-2"
        answer = platform.openai().chat.completions.create(model="sturdy", messages=MESSAGES, max_tokens=2)
        assert answer.usage.completion_tokens >= 1
        assert Endpoint.objects.get(pk=endpoint["id"]).status_message == ""
    finally:
        beat.stop()
        worker.stop()
