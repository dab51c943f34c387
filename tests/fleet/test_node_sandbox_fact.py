"""A node's `engine_sandbox` fact reaches the control plane in every heartbeat, not only at registration.

Before, the fact was sent once, when the agent registered; since the agent tests namespaces again while it runs
(`sandbox.NamespacesFact`), the node's fact changed on the agent and operators (the fleet page, the admin) kept
reading the registered one: a node whose engines lost their namespaces still said "own pid, mount and user
namespaces".
"""

from __future__ import annotations

import json
from datetime import timedelta

import httpx
import pytest
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections, connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.accounts.models import AuditEvent
from controlplane.accounts.services import SYSTEM
from endpoints.fleet.services import create_join_token
from endpoints.nodes.models import Node
from gpu_agent.protocol import MAX_ENGINE_SANDBOX_CHARS
from gpu_agent.runtime import namespaces, sandbox
from gpu_agent.runtime.agent import Agent
from gpu_agent.runtime.config import AgentConfig

pytestmark = pytest.mark.django_db

REFUSED = "unshare refused (EPERM)"
REGISTRATION = {
    "name": "gpu-1", "gpu_type": "cpu", "num_gpus": 0, "gpu_memory_mb": 8192, "num_cpus": 2, "memory_mb": 24000,
    "agent_version": "0.1.0", "engine_sandbox": "landlock abi 7; own pid, mount and user namespaces",
}


@pytest.fixture
def in_process_control_plane():
    """The control plane's WSGI application, served in the test's thread and transaction (as Django's test client
    does: its per-request connection handling would close the test's connection)."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield httpx.WSGITransport(app=get_wsgi_application())
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def kernel(monkeypatch):
    """What this node's kernel answers the agent's test of namespaces: `kernel["missing"]`, "" where they work.

    NOTE: the one stand-in here: a kernel that refuses namespaces after it gave them cannot be made on demand. The
    agent's fact (`NamespacesFact`, its re-test included) and everything after it are the real ones."""
    answer = {"missing": ""}
    monkeypatch.setattr(namespaces, "find", lambda: namespaces.Finding(missing=answer["missing"]))
    monkeypatch.setattr(sandbox, "NAMESPACES", sandbox.NamespacesFact(attempt_pause_s=0.0))
    return answer


def test_an_agents_namespaces_lost_after_it_registered_reach_its_node_at_the_next_heartbeat(
    in_process_control_plane, kernel, tmp_path
):
    token = create_join_token(SYSTEM, name="rack").plain
    config = AgentConfig(control_plane_url="http://testserver", join_token=token, data_dir=tmp_path / "agent",
                         force_cpu=True)
    agent = Agent(config, transport=in_process_control_plane)  # starts no engine: nothing is placed on it
    try:
        agent.heartbeat_once()  # registers, then beats
        node = Node.objects.get()
        landlock = node.engine_sandbox.split("; ")[0]
        assert node.engine_sandbox == f"{landlock}; own pid, mount and user namespaces"

        kernel["missing"] = REFUSED
        sandbox.NAMESPACES.retest()  # as after an engine's exit 79: every attempt finds the kernel refusing
        agent.heartbeat_once()
        node.refresh_from_db()
        assert node.engine_sandbox == f"{landlock}; no namespaces: {REFUSED}"
        weakened = AuditEvent.objects.get(action="node.sandbox_weakened", target_id=str(node.pk))
        assert weakened.details["engine_sandbox"] == node.engine_sandbox

        kernel["missing"] = ""
        sandbox.NAMESPACES.retest()  # the re-test of a missing fact, 5 minutes later: the node recovered
        agent.heartbeat_once()
        node.refresh_from_db()
        assert node.engine_sandbox == f"{landlock}; own pid, mount and user namespaces"
        assert AuditEvent.objects.filter(action="node.sandbox_weakened").count() == 1  # a recovery is no weakening
    finally:
        agent.shutdown()


@pytest.fixture
def node_secret(client):
    token = create_join_token(SYSTEM, name="test").plain
    answer = client.post("/agent/v1/register", REGISTRATION | {"join_token": token}, content_type="application/json")
    return answer.json()["node_secret"]


def beat(client, secret, **changes):
    body = {"agent_version": "0.1.0", "num_cpus": 2, "memory_mb": 24000, "memory_used_mb": 1} | changes
    return client.post("/agent/v1/heartbeat", json.dumps(body), content_type="application/json",
                       HTTP_AUTHORIZATION=f"Bearer {secret}")


HOSTILE_FACTS = {
    "10 KB": ("x" * 10_000, f"engine_sandbox must be at most {MAX_ENGINE_SANDBOX_CHARS} characters"),
    "one past the cap": ("x" * (MAX_ENGINE_SANDBOX_CHARS + 1), "engine_sandbox must be at most"),
    "a control character": ("landlock abi 7\x1b[2J; own pid", "engine_sandbox must hold no control characters"),
    "a NUL": ("landlock abi 7\x00", "engine_sandbox must hold no control characters"),
    "a forged log line": ("none: x\nnode ok", "engine_sandbox must hold no control characters"),
    "a number": (7, "engine_sandbox: must be a string"),
}


