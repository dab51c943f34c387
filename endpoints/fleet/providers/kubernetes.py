"""`kubernetes`: a node pool's machines are GPU nodes that a capacity placeholder pod calls up.

Replicas are not pods (the agent DaemonSet runs them), so the cluster autoscaler or Karpenter never
sees their demand. A launch creates one placeholder pod (`k8s_placeholder.placeholder_pod`) that
requests the pool's GPUs on its node selector: the autoscaler adds a node for it, the agent
DaemonSet starts there and registers under the node's name (`--name` = `spec.nodeName`), and the
policy links the two by `Machine.node_name`, a registration by an agent pod on that node (the API server's review of
the pod's projected service-account token sent on registration names the pod and its node: `reviewed_agent_pod`,
`Machine.pod_bound`) and the pod's IP (`Machine.agent_hosts`): a holder of the shared join token registering under
the node's name first, even at the pod's IP, is not the machine. Deleting the placeholder lets the autoscaler remove
the node once it is empty.

NOTE: the placeholder holds the GPUs in the scheduler's books only; pooled agents reach them through
the NVIDIA runtime class instead of the device plugin (infra/k8s/components/node-pools), so the two
never compete for them.

The API server is reached over HTTPS with the pod's service-account token and CA (no client library),
or `INFERPLANE_K8S_API_URL` in tests; placeholders live in `INFERPLANE_K8S_PLACEHOLDER_NAMESPACE`.

Template fields: `node_selector` (labels), `tolerations`, `gpu_resource` (default `nvidia.com/gpu`),
`zones` (values of `topology.kubernetes.io/zone`; a retry goes to the next).
"""

from __future__ import annotations

import dataclasses
import logging
import re

from django.conf import settings

from endpoints.fleet.providers.base import (
    LaunchResult,
    LaunchSpec,
    Machine,
    NotThisFleets,
    PoolSpec,
    ProviderError,
    ProviderUnreachable,
)
from endpoints.fleet.providers.k8s_api import KubernetesApi, service_account_namespace
from endpoints.fleet.providers.k8s_placeholder import (
    LABEL_FLEET,
    LABEL_INSTALLATION,
    LABEL_LAUNCH,
    LABEL_POOL,
    LABEL_ROLE,
    ROLE,
    fleet_label,
    placeholder_pod,
    pool_selector,
)
from endpoints.fleet.providers.template_fields import unknown_field_errors

logger = logging.getLogger(__name__)

TEMPLATE_FIELDS = ("node_selector", "tolerations", "gpu_resource", "zones")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")
_RESOURCE = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")

_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_POD_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
HOSTNAME_LABEL = "kubernetes.io/hostname"
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}
_OPERATORS = ("Equal", "Exists")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _label(key, value) -> bool:
    return isinstance(key, str) and isinstance(value, str) and bool(_LABEL_KEY.match(key) and _LABEL_VALUE.match(value))


def _node_selector_errors(value) -> list[str]:
    if not isinstance(value, dict) or not all(_label(key, item) for key, item in value.items()):
        return ["An object of node labels (Kubernetes label keys and values)."]
    if HOSTNAME_LABEL in value:  # the placeholder policy (infra/k8s/components/node-pools) refuses it as well
        return [f"A pool's machines are not chosen by host name ({HOSTNAME_LABEL})."]
    return []


def _toleration_errors(value) -> list[str]:
    if not isinstance(value, list):
        return ["A list of tolerations."]
    for toleration in value:
        if not isinstance(toleration, dict) or set(toleration) - _TOLERATION_KEYS:
            return [f"Each toleration: an object of {', '.join(sorted(_TOLERATION_KEYS))}."]
        operator = toleration.get("operator", "Equal")
        if operator not in _OPERATORS:
            return [f"operator: one of {', '.join(_OPERATORS)}."]
        if "effect" in toleration and toleration["effect"] not in _EFFECTS:
            return [f"effect: one of {', '.join(_EFFECTS)}."]
        if "key" in toleration and not _label(toleration["key"], "x"):
            return ["key: a Kubernetes label key."]
        if "value" in toleration and (operator == "Exists" or not _label("x", toleration["value"])):
            return ["value: a label value, and only with operator Equal."]
        seconds = toleration.get("tolerationSeconds", 0)
        if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 0:
            return ["tolerationSeconds: a whole number of seconds."]
    return []


