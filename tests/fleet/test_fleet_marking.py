"""A changed `INFERPLANE_FLEET_ID` against moto's EC2: a release the provider refuses as not this fleet's machine gives
up, audited, instead of retrying every tick."""

from __future__ import annotations

import pytest
from django.utils import timezone

from controlplane.accounts.models import AuditEvent
from endpoints.fleet import pool_release
from endpoints.fleet.providers import get_provider, pool_spec
from endpoints.nodes.models import LaunchState, Node, NodeLaunch
from gpu_agent.protocol import NodeState
from tests.fleet.test_pool_policy import make_pool
from tests.fleet.test_provider_ec2 import REGION, _instance, _spec, aws, moto_endpoint, network  # noqa: F401


def _ec2_pool(aws):  # noqa: F811
    _, subnets, name = aws
    template = {"region": REGION, "launch_template": {"name": name, "version": "$Latest"}, "subnets": subnets,
                "agent_image": "registry.example.com/inferplane/agent:0.1.0", "instance_type": "g5.xlarge"}
    return make_pool(name="gpu-ec2", provider="ec2", gpu_type="a10g-24gb", gpus_per_node=1, template=template)


@pytest.mark.django_db
def test_a_release_refused_as_not_this_fleets_machine_fails_once_audited_instead_of_retrying_forever(aws, settings):  # noqa: F811
    """`INFERPLANE_FLEET_ID` changed with the machine running. Before, `finish_releases` logged a warning and tried
    again every tick: the launch RELEASING forever, its machine paid for, nothing an operator would see."""
    client = aws[0]
    pool = _ec2_pool(aws)
    provider = get_provider("ec2")
    launch = NodeLaunch.objects.create(pool=pool, state=LaunchState.LAUNCHING, deadline_at=timezone.now())
    [result] = provider.launch(pool_spec(pool), [_spec(str(launch.pk))])
    node = Node.objects.create(name="gpu-ec2-1", gpu_type="a10g-24gb", num_gpus=1, gpu_memory_mb=23_034,
                               secret_lookup="gpu-ec2-1000", secret_digest="x", state=NodeState.CORDONED)
    NodeLaunch.objects.filter(pk=launch.pk).update(state=LaunchState.RELEASING, provider_id=result.provider_id, node=node)
    settings.FLEET_ID = settings.FLEET_ID + "-renamed"

    for _ in range(2):
        assert pool_release.finish_releases(pool, provider, timezone.now()) == []
    launch.refresh_from_db()
    node.refresh_from_db()
    assert launch.state == LaunchState.FAILED and "INFERPLANE_FLEET_ID" in launch.reason
    assert node.state == NodeState.OFFLINE  # retired: its agent is turned away
    [audit] = AuditEvent.objects.filter(action="node_launch.terminate_refused")
    assert audit.details["provider_id"] == result.provider_id
    assert _instance(client, result.provider_id)["State"]["Name"] == "running"  # an operator's to terminate
