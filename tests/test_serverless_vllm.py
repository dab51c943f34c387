"""Serverless with real vLLM: an endpoint at zero answers its first call after a cold start,
goes back to zero after its idle timeout, and wakes again."""

from __future__ import annotations

import time

import httpx
import pytest

from billing.models import UsageRecord
from endpoints.models import Endpoint, EndpointEvent, Replica
from tests.conftest import start_celery_beat, wait_until
from tests.test_platform_vllm import FAST, MESSAGES, platform  # noqa: F401 - the fixture

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

IDLE_TIMEOUT_S = 5
# Scale to zero lands within the idle timeout plus this. NOTE: issue #17's goal is 5 s
# (bench/bench_scale_to_zero.py measures it); on a 2-core machine saturated by parallel runs (load ~30)
# this test saw 12.2 and 12.8 s after the last request, so it asserts 10 s, down from 30.
SCALE_TO_ZERO_SLACK_S = 10


def test_scales_from_zero_for_a_held_request_back_to_zero_when_idle_and_wakes_again(platform, tiny_model_dir, tmp_path):  # noqa: F811
    beat = start_celery_beat(tmp_path, extra_env=FAST)
    try:
        platform.add_agent("cpu-node-1")
        created = platform.api.post("/api/v1/endpoints/", json={
            "name": "sleepy", "model_source": str(tiny_model_dir), "gpu_type": "cpu", "min_replicas": 0,
            "max_replicas": 1, "max_model_len": 512, "max_num_seqs": 8, "cold_start_timeout_s": 300,
        }).json()
        # NOTE: the API's floor for idle_timeout_s is 30 s; a test may go lower.
        Endpoint.objects.filter(pk=created["id"]).update(idle_timeout_s=IDLE_TIMEOUT_S)
        time.sleep(3)
        assert not Replica.objects.filter(endpoint_id=created["id"]).exists(), "nothing runs before the first call"

        # The first call is held through the cold start; a streaming client sees progress comments.
        comments, text, usage = [], "", None
        with httpx.stream("POST", f"{platform.url}/v1/chat/completions", timeout=330,
                          headers={"Authorization": f"Bearer {platform.api_key}"},
                          json={"model": "sleepy", "messages": MESSAGES, "max_tokens": 6, "stream": True,
                                "stream_options": {"include_usage": True}}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith(": "):
                    comments.append(line[2:])
                elif line.startswith("data: {"):
                    import json

                    chunk = json.loads(line[6:])
                    if chunk.get("choices"):
                        text += chunk["choices"][0]["delta"].get("content") or ""
                    if chunk.get("usage"):
                        usage = chunk["usage"]
        last_request_at = time.monotonic()  # the last request's end: the idle timeout counts from here
        assert comments and comments[0] == "scheduling", comments
        assert any(c.startswith("starting engine") or c.startswith("loading weights") for c in comments), comments
        assert usage and usage["completion_tokens"] >= 1
        row = wait_until(lambda: UsageRecord.objects.filter(endpoint_id=created["id"]).first(), 15, message="usage row")
        assert row.cold_start_s > 1 and row.completion_tokens == usage["completion_tokens"]
        assert EndpointEvent.objects.filter(endpoint_id=created["id"], kind="cold_start").exists()

        # Idle: back to zero replicas (none serving nor draining, from the API's view) within the idle
        # timeout plus the slack: the scale-down is scheduled for the idle deadline, not the next tick.
        wait_until(lambda: not Replica.objects.filter(endpoint_id=created["id"], state__in=["PENDING", "STARTING", "READY", "DRAINING"]).exists(),
                   IDLE_TIMEOUT_S + 60, interval_s=0.1, message="zero replicas")
        zero_after_s = time.monotonic() - last_request_at
        assert zero_after_s <= IDLE_TIMEOUT_S + SCALE_TO_ZERO_SLACK_S, f"zero replicas {zero_after_s:.1f} s after the last request"
        assert platform.api.get(f"/api/v1/endpoints/{created['id']}/").json()["state"] == "SCALED_TO_ZERO"

        # And it wakes again for a plain (non-streaming) call.
        answer = httpx.post(f"{platform.url}/v1/chat/completions", timeout=330, headers={"Authorization": f"Bearer {platform.api_key}"},
                            json={"model": "sleepy", "messages": MESSAGES, "max_tokens": 3})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] >= 1
    finally:
        beat.stop()
