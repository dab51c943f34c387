"""Staff's cordon, uncordon and drain of nodes that cannot take them (a retired machine, a silent one, a pool's machine
being released), racing a replica's start, and only with the form's CSRF token."""

from datetime import timedelta

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from controlplane.accounts.models import AuditEvent
from controlplane.accounts.services import SYSTEM
from endpoints.fleet import pool_release
from endpoints.fleet.providers.base import ProviderError
from endpoints.fleet.services import create_join_token, retire_node
from endpoints.models import Replica
from endpoints.nodes.models import LaunchState, Node, NodeLaunch, NodePool
from endpoints.scheduler import reconcile_endpoint
from gpu_agent.protocol import NodeState, ReplicaState, ReplicaStatus
from tests.factories import EndpointFactory, sign_in_staff
from tests.fleet.test_pool_policy import RecordingProvider, make_pool
from tests.test_agent_api import beat, register

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff(client):
    sign_in_staff(client, get_user_model().objects.create_superuser("ops@example.test", "ops@example.test", "a long passphrase"))
    return client


def joined_node(name="gpu-1"):
    """A node its agent registered (a CPU node, as `tests.test_agent_api` registers), with that agent's client."""
    agent = Client()
    joined = register(agent, create_join_token(SYSTEM, name=name).plain, name=name).json()
    return Node.objects.get(pk=joined["node_id"]), agent, joined["node_secret"]


def admin_action(staff, action, node):
    return staff.post("/django-admin/gpu_agent/node/", {"action": action, "_selected_action": [str(node.pk)]}, follow=True)


def test_uncordoning_every_node_in_the_admin_leaves_a_retired_one_retired_and_places_nothing_on_it(staff):
    """A "select all, uncordon" after maintenance: a retired node (a pool's terminated machine, a stolen one cut off)
    has no agent to run a replica. Before, it went READY and won placement until the sweep found it silent again."""
    node, agent, secret = joined_node()
    retire_node(SYSTEM, node, reason="stolen machine")

    admin_action(staff, "uncordon", node)
    staff.post(reverse("console:node-state", args=[node.pk]), {"action": "uncordon"})

    node.refresh_from_db()
    assert node.state == NodeState.OFFLINE and node.secret_digest == ""
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny")
    reconcile_endpoint(str(endpoint.pk))
    assert not Replica.objects.filter(endpoint=endpoint).exists(), "no replica is placed on a retired node"
    assert not AuditEvent.objects.filter(action="node.ready").exists()
    assert beat(agent, secret).status_code == 401


def test_the_console_says_a_retired_node_has_nothing_to_change(staff):
    node, _, _ = joined_node()
    retire_node(SYSTEM, node, reason="stolen machine")

    page = staff.post(reverse("console:node-state", args=[node.pk]), {"action": "drain"}, follow=True).content.decode()

    assert "is retired" in page
    assert Node.objects.get(pk=node.pk).state == NodeState.OFFLINE


def test_uncordoning_a_silent_node_keeps_it_offline_and_it_comes_back_ready_when_it_beats(staff):
    """Before, a silent node staff uncordoned went READY at once and won placement, its replicas failing when the
    sweep found it silent again (each failure counting toward its endpoint's back-off)."""
    node, agent, secret = joined_node()
    Node.objects.filter(pk=node.pk).update(state=NodeState.OFFLINE, state_before_offline=NodeState.CORDONED)

    staff.post(reverse("console:node-state", args=[node.pk]), {"action": "uncordon"})

    node.refresh_from_db()
    assert (node.state, node.state_before_offline) == (NodeState.OFFLINE, NodeState.READY)
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny")
    reconcile_endpoint(str(endpoint.pk))
    assert not Replica.objects.filter(endpoint=endpoint).exists(), "no replica is placed on a silent node"
    assert AuditEvent.objects.filter(action="node.ready").exists(), "staff's decision is audited"

    assert beat(agent, secret).json()["node_state"] == NodeState.READY
    reconcile_endpoint(str(endpoint.pk))
    assert Replica.objects.get(endpoint=endpoint).node_id == node.pk


def test_a_silent_node_staff_drain_comes_back_draining_and_takes_no_replica(staff):
    node, agent, secret = joined_node()
    Node.objects.filter(pk=node.pk).update(state=NodeState.OFFLINE, state_before_offline=NodeState.READY)

    admin_action(staff, "drain", node)

    assert beat(agent, secret).json()["node_state"] == NodeState.DRAINING
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny")
    reconcile_endpoint(str(endpoint.pk))
    assert not Replica.objects.filter(endpoint=endpoint).exists()


