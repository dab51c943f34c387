"""`ec2`: a node pool's machines are EC2 instances from a launch template.

`run_instances` with the launch's id as `ClientToken` (a retry after a lost answer returns the
same instance, never a second one), tags that mark the instance as this fleet's
(`inferplane:managed-by`, `inferplane:pool`, `inferplane:launch`), and user-data (`ec2_user_data`)
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

import functools
import re
import threading

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from django.conf import settings

from endpoints.fleet.providers.agent_flags import agent_args_errors, agent_argv
from endpoints.fleet.providers.base import LaunchResult, LaunchSpec, Machine, PoolSpec, ProviderError
from endpoints.fleet.providers.ec2_user_data import render_user_data
from endpoints.fleet.providers.template_fields import name_errors, unknown_field_errors, url_errors

TEMPLATE_FIELDS = (
    "region", "launch_template", "instance_type", "subnets", "agent_image", "iam_instance_profile",
    "agent_args", "control_plane_url",
)
TAG_MANAGED_BY, TAG_POOL, TAG_LAUNCH = "inferplane:managed-by", "inferplane:pool", "inferplane:launch"
_REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d+$")
_INSTANCE_TYPE = re.compile(r"^[a-z0-9-]+\.[a-z0-9-]+$")
_SUBNET = re.compile(r"^subnet-[0-9a-f]{8,17}$")
_TEMPLATE_ID = re.compile(r"^lt-[0-9a-f]{8,17}$")
_TEMPLATE_NAME = re.compile(r"^[a-zA-Z0-9().\-/_]{3,128}$")
_TEMPLATE_VERSION = re.compile(r"^(\d+|\$Latest|\$Default)$")
_PROFILE = re.compile(r"^(arn:aws[a-z-]*:iam::\d{12}:instance-profile/[\w+=,.@/-]{1,128}|[\w+=,.@-]{1,128})$")
# Whole-request refusals (capacity, limits) as staff should read them; other codes pass their own message.
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
