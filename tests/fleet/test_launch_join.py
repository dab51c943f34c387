"""A machine a pool launched registers with its launch's one-use join token and so joins that launch."""

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.accounts.services import SYSTEM
from endpoints.fleet.services import create_join_token
from endpoints.nodes.models import LaunchState, Node, NodeLaunch, NodePool

pytestmark = pytest.mark.django_db

REGISTRATION = {
    "name": "pool-machine-1", "gpu_type": "cpu", "num_gpus": 0, "gpu_memory_mb": 8192, "num_cpus": 2,
    "memory_mb": 24000, "agent_version": "0.1.0", "supported_quantizations": ["none"],
}


def register(client, token, **changes):
    return client.post("/agent/v1/register", REGISTRATION | {"join_token": token} | changes, content_type="application/json")


def launch_with_token(pool, state=LaunchState.LAUNCHING):
    now = timezone.now()
    token = create_join_token(SYSTEM, name="launch", expires_at=now + timedelta(minutes=10), max_uses=1)
    launch = NodeLaunch.objects.create(pool=pool, state=state, join_token=token.join_token,
                                       requested_at=now - timedelta(seconds=90), deadline_at=now + timedelta(minutes=10))
    return launch, token.plain


@pytest.fixture
def pool():
    return NodePool.objects.create(name="cpu-local", gpu_type="cpu", provider="local", gpus_per_node=0,
                                   gpu_memory_mb=8192, max_nodes=2)


def test_a_machine_registering_with_its_launchs_token_marks_the_launch_joined(client, pool):
    launch, token = launch_with_token(pool)

    response = register(client, token)

    assert response.status_code == 201
    launch.refresh_from_db()
    node = Node.objects.get(pk=response.json()["node_id"])
    assert launch.state == LaunchState.JOINED and launch.node == node
    assert launch.joined_at is not None and launch.idle_since == launch.joined_at
    assert launch.idle_s >= 90  # booting was paid for and served nothing


def test_the_launch_token_admits_one_machine_only(client, pool):
    launch, token = launch_with_token(pool)

    first, second = register(client, token), register(client, token, name="pool-machine-2")

    assert (first.status_code, second.status_code) == (201, 401)
    assert NodeLaunch.objects.get(pk=launch.pk).node.name == "pool-machine-1"


def test_a_node_joined_by_hand_belongs_to_no_launch(client, pool):
    launch, _ = launch_with_token(pool)

    response = register(client, create_join_token(SYSTEM, name="by hand").plain, name="rack-7")

    assert response.status_code == 201
    launch.refresh_from_db()
    assert launch.state == LaunchState.LAUNCHING and launch.node is None


def test_a_launch_already_given_up_is_not_revived_by_a_late_machine(client, pool):
    launch, token = launch_with_token(pool, state=LaunchState.FAILED)

    response = register(client, token)

    assert response.status_code == 201  # the token was still valid; the policy terminates the stray machine
    launch.refresh_from_db()
    assert launch.state == LaunchState.FAILED and launch.node is None