def template_errors(template: dict) -> dict[str, list[str]]:
    errors = unknown_field_errors(template, TEMPLATE_FIELDS)
    if "template" in errors:
        return errors
    checks = {}
    if "node_selector" in template:
        checks["node_selector"] = _node_selector_errors(template["node_selector"])
    if "tolerations" in template:
        checks["tolerations"] = _toleration_errors(template["tolerations"])
    if "gpu_resource" in template:
        resource = template["gpu_resource"]
        if not isinstance(resource, str) or not _RESOURCE.match(resource) or "/" not in resource:
            checks["gpu_resource"] = ["An extended resource name, e.g. nvidia.com/gpu."]
    if "zones" in template:
        zones = template["zones"]
        if not isinstance(zones, list) or not all(isinstance(z, str) and z and _label("x", z) for z in zones):
            checks["zones"] = ["A list of zone names (topology.kubernetes.io/zone values)."]
    errors.update({f"template.{field}": problems for field, problems in checks.items() if problems})
    return errors


class KubernetesProvider:
    name = "kubernetes"

    def template_errors(self, template: dict) -> dict[str, list[str]]:
        return template_errors(template)

    def zones(self, template: dict) -> list[str]:
        return list(template.get("zones") or []) or [""]

    def launch(self, pool: PoolSpec, specs: list[LaunchSpec]) -> list[LaunchResult]:
        if errors := self.template_errors(pool.template):
            raise ProviderError(f"invalid template: {errors}")
        api, namespace = _api(), _namespace()
        results = []
        for spec in specs:
            pod = placeholder_pod(pool, spec, namespace=namespace, image=settings.K8S_PLACEHOLDER_IMAGE,
                                  fleet_id=settings.FLEET_ID)
            try:
                found, _ = api.create_pod(namespace, pod)  # NOTE: a second create answers 409: the same pod
                _check_ours(found, pool)
            except ProviderUnreachable:
                raise  # the pod may exist: not a refusal (`pools.send_launch` sends it again)
            except ProviderError as error:
                results.append(LaunchResult(launch_id=spec.launch_id, zone=spec.zone, error=str(error)))
                continue
            results.append(LaunchResult(launch_id=spec.launch_id, provider_id=pod["metadata"]["name"], zone=spec.zone))
        return results

    def terminate(self, pool: PoolSpec, provider_id: str) -> None:
        if not _POD_NAME.match(provider_id):  # NOTE: it becomes part of the request's path
            raise ProviderError(f"not a placeholder pod name: {provider_id!r}")
        api, namespace = _api(), _namespace()
        pod = api.get_pod(namespace, provider_id)
        if pod is None:
            return
        _check_ours(pod, pool)
        api.delete_pod(namespace, provider_id)

    def list(self, pool: PoolSpec) -> list[Machine]:
        machines, api = [], _api()
        for pod in api.list_pods(_namespace(), pool_selector(pool)):
            status, spec = pod.get("status", {}), pod.get("spec", {})
            if status.get("phase") in ("Succeeded", "Failed"):
                continue  # evicted or stopped: no machine is held for it any more
            node_name = spec.get("nodeName", "")
            if pod["metadata"].get("deletionTimestamp"):
                state = "stopping"
            else:
                state = "running" if node_name and status.get("phase") == "Running" else "pending"
            labels = pod["metadata"].get("labels", {})
            machines.append(Machine(provider_id=pod["metadata"]["name"], launch_id=labels.get(LABEL_LAUNCH, ""),
                                    state=state, node_name=node_name,
                                    fleet_marked=_marked(labels, pool), pod_bound=True))
        if not any(machine.node_name for machine in machines):
            return machines
        hosts = _agent_hosts(api)
        if hosts is None:
            return machines
        # NOTE: a node with no agent pod with an IP yet has no agent host (), not an unknown one (None): no node
        # registered under its name is linked until its agent's pod has an IP (`Machine.agent_hosts`).
        return [dataclasses.replace(machine, agent_hosts=hosts.get(machine.node_name, ())) for machine in machines]


# The agent DaemonSet's pods (infra/k8s/base/agent-daemonset.yaml, named by the base kustomization), in the worker's
# own namespace. NOTE: with the name: "component=agent" alone is any vendor's node agent too (a monitoring DaemonSet's,
# on the host's network: the node's IP, which an EKS node's name spells), and a node registered at its IP was linked.
AGENT_SELECTOR = "app.kubernetes.io/component=agent,app.kubernetes.io/name=inferplane"
# The agent pods' service account (infra/k8s/components/node-pools) and the audience of the projected token they
# register with (`RegisterRequest.pod_token`): a token of any other pod, account or audience claims no machine.
AGENT_SERVICE_ACCOUNT = "inferplane-agent"
AGENT_TOKEN_AUDIENCE = "inferplane.dev/agent-registration"
_POD_NAME_EXTRA, _POD_UID_EXTRA = "authentication.kubernetes.io/pod-name", "authentication.kubernetes.io/pod-uid"
_NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


