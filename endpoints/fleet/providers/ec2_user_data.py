"""The boot script of an EC2 node-pool machine: run the agent image with the machine's GPUs.

The launch template's AMI brings Docker and the NVIDIA container toolkit (any GPU AMI does); the
script writes the agent's environment file, pulls the image and runs it as infra/systemd and the
agent DaemonSet do (`python -m gpu_agent run`, the data folder /var/lib/inferplane, engines on the
default port range, reached at the instance's private address).

NOTE: the join token goes into /etc/inferplane/agent.env (0600, root) and reaches the agent through
`docker run --env-file`: never on a command line, where any process on the machine could read it.
User-data itself stays readable through the instance metadata service, which is why the token is
one-use and expires at the launch's join deadline: once the agent has joined it opens nothing.
NOTE: every value is checked for its shape and shell-quoted; the environment file is written with a
quoted here-document (no expansion), so no template or token value can run as shell code.
"""

from __future__ import annotations

import re
import shlex

from gpu_agent.protocol import DEFAULT_ENGINE_PORT_MAX, DEFAULT_ENGINE_PORT_MIN

_TOKEN = re.compile(r"^[A-Za-z0-9._~+/=-]{8,512}$")
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
_URL = re.compile(r"^https?://[^\s'\"\\$`]+$")

_SCRIPT = """#!/bin/bash
# Inferplane node-pool machine {launch_id}: starts the GPU agent (endpoints/fleet/providers/ec2_user_data.py).
set -euo pipefail
umask 077
install -d -m 0700 /etc/inferplane
cat > /etc/inferplane/agent.env <<'INFERPLANE_AGENT_ENV'
INFERPLANE_JOIN_TOKEN={join_token}
INFERPLANE_AGENT_ENGINE_PORTS={engine_ports}
INFERPLANE_AGENT_ENV
# The gateways reach this machine's engines at its private address (IMDSv2).
imds_token=$(curl -sS -X PUT -H 'X-aws-ec2-metadata-token-ttl-seconds: 300' http://169.254.169.254/latest/api/token)
private_ip=$(curl -sS -H "X-aws-ec2-metadata-token: $imds_token" http://169.254.169.254/latest/meta-data/local-ipv4)
echo "INFERPLANE_AGENT_ADVERTISE_HOST=$private_ip" >> /etc/inferplane/agent.env
chmod 0600 /etc/inferplane/agent.env
install -d -m 0750 -o 10001 -g 10001 /var/lib/inferplane
command -v docker >/dev/null || {{ echo 'inferplane: this AMI has no Docker' >&2; exit 1; }}
systemctl enable --now docker
docker pull {image}
docker rm -f inferplane-agent 2>/dev/null || true
docker run --detach --name inferplane-agent --restart unless-stopped --gpus all --network host \\
  --env-file /etc/inferplane/agent.env -v /var/lib/inferplane:/var/lib/inferplane \\
  {image} python -m gpu_agent run --control-plane {control_plane_url} --data-dir /var/lib/inferplane \\
  --name {name}{agent_args}
"""


def render_user_data(
    *, launch_id: str, name: str, join_token: str, control_plane_url: str, image: str, agent_args: list[str]
) -> str:
    """The cloud-init shell script for one machine; raises ValueError for a value of the wrong shape."""
    if not _TOKEN.match(join_token):
        raise ValueError("the join token has an unexpected shape")
    if not _NODE_NAME.match(name):
        raise ValueError(f"not a node name: {name!r}")
    if not _URL.match(control_plane_url):
        raise ValueError(f"not a control plane URL: {control_plane_url!r}")
    return _SCRIPT.format(
        launch_id=shlex.quote(launch_id),
        join_token=join_token,
        engine_ports=f"{DEFAULT_ENGINE_PORT_MIN}-{DEFAULT_ENGINE_PORT_MAX}",
        image=shlex.quote(image),
        control_plane_url=shlex.quote(control_plane_url),
        name=shlex.quote(name),
        agent_args="".join(f" {shlex.quote(arg)}" for arg in agent_args),
    )
