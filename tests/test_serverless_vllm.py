"""Serverless with real vLLM: an endpoint at zero answers its first call after a cold start,
goes back to zero after its idle timeout, and wakes again.

Scale to zero is timed from the end of the last request, as a client sees it, and split (printed, and
in the assertion messages) into: the idle deadline (the gateway's last-request time plus the timeout),
the scale-down decision (its event), the agent's SIGTERM and the engine's exit (the agent's log), and
the control plane hearing STOPPED (`Replica.stopped_at`, where the GPU-seconds counted end).
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime

import httpx
import pytest

from billing import cost_truth
from billing.models import UsageRecord
from controlplane import redis_keys
from controlplane.redis_client import get_redis
from endpoints.models import Endpoint, EndpointEvent, Replica
from tests.conftest import start_celery_beat, vllm_processes_of, wait_until
from tests.test_platform_vllm import FAST, MESSAGES, platform  # noqa: F401 - the fixture

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

# NOTE: nothing after the first call's end needs its replica (the checks read rows, Redis and logs), so the idle
# timeout is only waited out: 3 s, not 5, with the slack below unchanged.
IDLE_TIMEOUT_S = 3
# No replica serves (PENDING, STARTING, READY) later than the idle timeout plus this after the last
# request's end: issue #17's goal.
SCALE_TO_ZERO_SLACK_S = 5
# The engine's processes are gone, and the control plane has it STOPPED (its GPU-seconds stop counting),
# at most this long after the scale-down decision. NOTE: the agent hears the drain at once (watch), sends
# SIGTERM to an idle engine without a drain wait and SIGKILL after `SupervisorPolicy.idle_stop_grace_s`
# (1 s), and reports STOPPED as soon as the exit is seen. Measured 0.7 to 1.2 s at load ~6 on this 2-core
# machine (README "Scale-to-zero precision"): about 1 s is capped by the grace, the rest is three local
# round trips (watch, heartbeat, report), and decision -> agent draining alone took 0.4 s at load ~30.
# So 4 s, not 1.5: loose enough for a loaded machine, far below the old SIGTERM -> SIGKILL of 15 s.
DECISION_TO_STOPPED_BOUND_S = 4
# NOTE: this cold start takes 10 to 25 s on a 2-core machine; CI once ran it beside a stall of minutes (a teardown
# of a trivial test took 217 s) and the 300 s default lapsed. The bound is for a hang, not for speed.
COLD_START_TIMEOUT_S = 600
STOPPED_LINE = re.compile(r"^(\S+ \S+) INFO gpu_agent\.runtime\.supervisor: replica (\S+) STOPPED: (.*)$", re.MULTILINE)


def test_scales_from_zero_for_a_held_request_back_to_zero_when_idle_and_wakes_again(platform, tiny_model_dir, tmp_path):  # noqa: F811
    beat = start_celery_beat(tmp_path, extra_env=FAST)
    try:
        platform.add_agent("cpu-node-1")
        created = platform.api.post("/api/v1/endpoints/", json={
            "name": "sleepy", "model_source": str(tiny_model_dir), "gpu_type": "cpu", "min_replicas": 0,
            "max_replicas": 1, "max_model_len": 512, "max_num_seqs": 8, "cold_start_timeout_s": COLD_START_TIMEOUT_S,
        }).json()
        # NOTE: the API's floor for idle_timeout_s is 30 s; a test may go lower.
        Endpoint.objects.filter(pk=created["id"]).update(idle_timeout_s=IDLE_TIMEOUT_S)
        time.sleep(3)
        assert not Replica.objects.filter(endpoint_id=created["id"]).exists(), "nothing runs before the first call"

        # The first call is held through the cold start; a streaming client sees progress comments.
        comments, text, usage, errors = [], "", None, []
        with httpx.stream("POST", f"{platform.url}/v1/chat/completions", timeout=COLD_START_TIMEOUT_S + 30,
                          headers={"Authorization": f"Bearer {platform.api_key}"},
                          json={"model": "sleepy", "messages": MESSAGES, "max_tokens": 6, "stream": True,
                                "stream_options": {"include_usage": True}}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith(": "):
                    comments.append(line[2:])
                elif line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("choices"):
                        text += chunk["choices"][0]["delta"].get("content") or ""
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    if chunk.get("error"):
                        errors.append(chunk["error"])
        last_request_at = time.time()  # the last request's end: the idle timeout counts from here
        assert comments and comments[0] == "scheduling", comments
        assert any(c.startswith("starting engine") or c.startswith("loading weights") for c in comments), comments
        if not (usage and usage["completion_tokens"] >= 1):  # NOTE: pytest.fail, as an assertion's message is cut short
            story = held_call_story(created["id"], comments, errors)
            pytest.fail(f"the held call got no answer: {json.dumps(story, default=str, indent=1)}")
        row = wait_until(lambda: UsageRecord.objects.filter(endpoint_id=created["id"]).first(), 15, message="usage row")
        assert row.cold_start_s > 1 and row.completion_tokens == usage["completion_tokens"]
        assert EndpointEvent.objects.filter(endpoint_id=created["id"], kind="cold_start").exists()

        # Idle: back to zero serving replicas within the idle timeout plus the slack (the scale-down is
        # scheduled for the idle deadline, not the next tick), then the engine gone and STOPPED soon after.
        replica = Replica.objects.get(endpoint_id=created["id"])
        serving = ["PENDING", "STARTING", "READY"]
        no_serving_at = stopped_at = None
        give_up_at = time.time() + IDLE_TIMEOUT_S + 60
        while stopped_at is None and time.time() < give_up_at:
            states = set(Replica.objects.filter(endpoint_id=created["id"]).values_list("state", flat=True))
            now = time.time()
            if no_serving_at is None and not states & set(serving):
                no_serving_at = now
            if not states & {*serving, "DRAINING"}:
                stopped_at = now
            time.sleep(0.05)
        assert stopped_at is not None, f"replicas still {states} a minute after the idle timeout"
        left_running = vllm_processes_of(str(replica.pk))  # the moment STOPPED is seen: nothing of the engine runs
        replica.refresh_from_db()
        split = scale_to_zero_split(replica, last_request_at, IDLE_TIMEOUT_S, (tmp_path / "cpu-node-1.log").read_text())
        split.update(no_serving_after_s=round(no_serving_at - last_request_at, 2), zero_after_s=round(stopped_at - last_request_at, 2))
        print(f"scale to zero: {json.dumps(split)}")
        assert replica.state == "STOPPED" and not left_running, (replica.state, left_running, split)
        assert split["no_serving_after_s"] <= IDLE_TIMEOUT_S + SCALE_TO_ZERO_SLACK_S, split
        assert split["decision_to_stopped_s"] <= DECISION_TO_STOPPED_BOUND_S, split
        assert platform.api.get(f"/api/v1/endpoints/{created['id']}/").json()["state"] == "SCALED_TO_ZERO"
        # What scale to zero means in money: requests are billed for their own seconds only (nothing after
        # the last one ends), and the GPU-seconds the platform counts for the replica end at its STOPPED.
        day = cost_truth.daily(Endpoint.objects.get(pk=created["id"]), start=replica.created_at.date(),
                               end=replica.stopped_at.date(), margin=True)[-1]
        held_s = (replica.stopped_at - replica.created_at).total_seconds() * (replica.gpu_memory_fraction or max(len(replica.gpu_indices), 1))
        assert abs(day["gpu_seconds_used"] - held_s) <= 0.1, (day, held_s)
        assert day["gpu_seconds_billed"] <= (row.finished_at - row.started_at).total_seconds() + 0.1, day

        # And it wakes again for a plain (non-streaming) call.
        answer = httpx.post(f"{platform.url}/v1/chat/completions", timeout=COLD_START_TIMEOUT_S + 30, headers={"Authorization": f"Bearer {platform.api_key}"},
                            json={"model": "sleepy", "messages": MESSAGES, "max_tokens": 3})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] >= 1
    finally:
        beat.stop()


def held_call_story(endpoint_id: str, comments: list[str], errors: list[dict]) -> dict:
    """What a held call that got no answer saw, and what its endpoint and replicas did meanwhile."""
    return {
        "comments": comments, "errors": errors,
        "events": [f"{event.created_at:%H:%M:%S.%f} {event.kind}: {event.message}"
                   for event in EndpointEvent.objects.filter(endpoint_id=endpoint_id).order_by("created_at")],
        "replicas": list(Replica.objects.filter(endpoint_id=endpoint_id).values(
            "state", "failure_reason", "progress", "num_restarts", "download_s", "engine_start_s", "created_at",
            "ready_at", "stopped_at")),
    }


def scale_to_zero_split(replica: Replica, last_request_end: float, idle_timeout_s: float, agent_log: str) -> dict:
    """Where the seconds between the last request's end and STOPPED went (wall-clock epoch seconds in)."""
    last_request = float(get_redis().get(redis_keys.last_request_key(replica.endpoint.organization_id, str(replica.endpoint_id))))
    deadline = last_request + idle_timeout_s
    decision = (EndpointEvent.objects.filter(endpoint_id=replica.endpoint_id, message__startswith="Scale down")
                .order_by("created_at").first())
    found = [m for m in STOPPED_LINE.finditer(agent_log) if m.group(2) == str(replica.pk)]
    agent = {}
    if found:
        seen_at = datetime.strptime(found[-1].group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        numbers = [float(n) for n in re.findall(r"([0-9.]+)s", found[-1].group(3))]
        agent = {"agent_drain_to_exit_seen_s": numbers[0], "agent_exit_seen_to_stopped_s": round(replica.stopped_at.timestamp() - seen_at, 2),
                 "agent_line": found[-1].group(3)}
    decision_at = decision.created_at.timestamp() if decision else None
    return {
        "last_request_end_to_deadline_s": round(deadline - last_request_end, 2),
        "deadline_to_decision_s": round(decision_at - deadline, 2) if decision_at else None,
        "decision_to_stopped_s": round(replica.stopped_at.timestamp() - decision_at, 2) if decision_at else None,
        **agent,
    }