def reviewed_agent_pod(token: str, node_name: str) -> str:
    """The uid of the agent pod on `node_name` whose projected service-account token `token` is, as the API server's
    TokenReview says (this audience, the agent's service account in this control plane's namespace, the pod and its
    node named by the token). Raises `ProviderError` naming why it is not (`ProviderUnreachable`: no answer)."""
    status = _api().review_token(token, AGENT_TOKEN_AUDIENCE)
    if status.get("authenticated") is not True:
        raise ProviderError(f"the Kubernetes API did not accept the pod's token: {status.get('error') or 'refused'}")
    audiences = status.get("audiences")
    if not isinstance(audiences, list) or AGENT_TOKEN_AUDIENCE not in audiences:
        raise ProviderError(f"the pod's token is not for the audience {AGENT_TOKEN_AUDIENCE}")
    user = status.get("user") if isinstance(status.get("user"), dict) else {}
    account = f"system:serviceaccount:{service_account_namespace()}:{AGENT_SERVICE_ACCOUNT}"
    if user.get("username") != account:
        raise ProviderError(f"the token is {user.get('username')!r}'s, not the agent's service account {account}")
    extra = user.get("extra") if isinstance(user.get("extra"), dict) else {}
    pod_name, pod_uid, pod_node = (_one(extra, key) for key in (_POD_NAME_EXTRA, _POD_UID_EXTRA, _NODE_NAME_EXTRA))
    if not pod_name or not pod_uid:
        raise ProviderError("the token is bound to no pod (a projected service-account token is needed)")
    if pod_node != node_name:
        where = f"on node {pod_node}" if pod_node else "on no node the API server names (Kubernetes 1.30 or later)"
        raise ProviderError(f"the token is of pod {pod_name} {where}, not of the agent on node {node_name}")
    return pod_uid


def _one(extra: dict, key: str) -> str:
    """The one value of a review's `extra` entry ("" for none, several, or not a string)."""
    values = extra.get(key)
    return values[0] if isinstance(values, list) and len(values) == 1 and isinstance(values[0], str) else ""


def _agent_hosts(api: KubernetesApi) -> dict[str, tuple[str, ...]] | None:
    """The IPs of the agent pods on each node (what each advertises, `status.podIP`); None when they cannot be listed
    (then a machine's node is linked by its name alone, to a node an agent pod there registered: `pools.link_joins`)."""
    try:
        pods = api.list_pods(service_account_namespace(), AGENT_SELECTOR)
    except ProviderError as error:
        logger.warning("could not list the agent pods (a pool machine is linked by its node's name alone): %s", error)
        return None
    hosts: dict[str, set[str]] = {}
    for pod in pods:
        node_name, status = pod.get("spec", {}).get("nodeName", ""), pod.get("status", {})
        ips = {status.get("podIP", "")} | {entry.get("ip", "") for entry in status.get("podIPs") or []}
        # NOTE: nor a pod that has ended (evicted, Failed; Succeeded): it keeps its IP in its status, which is given
        # back for another pod to take, and the node its agent registered there is dead (its replacement registers at
        # its own IP). Before, such a node, which had heartbeated, could be linked as the machine.
        ended = status.get("phase") in ("Succeeded", "Failed")
        if node_name and not pod["metadata"].get("deletionTimestamp") and not ended:
            hosts.setdefault(node_name, set()).update(ip for ip in ips if ip)
    return {node_name: tuple(sorted(ips)) for node_name, ips in hosts.items() if ips}


def _marked(labels: dict, pool: PoolSpec) -> bool:
    """This fleet's and this installation's placeholder (the pool's selector chose the rest): a stray candidate."""
    return (labels.get(LABEL_FLEET, "") == fleet_label(settings.FLEET_ID) and bool(pool.installation_id)
            and labels.get(LABEL_INSTALLATION) == pool.installation_id)


def _check_ours(pod: dict, pool: PoolSpec) -> None:
    """NOTE: only the pool's own placeholders are ever deleted, whatever name is asked for."""
    labels = pod.get("metadata", {}).get("labels", {})
    if labels.get(LABEL_ROLE) != ROLE or labels.get(LABEL_POOL) != str(pool.id):
        name = pod.get("metadata", {}).get("name", "?")
        raise NotThisFleets(f"pod {name} is not a placeholder of pool {pool.name}: refusing to touch it")


def _api() -> KubernetesApi:
    return KubernetesApi.in_cluster(settings.K8S_API_URL)


def _namespace() -> str:
    namespace = settings.K8S_PLACEHOLDER_NAMESPACE or service_account_namespace()
    if not _NAMESPACE.match(namespace):  # NOTE: it becomes part of every request's path
        raise ProviderError(f"not a Kubernetes namespace: {namespace!r}")
    return namespace
