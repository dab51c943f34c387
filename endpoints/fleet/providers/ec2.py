"""`ec2`: a node pool's machines are EC2 instances from a launch template.

`run_instances` with the launch's id as `ClientToken` (a retry after a lost answer returns the
same instance, never a second one), tags that mark the instance as this fleet's
(`inferplane:managed-by`, `inferplane:pool`, `inferplane:launch`, and `inferplane:installation`: this installation's
own random id, which the stray sweep requires), and user-data (`ec2_user_data`)
that runs the agent image with the machine's GPUs and its one-use join token.

NOTE: only instances carrying this fleet's `inferplane:managed-by` tag and the pool's tag are ever
listed or terminated: a machine the fleet did not launch is never touched, whatever id it is given.

Template fields: `region`, `launch_template` (`id` or `name`, optional `version`), optional
`instance_type`, `subnets` (the zones a launch may go to; a retry goes to the next), `agent_image`,
optional `iam_instance_profile`, `agent_args` (allow-listed agent flags), `control_plane_url`.
Credentials: the standard boto3 chain of the control plane; `INFERPLANE_EC2_ENDPOINT_URL` points
it elsewhere (moto in the tests).
"""

from __future__ import annotations

import os
import re
import threading

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from django.conf import settings

from endpoints.fleet.providers.agent_flags import agent_args_errors, agent_argv
from endpoints.fleet.providers.base import (
    LaunchResult,
    LaunchSpec,
    Machine,
    NotThisFleets,
    PoolSpec,
    ProviderError,
    ProviderUnreachable,
)
from endpoints.fleet.providers.ec2_user_data import render_user_data
from endpoints.fleet.providers.template_fields import name_errors, unknown_field_errors, url_errors

TEMPLATE_FIELDS = (
    "region", "launch_template", "instance_type", "subnets", "agent_image", "iam_instance_profile",
    "agent_args", "control_plane_url",
)
TAG_MANAGED_BY, TAG_POOL, TAG_LAUNCH = "inferplane:managed-by", "inferplane:pool", "inferplane:launch"
TAG_INSTALLATION = "inferplane:installation"
_REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d+$")
_INSTANCE_TYPE = re.compile(r"^[a-z0-9-]+\.[a-z0-9-]+$")
_SUBNET = re.compile(r"^subnet-[0-9a-f]{8,17}$")
_TEMPLATE_ID = re.compile(r"^lt-[0-9a-f]{8,17}$")
_TEMPLATE_NAME = re.compile(r"^[a-zA-Z0-9().\-/_]{3,128}$")
_TEMPLATE_VERSION = re.compile(r"^(\d+|\$Latest|\$Default)$")
_PROFILE = re.compile(r"^(arn:aws[a-z-]*:iam::\d{12}:instance-profile/[\w+=,.@/-]{1,128}|[\w+=,.@-]{1,128})$")
# EC2's instance states as `Machine.state`; terminated instances are never listed.
_STATES = {"pending": "pending", "running": "running", "stopping": "stopping", "stopped": "stopping",
           "shutting-down": "stopping"}


def _launch_template_errors(value) -> list[str]:
    if not isinstance(value, dict) or set(value) - {"id", "name", "version"}:
        return ["An object with `id` or `name`, and optionally `version`."]
    if ("id" in value) == ("name" in value):
        return ["Exactly one of `id` or `name`."]
    if "id" in value and not (isinstance(value["id"], str) and _TEMPLATE_ID.match(value["id"])):
        return ["`id`: a launch template id (lt-…)."]
    if "name" in value and not (isinstance(value["name"], str) and _TEMPLATE_NAME.match(value["name"])):
        return ["`name`: a launch template name."]
    version = value.get("version", "$Default")
    if not isinstance(version, (str, int)) or not _TEMPLATE_VERSION.match(str(version)):
        return ["`version`: a version number, $Latest or $Default."]
    return []


def _check(pattern: re.Pattern, value, what: str) -> list[str]:
    return [] if isinstance(value, str) and pattern.match(value) else [what]


