"""What marks a pool machine as this installation's, against real provider APIs (moto's EC2, the in-test Kubernetes
API server): the stray sweep (`endpoints.fleet.pool_strays`) terminates only machines carrying this installation's own
random id (`FleetInstallation`), and a release the provider refuses as not this fleet's gives up, audited.

Before, the marking was `INFERPLANE_FLEET_ID` ("inferplane" by default) and the pool id (1 for every deployment's first
pool): staging and production sharing an AWS account, a namespace or a local-pool folder took each other's machines for
their own lost launches and terminated them."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import timedelta

import pytest
from botocore.exceptions import ReadTimeoutError
from django.utils import timezone

from controlplane.accounts.models import AuditEvent
from endpoints.fleet import pool_release, pool_strays, pools
from endpoints.fleet.providers import ec2, get_provider, pool_spec
from endpoints.fleet.providers.base import LaunchSpec
from endpoints.nodes.models import FleetInstallation, LaunchState, Node, NodeLaunch, StrayMachine
from gpu_agent.protocol import NodeState
from tests.fleet.test_pool_policy import make_pool
from tests.fleet.test_pool_strays import past_the_grace, stray_audits
from tests.fleet.test_provider_ec2 import REGION, _instance, _spec, aws, moto_endpoint, network  # noqa: F401
from tests.fleet.test_provider_kubernetes import _agent_pod, api_server  # noqa: F401 - the fixture


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


@pytest.mark.django_db
def test_two_fleet_ids_of_one_label_in_one_namespace_never_sweep_release_fail_or_join_each_others_placeholders(
        api_server, settings):  # noqa: F811
    """"acme:prod" and "acme/prod" both label their placeholders "acme-prod", and share the pool id and the namespace:
    each lists the other's placeholders too. Each deployment in turn, with only its own launch records (its own
    database): its tick finds machines by launch id (joins, late launches, releases) and its stray sweep requires its
    installation id, so only its own placeholders go. Before, neither could start with such an id (settings refused it;
    forced, the placeholder carried it as it is, and the API server refused every one: 422)."""
    pool = make_pool(name="k8s-pool", provider="kubernetes")
    provider = get_provider("kubernetes")
    roles = ("joining", "releasing", "late", "stray")
    fleets = {fleet_id: ({role: str(uuid.uuid4()) for role in roles}, str(uuid.uuid4()))
              for fleet_id in ("acme:prod", "acme/prod")}
    for fleet_id, (launch_ids, installation_id) in fleets.items():
        settings.FLEET_ID = fleet_id
        spec = dataclasses.replace(pool_spec(pool), installation_id=installation_id)
        assert [result.error for result in provider.launch(spec, [_placeholder(i) for i in launch_ids.values()])] == [
            ""] * len(roles)
    assert {pod["metadata"]["labels"]["inferplane.dev/fleet"] for pod in api_server.pods.values()} == {"acme-prod"}

    def pod(launch_id: str) -> str:
        return f"inferplane-capacity-{launch_id}"

    (ids_a, _), (ids_b, _) = fleets.values()
    left_after = [{pod(ids_a["joining"])} | {pod(launch_id) for launch_id in ids_b.values()},  # the first's turn
                  {pod(ids_a["joining"]), pod(ids_b["joining"])}]  # the second's
    for number, (fleet_id, (launch_ids, installation_id)) in enumerate(fleets.items()):
        settings.FLEET_ID = fleet_id
        FleetInstallation.objects.update_or_create(pk=FleetInstallation.ROW, defaults={"installation_id": installation_id})
        NodeLaunch.objects.all().delete()  # the other deployment's records are in its own database
        StrayMachine.objects.all().delete()
        now = timezone.now()
        node_name = f"ip-10-0-0-{number}.ec2.internal"
        placed = api_server.pods[pod(launch_ids["joining"])]
        placed["spec"]["nodeName"], placed["status"]["phase"] = node_name, "Running"
        agent_ip = f"10.0.0.{100 + number}"  # its agent's pod there, at whose IP its node registered
        agent = api_server.pods[f"inferplane-agent-{number}"] = _agent_pod(f"inferplane-agent-{number}", node_name,
                                                                            agent_ip)
        # registered by that pod (its projected token reviewed: `Node.agent_pod_uid`), and heartbeating
        node = Node.objects.create(name=node_name, gpu_type="cpu", secret_lookup=f"gpu-k8s-{number}000",
                                   secret_digest="x", advertise_host=agent_ip, agent_pod_uid=agent["metadata"]["uid"],
                                   registered_at=now - timedelta(seconds=30), last_heartbeat_at=now)
        NodeLaunch.objects.create(pk=launch_ids["joining"], pool=pool, state=LaunchState.LAUNCHING,
                                  provider_id=pod(launch_ids["joining"]), requested_at=now - timedelta(minutes=1),
                                  deadline_at=now + timedelta(hours=1))
        NodeLaunch.objects.create(pk=launch_ids["releasing"], pool=pool, state=LaunchState.RELEASING,
                                  provider_id=pod(launch_ids["releasing"]), deadline_at=now)
        NodeLaunch.objects.create(pk=launch_ids["late"], pool=pool, state=LaunchState.LAUNCHING,
                                  deadline_at=now - timedelta(seconds=1))  # its answer was lost: found by its id

        pool_strays.sweep_stray_machines()
        pools.tick_pool(pool, [], provider)
        past_the_grace()
        assert pool_strays.sweep_stray_machines() == [pod(launch_ids["stray"])]

        states = dict(NodeLaunch.objects.values_list("pk", "state"))
        assert {role: states[uuid.UUID(launch_ids[role])] for role in ("joining", "releasing", "late")} == {
            "joining": LaunchState.JOINED, "releasing": LaunchState.TERMINATED, "late": LaunchState.FAILED}
        assert NodeLaunch.objects.get(pk=launch_ids["joining"]).node == node
        assert {name for name in api_server.pods if not name.startswith("inferplane-agent-")} == left_after[number]
