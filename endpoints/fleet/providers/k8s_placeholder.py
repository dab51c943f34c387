"""The capacity placeholder pod of a Kubernetes node-pool launch.

One pod per machine, asking for the pool's GPUs on its node selector: the scheduler finds no room,
so the cluster autoscaler or Karpenter adds a node that fits it, and the agent DaemonSet starts on
that node. The pod itself only sleeps (`sleep infinity`; by default in the agent's image, which every
pool node pulls anyway), as cheaply as a pod can.

NOTE: two placeholders of one pool never share a node (required anti-affinity on the pool label): a
launch is a machine. Autoscaler and Karpenter annotations forbid evicting it to consolidate nodes:
only the pool's policy decides when a node goes, by deleting its placeholder.
"""

from __future__ import annotations

import re

from endpoints.fleet.providers.base import LaunchSpec, PoolSpec

LABEL_POOL = "inferplane.dev/pool"
LABEL_LAUNCH = "inferplane.dev/launch"
LABEL_ROLE = "app.kubernetes.io/component"
# `INFERPLANE_FLEET_ID` as a label value (`fleet_label`). NOTE: two ids may share one ("acme:prod", "acme/prod"): no
# step tells fleets apart by it (each finds its machine by launch id, the stray sweep by `LABEL_INSTALLATION` too).
LABEL_FLEET = "inferplane.dev/fleet"
LABEL_INSTALLATION = "inferplane.dev/installation"  # `PoolSpec.installation_id`: required of a stray
ROLE = "node-pool-placeholder"
ZONE_LABEL = "topology.kubernetes.io/zone"
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"


def pod_name(launch_id: str) -> str:
    """A DNS-1123 name derived from the launch id alone: creating it twice names the same pod."""
    slug = re.sub(r"[^a-z0-9-]", "-", launch_id.lower()).strip("-")[:40]
    if not slug:
        raise ValueError(f"not a launch id: {launch_id!r}")
    return f"inferplane-capacity-{slug}"


def fleet_label(fleet_id: str) -> str:
    """`fleet_id` as a label value (at most 63 of `[A-Za-z0-9_.-]`, alphanumeric at both ends; "" when none is left):
    every other character becomes "-", as the label was always written, so placeholders already running still match."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", fleet_id)[:63].strip("-_.")


def pool_selector(pool: PoolSpec) -> str:
    """The label selector of a pool's placeholders."""
    return f"{LABEL_ROLE}={ROLE},{LABEL_POOL}={pool.id}"


def placeholder_pod(pool: PoolSpec, spec: LaunchSpec, *, namespace: str, image: str, fleet_id: str = "") -> dict:
    template = pool.template
    labels = {LABEL_ROLE: ROLE, LABEL_POOL: str(pool.id), LABEL_LAUNCH: re.sub(r"[^A-Za-z0-9_.-]", "-", spec.launch_id)[:63]}
    if fleet_label(fleet_id):
        labels[LABEL_FLEET] = fleet_label(fleet_id)
    if pool.installation_id:
        labels[LABEL_INSTALLATION] = pool.installation_id
    gpus = {template.get("gpu_resource", DEFAULT_GPU_RESOURCE): pool.gpus_per_node} if pool.gpus_per_node else {}
    affinity: dict = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {LABEL_ROLE: ROLE, LABEL_POOL: str(pool.id)}},
                 "topologyKey": "kubernetes.io/hostname"},
            ],
        },
    }
    if spec.zone:
        affinity["nodeAffinity"] = {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": ZONE_LABEL, "operator": "In", "values": [spec.zone]}]}],
            },
        }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(spec.launch_id),
            "namespace": namespace,
            "labels": labels,
            "annotations": {
                "cluster-autoscaler.kubernetes.io/safe-to-evict": "false",
                "karpenter.sh/do-not-disrupt": "true",
                "inferplane.dev/pool-name": pool.name,
                "inferplane.dev/node": spec.name,
            },
        },
        "spec": {
            "nodeSelector": dict(template.get("node_selector") or {}),
            "tolerations": list(template.get("tolerations") or []),
            "affinity": affinity,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 0,
            "restartPolicy": "Always",
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65535, "runAsGroup": 65535,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "placeholder",
                "image": image,
                "command": ["sleep", "infinity"],
                "resources": {
                    "requests": {"cpu": "1m", "memory": "8Mi", **gpus},
                    "limits": {"cpu": "10m", "memory": "16Mi", **gpus},
                },
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}},
            }],
        },
    }
