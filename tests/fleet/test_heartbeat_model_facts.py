"""A tenant's model files can never stop a node's heartbeats: what the agent reads of them goes out in every beat.

Before, a tokenizer.json holding a JSON-escaped lone surrogate ("\\ud800", in a Replace's content) was reported as it
was; httpx cannot encode such a body, so every heartbeat of the node failed before it was sent, the agent retried
forever and the node went offline with every tenant's replicas on it. Now such text makes the normalizer unknown
(the agent's reader and the protocol both), and a model's facts that still cannot be encoded are left out of the
beat, never the beat itself.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections

from controlplane.accounts.services import SYSTEM
from endpoints.fleet.services import create_join_token
from endpoints.nodes.models import Node
from gpu_agent.protocol import ModelInfo
from gpu_agent.runtime.agent import Agent
from gpu_agent.runtime.config import AgentConfig
from gpu_agent.runtime.model_info import ModelReading

pytestmark = pytest.mark.django_db

LONE_SURROGATE_REPLACE = '{"type": "Replace", "pattern": {"String": "a"}, "content": "\\ud800"}'


@pytest.fixture
def in_process_control_plane():
    """The control plane's WSGI application, served in the test's thread and transaction."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield httpx.WSGITransport(app=get_wsgi_application())
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def agent(in_process_control_plane, tmp_path):
    token = create_join_token(SYSTEM, name="rack").plain
    config = AgentConfig(
        control_plane_url="http://testserver", join_token=token, data_dir=tmp_path / "agent", force_cpu=True
    )
    agent = Agent(config, transport=in_process_control_plane)
    yield agent
    agent.shutdown()


def _reported(source: str) -> dict:
    weights = Node.objects.get().last_status["weights"]
    return next(status for status in weights if status["source"] == source)


def test_a_tokenizer_with_a_lone_surrogate_is_reported_unknown_and_the_node_keeps_beating(
    agent, tiny_model_dir, tmp_path
):
    model_dir = tmp_path / "tenant-model"
    shutil.copytree(tiny_model_dir, model_dir)
    path = model_dir / "tokenizer.json"
    text = json.dumps(json.loads(path.read_text()) | {"normalizer": None})
    path.write_text(text.replace('"normalizer": null', '"normalizer": ' + LONE_SURROGATE_REPLACE, 1))
    source = str(model_dir)
    agent.weights.fetch(source)
    agent.weights.read_model(model_dir)

    agent.heartbeat_once()  # registers, then beats with the model's facts
    agent.heartbeat_once()

    reported = _reported(source)["model_info"]["tokenizer_normalizer"]
    assert reported["unknown"] and reported["steps"] == []
    assert Node.objects.get().last_heartbeat_at is not None


def test_facts_that_cannot_be_encoded_are_left_out_of_the_heartbeat_not_the_heartbeat(
    agent, tiny_model_dir, monkeypatch
):
    source = str(tiny_model_dir)
    agent.weights.fetch(source)
    info = ModelInfo(max_model_len=2048, architecture="LlamaForCausalLM")
    info.architecture = (
        "Llama\ud800"  # past every check: a reader's bug, or a field the protocol does not check yet
    )
    monkeypatch.setattr(agent.weights, "reading_made", lambda model_dir: ModelReading(info=info))

    agent.heartbeat_once()
    first = Node.objects.get().last_heartbeat_at
    agent.heartbeat_once()

    node = Node.objects.get()
    assert node.last_heartbeat_at > first
    assert _reported(source)["model_info"] is None and _reported(source)["complete"] is True