def test_draining_a_node_while_a_replica_starts_on_it_drains_that_replica_too(staff):
    """An operator's drain racing a heartbeat that says STARTING (guard: passes before and after)."""
    node, agent, secret = joined_node()
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny")
    reconcile_endpoint(str(endpoint.pk))
    replica = Replica.objects.get(endpoint=endpoint, node=node)
    beat(agent, secret, [ReplicaStatus(str(replica.pk), ReplicaState.STARTING)])
    staff.post(reverse("console:node-state", args=[node.pk]), {"action": "drain"})
    answer = beat(agent, secret, [ReplicaStatus(str(replica.pk), ReplicaState.READY, address="http://127.0.0.1:20000")])

    replica.refresh_from_db()
    assert replica.state == ReplicaState.DRAINING, "a READY report never revives a drained replica"
    assert [spec["action"] for spec in answer.json()["desired"]] == ["DRAIN"]


def test_a_pool_machine_being_released_is_not_uncordoned_and_takes_no_replica(staff):
    """The pool cordoned it, empty, and its provider has not terminated it yet (an API refused, tried next tick):
    before, staff's uncordon made it READY, a replica landed, and the machine's termination failed it."""
    node, _, _ = joined_node()
    pool = NodePool.objects.create(name="cpu", gpu_type="cpu", provider="local", gpus_per_node=0, gpu_memory_mb=8192)
    NodeLaunch.objects.create(pool=pool, node=node, state=LaunchState.RELEASING, deadline_at=timezone.now())
    Node.objects.filter(pk=node.pk).update(state=NodeState.CORDONED)

    page = staff.post(reverse("console:node-state", args=[node.pk]), {"action": "uncordon"}, follow=True)

    assert "being released" in page.content.decode()
    assert Node.objects.get(pk=node.pk).state == NodeState.CORDONED
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny")
    reconcile_endpoint(str(endpoint.pk))
    assert not Replica.objects.filter(endpoint=endpoint).exists()


def test_staff_node_actions_and_join_tokens_need_the_forms_csrf_token(staff):
    """A page elsewhere cannot make a signed-in staff member's browser drain a node or mint a join token (guard:
    passes before and after)."""
    node, _, _ = joined_node()
    staff.handler.enforce_csrf_checks = True

    assert staff.post(reverse("console:node-state", args=[node.pk]), {"action": "drain"}).status_code == 403
    assert staff.post(reverse("console:join-token-create"), {"name": "x"}).status_code == 403
    assert admin_action(staff, "retire", node).status_code == 403
    node.refresh_from_db()
    assert node.state == NodeState.READY and node.secret_digest


def test_a_pool_machine_being_released_that_beats_again_comes_back_cordoned_and_takes_no_replica():
    """It went silent, the pool tick marked its launch RELEASING, and the provider's terminate failed (retried next
    tick). Before, its next heartbeat made it READY: it won placement and was terminated under the replica."""
    node, agent, secret = joined_node()
    pool = make_pool(name="cpu", gpu_type="cpu", gpus_per_node=0, gpu_memory_mb=8192)
    launch = NodeLaunch.objects.create(pool=pool, node=node, state=LaunchState.JOINED, provider_id="m-1",
                                       deadline_at=timezone.now(), joined_at=timezone.now())
    silent_since = timezone.now() - timedelta(seconds=3 * settings.NODE_HEARTBEAT_GRACE_S)
    Node.objects.filter(pk=node.pk).update(state=NodeState.OFFLINE, state_before_offline=NodeState.READY,
                                           last_heartbeat_at=silent_since)
    throttled = RecordingProvider()

    def refuse(pool, provider_id):
        raise ProviderError("API throttled")

    throttled.terminate = refuse
    pool_release.release_idle(pool, throttled, timezone.now())
    launch.refresh_from_db()
    assert launch.state == LaunchState.RELEASING

    assert beat(agent, secret).json()["node_state"] == NodeState.CORDONED
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, model_source="/models/tiny")
    reconcile_endpoint(str(endpoint.pk))
    assert not Replica.objects.filter(endpoint=endpoint, node=node).exists()