class Ec2Provider:
    name = "ec2"

    def template_errors(self, template: dict) -> dict[str, list[str]]:
        errors = unknown_field_errors(template, TEMPLATE_FIELDS)
        if "template" in errors:
            return errors
        checks = {
            "region": _check(_REGION, template.get("region"), "An AWS region, e.g. us-east-1."),
            "launch_template": _launch_template_errors(template.get("launch_template")),
            "agent_image": name_errors(template.get("agent_image"), "A container image reference"),
        }
        if "instance_type" in template:
            checks["instance_type"] = _check(_INSTANCE_TYPE, template["instance_type"], "An instance type, e.g. g5.xlarge.")
        if "subnets" in template:
            subnets = template["subnets"]
            if not isinstance(subnets, list) or not all(isinstance(s, str) and _SUBNET.match(s) for s in subnets):
                checks["subnets"] = ["A list of subnet ids (subnet-…)."]
        if "iam_instance_profile" in template:
            checks["iam_instance_profile"] = _check(
                _PROFILE, template["iam_instance_profile"], "An instance profile name or ARN.")
        if "agent_args" in template:
            checks["agent_args"] = agent_args_errors(template["agent_args"])
        if "control_plane_url" in template:
            checks["control_plane_url"] = url_errors(template["control_plane_url"])
        errors.update({f"template.{field}": problems for field, problems in checks.items() if problems})
        return errors

    def zones(self, template: dict) -> list[str]:
        return list(template.get("subnets") or []) or [""]

    def launch(self, pool: PoolSpec, specs: list[LaunchSpec]) -> list[LaunchResult]:
        if errors := self.template_errors(pool.template):
            raise ProviderError(f"invalid template: {errors}")
        client = _client(pool.template["region"])
        return [self._launch_one(client, pool, spec) for spec in specs]

    def _launch_one(self, client, pool: PoolSpec, spec: LaunchSpec) -> LaunchResult:
        # NOTE: ClientToken makes EC2 itself answer a repeated call with the same instance; the look
        # by tag first also covers a retry after EC2 has forgotten the token.
        for instance in _describe(client, _owned_filters(pool) + [{"Name": f"tag:{TAG_LAUNCH}", "Values": [spec.launch_id]}]):
            return LaunchResult(launch_id=spec.launch_id, provider_id=instance["InstanceId"],
                                zone=instance.get("SubnetId", ""))
        template = pool.template
        try:
            user_data = render_user_data(
                launch_id=spec.launch_id, name=spec.name, join_token=spec.join_token,
                control_plane_url=template.get("control_plane_url") or spec.control_plane_url,
                image=template["agent_image"], agent_args=agent_argv(template.get("agent_args")),
            )
        except ValueError as error:
            return LaunchResult(launch_id=spec.launch_id, error=f"cannot launch: {error}")
        launch_template = template["launch_template"]
        tags = _tags(pool, spec)
        request = {
            "LaunchTemplate": {
                **({"LaunchTemplateId": launch_template["id"]} if "id" in launch_template
                   else {"LaunchTemplateName": launch_template["name"]}),
                "Version": str(launch_template.get("version", "$Default")),
            },
            "MinCount": 1,
            "MaxCount": 1,
            "ClientToken": spec.launch_id,
            "UserData": user_data,
            "TagSpecifications": [{"ResourceType": kind, "Tags": tags} for kind in ("instance", "volume")],
        }
        subnet = spec.zone or (template.get("subnets") or [""])[0]
        if subnet:
            request["SubnetId"] = subnet
        if "instance_type" in template:
            request["InstanceType"] = template["instance_type"]
        if profile := template.get("iam_instance_profile"):
            request["IamInstanceProfile"] = {"Arn": profile} if profile.startswith("arn:") else {"Name": profile}
        try:
            [instance] = client.run_instances(**request)["Instances"]
        except ClientError as error:
            if _no_answer(error) or error.response.get("Error", {}).get("Code") == "IdempotentParameterMismatch":
                # NOTE: EC2 failing, or an instance this launch id already started (a resend carries a new join token,
                # so other parameters): not a refusal; its tag finds it next time, or the deadline ends it.
                raise ProviderUnreachable(f"EC2 did not launch it, or did: {_refusal(error, template, subnet)}") from error
            return LaunchResult(launch_id=spec.launch_id, zone=subnet, error=_refusal(error, template, subnet))
        except BotoCoreError as error:  # NOTE: a read timeout too: the instance may have started
            raise ProviderUnreachable(f"EC2 is unreachable: {error}") from error
        return LaunchResult(launch_id=spec.launch_id, provider_id=instance["InstanceId"],
                            zone=instance.get("SubnetId") or subnet)

    def terminate(self, pool: PoolSpec, provider_id: str) -> None:
        client = _client(pool.template.get("region"))
        try:
            reservations = client.describe_instances(InstanceIds=[provider_id])["Reservations"]
        except ClientError as error:
            if error.response["Error"]["Code"] in ("InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"):
                return
            raise ProviderError(_refusal(error, pool.template, "")) from error
        except BotoCoreError as error:
            raise ProviderUnreachable(f"EC2 is unreachable: {error}") from error
        for instance in (i for r in reservations for i in r["Instances"]):
            tags = {tag["Key"]: tag["Value"] for tag in instance.get("Tags", [])}
            if tags.get(TAG_MANAGED_BY) != settings.FLEET_ID or tags.get(TAG_POOL) != str(pool.id):
                raise NotThisFleets(
                    f"instance {provider_id} was not launched by this fleet's pool {pool.name}: refusing to terminate it")
            if instance["State"]["Name"] in ("shutting-down", "terminated"):
                return
            try:
                client.terminate_instances(InstanceIds=[provider_id])
            except ClientError as error:
                unanswered = ProviderUnreachable if _no_answer(error) else ProviderError
                raise unanswered(_refusal(error, pool.template, "")) from error
            except BotoCoreError as error:  # NOTE: a read timeout too: EC2 may have terminated it
                raise ProviderUnreachable(f"EC2 did not answer a termination: {error}") from error

    def list(self, pool: PoolSpec) -> list[Machine]:
        client = _client(pool.template.get("region"))
        machines = []
        for instance in _describe(client, _owned_filters(pool)):
            tags = {tag["Key"]: tag["Value"] for tag in instance.get("Tags", [])}
            machines.append(Machine(
                provider_id=instance["InstanceId"], launch_id=tags.get(TAG_LAUNCH, ""),
                state=_STATES.get(instance["State"]["Name"], "pending"), node_name=tags.get("inferplane:node", ""),
                fleet_marked=(tags.get(TAG_MANAGED_BY) == settings.FLEET_ID and tags.get(TAG_POOL) == str(pool.id)
                              and bool(pool.installation_id) and tags.get(TAG_INSTALLATION) == pool.installation_id),
            ))
        return machines