@pytest.mark.parametrize("case", HOSTILE_FACTS)
def test_a_heartbeat_with_a_hostile_sandbox_fact_is_a_400_naming_it_and_nothing_is_stored(client, node_secret, case):
    fact, message = HOSTILE_FACTS[case]
    before = Node.objects.values().get()
    response = beat(client, node_secret, engine_sandbox=fact)
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.content[:300]
    assert Node.objects.values().get() == before


def test_a_fact_that_did_not_change_is_not_written_again_and_an_older_agents_silence_keeps_it(client, node_secret):
    weaker = "landlock abi 7; no namespaces: unshare refused (EPERM)"
    with CaptureQueriesContext(connection) as changed:
        assert beat(client, node_secret, engine_sandbox=weaker).status_code == 200
    assert [q for q in changed.captured_queries if q["sql"].startswith("UPDATE") and "engine_sandbox" in q["sql"]]
    assert Node.objects.get().engine_sandbox == weaker
    for _ in range(3):
        with CaptureQueriesContext(connection) as same:
            assert beat(client, node_secret, engine_sandbox=weaker).status_code == 200
        assert not [q for q in same.captured_queries if "engine_sandbox" in q["sql"] and not q["sql"].startswith("SELECT")]
    assert beat(client, node_secret).status_code == 200  # an agent older than the field says nothing of it
    node = Node.objects.get()
    assert node.engine_sandbox == weaker and "engine_sandbox" not in node.last_status
    assert AuditEvent.objects.filter(action="node.sandbox_weakened").count() == 1  # once, not per beat


def test_a_node_alternating_its_sandbox_fact_or_its_gpus_writes_one_audit_row_an_hour(client, node_secret):
    """A machine holding a node's secret flips its facts every heartbeat (nothing rate-limits heartbeats)."""
    facts = [REGISTRATION["engine_sandbox"], "none: the kernel has no Landlock (ENOSYS); no namespaces: gone"]
    too_many = [[{"index": index, "uuid": f"GPU-{index:04d}", "name": "NVIDIA L4", "utilization_percent": 0.0,
                  "memory_used_mb": 0, "memory_total_mb": 23_034} for index in range(count)] for count in (40, 50)]
    for number in range(40):
        assert beat(client, node_secret, engine_sandbox=facts[number % 2], gpus=too_many[number % 2]).status_code == 200
    # Before: 20 rows of each (one a weakening, one a new list ignored), without end; the log still says each.
    assert AuditEvent.objects.filter(action="node.sandbox_weakened").count() == 1
    assert AuditEvent.objects.filter(action="node.gpus_ignored").count() == 2  # each list once an hour
    AuditEvent.objects.update(created_at=timezone.now() - timedelta(minutes=61))
    for number in range(2):
        assert beat(client, node_secret, engine_sandbox=facts[number % 2], gpus=too_many[number % 2]).status_code == 200
    assert AuditEvent.objects.filter(action="node.sandbox_weakened").count() == 2  # an hour on, again


def test_a_sandbox_weakened_again_or_other_gpus_ignored_within_the_hour_are_audited(client, node_secret):
    """Before: one row of each action a node an hour, whatever it said: Landlock turned off right after the namespaces
    were lost left no row naming it."""
    mild = "landlock abi 7; no namespaces: unshare refused (EPERM)"
    worst = "none: sandbox turned off; no namespaces: unshare refused (EPERM)"
    assert beat(client, node_secret, engine_sandbox=mild).status_code == 200
    assert beat(client, node_secret, engine_sandbox=worst).status_code == 200
    facts = AuditEvent.objects.filter(action="node.sandbox_weakened").order_by("created_at")
    assert [row.details["engine_sandbox"] for row in facts] == [mild, worst]
    for fact in (mild, REGISTRATION["engine_sandbox"], worst, mild, worst):  # no gap not audited within the hour
        assert beat(client, node_secret, engine_sandbox=fact).status_code == 200
    assert AuditEvent.objects.filter(action="node.sandbox_weakened").count() == 2
    gpus = [[{"index": index, "uuid": f"GPU-{index:04d}", "name": "NVIDIA L4", "utilization_percent": 0.0,
              "memory_used_mb": 0, "memory_total_mb": 23_034} for index in range(count)] for count in range(10, 20)]
    for listed in gpus:
        assert beat(client, node_secret, gpus=listed).status_code == 200
    ignored = AuditEvent.objects.filter(action="node.gpus_ignored").order_by("created_at")
    assert [row.details["reason"][:2] for row in ignored] == ["10", "11", "12", "13", "14"]  # MAX_NODE_REPORTS_AUDITED
