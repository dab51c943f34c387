"""What marks a pool machine as this installation's, against real provider APIs (moto's EC2, the in-test Kubernetes
API server): the stray sweep (`endpoints.fleet.pool_strays`) terminates only machines carrying this installation's own
random id (`FleetInstallation`), and a release the provider refuses as not this fleet's gives up, audited.

Before, the marking was `INFERPLANE_FLEET_ID` ("inferplane" by default) and the pool id (1 for every deployment's first
pool): staging and production sharing an AWS account, a namespace or a local-pool folder took each other's machines for
their own lost launches and terminated them."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
from botocore.exceptions import ReadTimeoutError
from django.utils import timezone

from controlplane.accounts.models import AuditEvent
from endpoints.fleet import pool_release, pool_strays
from endpoints.fleet.providers import ec2, get_provider, pool_spec
from endpoints.fleet.providers.base import LaunchSpec
from endpoints.nodes.models import LaunchState, Node, NodeLaunch, StrayMachine
from gpu_agent.protocol import NodeState
from tests.fleet.test_pool_policy import make_pool
from tests.fleet.test_pool_strays import past_the_grace, stray_audits
from tests.fleet.test_provider_ec2 import REGION, _instance, _spec, aws, moto_endpoint, network  # noqa: F401
from tests.fleet.test_provider_kubernetes import api_server  # noqa: F401 - the fixture


def _ec2_pool(aws):  # noqa: F811
    _, subnets, name = aws
    template = {"region": REGION, "launch_template": {"name": name, "version": "$Latest"}, "subnets": subnets,
                "agent_image": "registry.example.com/inferplane/agent:0.1.0", "instance_type": "g5.xlarge"}
    return make_pool(name="gpu-ec2", provider="ec2", gpu_type="a10g-24gb", gpus_per_node=1, template=template)


def _placeholder(launch_id: str) -> LaunchSpec:
    return LaunchSpec(launch_id=launch_id, name="", join_token="jt_unused", control_plane_url="https://x")


@pytest.mark.django_db
def test_another_installations_placeholder_under_the_same_fleet_id_and_pool_id_is_never_swept(api_server):  # noqa: F811
    pool = make_pool(name="k8s-pool", provider="kubernetes")
    provider = get_provider("kubernetes")
    other_installation = dataclasses.replace(pool_spec(pool), installation_id=str(uuid.uuid4()))
    theirs, ours = str(uuid.uuid4()), str(uuid.uuid4())  # neither has a launch record in this database
    provider.launch(other_installation, [_placeholder(theirs)])
    provider.launch(pool_spec(pool), [_placeholder(ours)])

    pool_strays.sweep_stray_machines()
    past_the_grace()
    assert pool_strays.sweep_stray_machines() == [f"inferplane-capacity-{ours}"]
    assert set(api_server.pods) == {f"inferplane-capacity-{theirs}"}  # before: deleted too
    assert len(stray_audits()) == 1


@pytest.mark.django_db
def test_another_installations_instance_in_the_account_is_never_swept_and_a_lost_answer_stops_no_other_stray(
        aws, monkeypatch):  # noqa: F811
    """Before, a read timeout on `terminate_instances` escaped as botocore's own error: the claim stayed taken, the
    pool's next stray waited for another sweep, and the instance EC2 did terminate was never audited."""
    client = aws[0]
    pool = _ec2_pool(aws)
    provider = get_provider("ec2")
    first, second = provider.launch(pool_spec(pool), [_spec(str(uuid.uuid4())), _spec(str(uuid.uuid4()))])
    [theirs] = provider.launch(dataclasses.replace(pool_spec(pool), installation_id=str(uuid.uuid4())),
                               [_spec(str(uuid.uuid4()))])
    pool_strays.sweep_stray_machines()
    past_the_grace()
    ec2_client = ec2._client(REGION)
    real, timed_out = ec2_client.terminate_instances, []

    def terminate_then_time_out(**kwargs):
        real(**kwargs)  # EC2 did it; the first answer is lost
        if not timed_out:
            timed_out.append(kwargs["InstanceIds"])
            raise ReadTimeoutError(endpoint_url="https://ec2.us-east-1.amazonaws.com")
        return {}

    monkeypatch.setattr(ec2_client, "terminate_instances", terminate_then_time_out)
    assert len(pool_strays.sweep_stray_machines()) == 1  # the other stray, in the same sweep
    assert not StrayMachine.objects.filter(claimed_at__isnull=False, terminated_at__isnull=True).exists()
    pool_strays.sweep_stray_machines()
    for result in (first, second):
        assert _instance(client, result.provider_id)["State"]["Name"] in ("shutting-down", "terminated")
    assert _instance(client, theirs.provider_id)["State"]["Name"] == "running"
    assert sorted(audit.details["provider_id"] for audit in stray_audits()) == sorted(
        [first.provider_id, second.provider_id])


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