_CLIENTS: dict[tuple, object] = {}
_CLIENTS_LOCK = threading.Lock()


def _client(region) -> object:
    """One EC2 client per process and region (clients are thread-safe; a forked worker makes its own)."""
    if not isinstance(region, str) or not _REGION.match(region):
        raise ProviderError(f"the pool's template names no AWS region: {region!r}")
    key = (os.getpid(), region, settings.EC2_ENDPOINT_URL)
    with _CLIENTS_LOCK:
        if key not in _CLIENTS:
            _CLIENTS[key] = boto3.session.Session().client(
                "ec2", region_name=region, endpoint_url=settings.EC2_ENDPOINT_URL or None,
                config=Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 3, "mode": "standard"}),
            )
        return _CLIENTS[key]


def _tags(pool: PoolSpec, spec: LaunchSpec) -> list[dict[str, str]]:
    return [
        {"Key": TAG_MANAGED_BY, "Value": settings.FLEET_ID},
        {"Key": TAG_POOL, "Value": str(pool.id)},
        {"Key": TAG_LAUNCH, "Value": spec.launch_id},
        *([{"Key": TAG_INSTALLATION, "Value": pool.installation_id}] if pool.installation_id else []),
        {"Key": "inferplane:node", "Value": spec.name},
        {"Key": "Name", "Value": spec.name},
    ]


def _owned_filters(pool: PoolSpec) -> list[dict]:
    return [
        {"Name": f"tag:{TAG_MANAGED_BY}", "Values": [settings.FLEET_ID]},
        {"Name": f"tag:{TAG_POOL}", "Values": [str(pool.id)]},
        {"Name": "instance-state-name", "Values": sorted(_STATES)},
    ]


def _describe(client, filters: list[dict]) -> list[dict]:
    try:
        pages = client.get_paginator("describe_instances").paginate(Filters=filters)
        return [instance for page in pages for reservation in page["Reservations"] for instance in reservation["Instances"]]
    except ClientError as error:
        unanswered = ProviderUnreachable if _no_answer(error) else ProviderError
        raise unanswered(f"EC2 did not answer a listing: {error}") from error
    except BotoCoreError as error:  # NOTE: a launch looking for its machine first must not read this as a refusal
        raise ProviderUnreachable(f"EC2 did not answer a listing: {error}") from error


def _no_answer(error: ClientError) -> bool:
    """EC2 failed on its side (a 5xx): what was asked may or may not have been done."""
    return int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0) >= 500


def _refusal(error: ClientError, template: dict, subnet: str) -> str:
    code = error.response.get("Error", {}).get("Code", "Error")
    message = error.response.get("Error", {}).get("Message", "")
    if code == "InsufficientInstanceCapacity":
        where = f" in {subnet}" if subnet else ""
        return (f"EC2 has no capacity for {template.get('instance_type', 'the launch template')}{where} "
                f"(InsufficientInstanceCapacity): another subnet may have some")
    return f"EC2 refused ({code}): {message}"
