"""infra/k8s: who may connect to what. Engines only from the gateway, web only from the ingress controller
and Prometheus, nothing else into the namespace; the ingress routes the public paths and never `/metrics`."""

from __future__ import annotations

import math

from django.urls import URLPattern, URLResolver

from controlplane import urls
from endpoints.gateway.request import MAX_BODY_BYTES
from gpu_agent.protocol import DEFAULT_ENGINE_PORT_MAX, DEFAULT_ENGINE_PORT_MIN

WORKLOADS = ("Deployment", "DaemonSet", "Job")
# Served by the web pods but never through the ingress.
INTERNAL_PATHS = ("/metrics", "/readyz")
# Routed only by the admin's Ingress, which admits the staff network alone.
STAFF_PATHS = ("/django-admin/",)


def _selects(selector: dict, labels: dict) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions)."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        matched = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not matched:
            return False
    return True


def _pod_labels(rendered) -> dict[str, dict]:
    """Each workload's pod labels, by workload name."""
    return {
        resource["metadata"]["name"]: resource["spec"]["template"]["metadata"]["labels"]
        for resource in rendered.documents
        if resource["kind"] in WORKLOADS
    }


def _policies_selecting(rendered, workload: str) -> list[dict]:
    labels = _pod_labels(rendered)[workload]
    return [policy for policy in rendered.all("NetworkPolicy") if _selects(policy["spec"]["podSelector"], labels)]


def _allow_rules(rendered, workload: str) -> list[dict]:
    return [rule for policy in _policies_selecting(rendered, workload) for rule in policy["spec"].get("ingress", [])]


def _pod_spec(rendered, kind: str, name: str) -> dict:
    return rendered.get(kind, name)["spec"]["template"]["spec"]


def test_every_pod_refuses_incoming_connections_unless_a_policy_allows_them(rendered):
    deny = rendered.get("NetworkPolicy", "inferplane-default-deny-ingress")
    assert deny["spec"]["podSelector"] == {}, "selects every pod of the namespace"
    assert deny["spec"]["policyTypes"] == ["Ingress"]
    assert not deny["spec"].get("ingress")
    for workload in _pod_labels(rendered):
        assert deny in _policies_selecting(rendered, workload), workload


def test_beat_and_migrations_accept_no_connection(rendered):
    for workload in ("inferplane-beat", "inferplane-migrate"):
        assert _allow_rules(rendered, workload) == [], workload


def test_worker_pods_are_reached_only_by_prometheus_and_only_on_their_metrics_port(rendered):
    """Before, no worker served /metrics (what its replays set aside showed in its log alone); now each serves its own
    (controlplane/worker_metrics.py), with the token, to Prometheus alone."""
    for workload in ("inferplane-worker", "inferplane-batch-worker"):
        (rule,) = _allow_rules(rendered, workload)
        assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}], workload
        (peer,) = rule["from"]
        assert set(peer) == {"namespaceSelector", "podSelector"}, peer
        assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
        assert _selects(peer["podSelector"], {"app.kubernetes.io/name": "prometheus", "prometheus": "k8s"})
        assert not _selects(peer["podSelector"], {"app.kubernetes.io/name": "grafana"})
        (container,) = _pod_spec(rendered, "Deployment", workload)["containers"]
        assert [port["name"] for port in container["ports"]] == ["metrics"], workload
        annotations = rendered.get("Deployment", workload)["spec"]["template"]["metadata"].get("annotations", {})
        assert not [key for key in annotations if key.startswith("prometheus.io/")], "no scraper without the token"


def test_only_web_and_batch_worker_pods_reach_the_agents_and_only_on_the_engine_ports(rendered):
    # A batch line calls its replica from the batch worker as the gateway does: without this its lines
    # timed out and were retried until the batch expired.
    (rule,) = _allow_rules(rendered, "inferplane-agent")
    assert rule["ports"] == [{"port": DEFAULT_ENGINE_PORT_MIN, "endPort": DEFAULT_ENGINE_PORT_MAX, "protocol": "TCP"}]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}, "pods of this namespace only: no namespaceSelector, no ipBlock"
    reaching = {name for name, labels in _pod_labels(rendered).items() if _selects(peer["podSelector"], labels)}
    assert reaching == {"inferplane-web", "inferplane-batch-worker"}
    agent = rendered.get("DaemonSet", "inferplane-agent")
    (container,) = agent["spec"]["template"]["spec"]["containers"]
    assert not [arg for arg in container["args"] if arg.startswith("--engine-ports")], (
        "the agent uses the default engine ports, which the policy opens"
    )


def test_agent_pods_use_the_pod_network_so_the_policies_apply_to_their_engines(rendered):
    pod = _pod_spec(rendered, "DaemonSet", "inferplane-agent")
    assert not pod.get("hostNetwork"), "NetworkPolicy does not apply to a pod on the host's network"
    for container in pod["containers"]:
        assert not [port for port in container.get("ports", []) if "hostPort" in port]
    env = {variable["name"]: variable for variable in pod["containers"][0]["env"]}
    assert env["INFERPLANE_AGENT_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_web_pods_are_reached_only_by_the_ingress_controller_and_prometheus(rendered):
    rules = _allow_rules(rendered, "inferplane-web")
    peers = {}
    for rule in rules:
        assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
        for peer in rule["from"]:
            assert set(peer) == {"namespaceSelector", "podSelector"}, peer
            namespace = peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
            peers[namespace] = peer["podSelector"]
    assert set(peers) == {"ingress-nginx", "monitoring"}
    # The peers' pods keep their own labels (kustomize would have put this project's into matchLabels).
    assert _selects(peers["ingress-nginx"], {"app.kubernetes.io/name": "ingress-nginx", "app.kubernetes.io/component": "controller"})
    assert _selects(peers["monitoring"], {"app.kubernetes.io/name": "prometheus", "prometheus": "k8s"})
    assert not _selects(peers["monitoring"], {"app.kubernetes.io/name": "grafana"})
    ports = {port["name"] for port in _pod_spec(rendered, "Deployment", "inferplane-web")["containers"][0]["ports"]}
    assert ports == {"http"}


def test_web_pods_invite_no_scraper_that_would_send_no_token(rendered):
    annotations = rendered.get("Deployment", "inferplane-web")["spec"]["template"]["metadata"].get("annotations", {})
    assert not [key for key in annotations if key.startswith("prometheus.io/")]


def _routes(ingress: dict, path: str) -> bool:
    """Whether one of the ingress's paths matches `path` (Kubernetes' Exact and element-wise Prefix)."""
    return any(_matches(rule_path, path) for rule_path in ingress["spec"]["rules"][0]["http"]["paths"])


def _matches(rule_path: dict, path: str) -> bool:
    prefix, kind = rule_path["path"], rule_path["pathType"]
    if kind == "Exact":
        return path == prefix
    return kind == "Prefix" and (prefix == "/" or path == prefix or path.startswith(prefix.rstrip("/") + "/"))


def _public_paths() -> list[str]:
    """One example path for each top-level entry of the URL configuration, and the gateway's."""
    examples = ["/v1/chat/completions", "/v1/models", "/static/css/site.css"]
    for pattern in urls.urlpatterns:
        assert isinstance(pattern, URLPattern | URLResolver)
        literal = str(pattern.pattern).split("<", 1)[0]
        examples.append("/" + literal + ("x/" if "<" in str(pattern.pattern) else ""))
    return [path for path in examples if path not in INTERNAL_PATHS + STAFF_PATHS]


# The Ingresses anyone may reach: the public one, the gateway's (`/v1`) and the uploads' (`/v1/files`).
PUBLIC_INGRESSES = ("inferplane", "inferplane-gateway", "inferplane-files")


def test_the_ingress_routes_every_public_path_and_never_metrics(rendered):
    # NOTE: the gateway's paths (`/v1`) moved to an Ingress of their own (no body limit there: `inferplane-gateway`);
    # what every public Ingress routes together is what was held to the URL configuration here.
    ingresses = [rendered.get("Ingress", name) for name in PUBLIC_INGRESSES]
    for path in _public_paths():
        assert any(_routes(ingress, path) for ingress in ingresses), f"{path} is served by web but not routed"
    for path in (*INTERNAL_PATHS, *STAFF_PATHS, "/metrics/", "/metrics/x", "/metricsx", "/django-admin/login/", "/v1x"):
        assert not any(_routes(ingress, path) for ingress in ingresses), path
    assert any(_routes(ingress, "/v1") for ingress in ingresses)


def test_the_django_admin_is_routed_only_from_the_staff_network(rendered):
    # The admin (every tenant's plans, prices, keys and nodes) was on the public ingress: one phished or guessed
    # staff password was enough from anywhere.
    public, admin = rendered.get("Ingress", "inferplane"), rendered.get("Ingress", "inferplane-admin")
    assert admin["spec"]["rules"][0]["host"] == public["spec"]["rules"][0]["host"]
    assert [path["path"] for path in admin["spec"]["rules"][0]["http"]["paths"]] == ["/django-admin"]
    allowed = admin["metadata"]["annotations"]["nginx.ingress.kubernetes.io/whitelist-source-range"].split(",")
    assert allowed and not {"0.0.0.0/0", "::/0"} & {network.strip() for network in allowed}
    for path in STAFF_PATHS:
        assert _routes(admin, path) and not _routes(public, path)
    assert urls.urlpatterns and any(str(pattern.pattern) == STAFF_PATHS[0].lstrip("/") for pattern in urls.urlpatterns)


def test_the_django_admin_refuses_the_node_networks_where_tenants_engines_run(rendered):
    # The agent pods reach the ingress controller's pods on 443 (`inferplane-agent-egress`: the control plane's public
    # URL where kube-proxy short-cuts the load balancer's address), and their engines share the pod's network and may
    # run a tenant's code. The controller sees them at their pod's address, which is inside INFERPLANE_NODE_NETWORKS
    # (the gateway refuses engines outside it). Before, the admin's default staff network was every private range,
    # 10.0.0.0/8 with it: a tenant's engine had the admin's login form (every tenant's plans, prices, keys and nodes)
    # behind one staff password, the exposure the staff network was there to end.
    import ipaddress

    admin = rendered.get("Ingress", "inferplane-admin")
    allowed = [ipaddress.ip_network(network.strip()) for network in
               admin["metadata"]["annotations"]["nginx.ingress.kubernetes.io/whitelist-source-range"].split(",")]
    node_networks = [ipaddress.ip_network(network.strip()) for network in
                     rendered.config_map("inferplane-config")["data"]["INFERPLANE_NODE_NETWORKS"].split(",")]
    overlapping = [(staff, nodes) for staff in allowed for nodes in node_networks
                   if staff.version == nodes.version and staff.overlaps(nodes)]
    assert not overlapping, f"{rendered.overlay}: the admin admits engines' addresses: {overlapping}"
    assert allowed


def _nginx_size(text: str) -> float:
    """An nginx size (`16m`, `201m`, `512k`, bytes) in bytes; `0` is no limit (`client_max_body_size 0`)."""
    units = {"k": 1024, "m": 1024**2, "g": 1024**3}
    size = int(text[:-1]) * units[text[-1].lower()] if text[-1].lower() in units else int(text)
    return size or math.inf


def test_uploads_have_an_ingress_whose_body_limit_admits_the_largest_file_and_streams_it(rendered):
    # The public ingress's 16m refused, with nginx's own HTML page, every upload between it and the 200 MiB a file
    # may be; and a buffered body is written whole to nginx's disk before the gateway can check the caller's key.
    public, files = rendered.get("Ingress", "inferplane"), rendered.get("Ingress", "inferplane-files")
    assert files["spec"]["rules"][0]["host"] == public["spec"]["rules"][0]["host"]
    assert [path["path"] for path in files["spec"]["rules"][0]["http"]["paths"]] == ["/v1/files"]
    assert _routes(files, "/v1/files") and _routes(files, "/v1/files/file-abc/content") and not _routes(files, "/v1/batches")
    annotations = files["metadata"]["annotations"]
    largest = int(rendered.config_map("inferplane-config")["data"]["INFERPLANE_FILES_MAX_BYTES"])
    assert _nginx_size(annotations["nginx.ingress.kubernetes.io/proxy-body-size"]) > largest
    assert annotations["nginx.ingress.kubernetes.io/proxy-request-buffering"] == "off"
    request_limit = _nginx_size(public["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-body-size"])
    assert MAX_BODY_BYTES < request_limit < largest, "every other path keeps the request's own limit"
    # The console's batch form goes through the public ingress: the size it states fits it, with the form's other parts.
    from endpoints.batches.views import CONSOLE_FILE_MAX_BYTES

    assert CONSOLE_FILE_MAX_BYTES + 64 * 1024 <= request_limit


def _ingress_of(ingresses: list[dict], path: str) -> dict:
    """The Ingress whose path serves `path`: the longest prefix that matches (as ingress-nginx picks it)."""
    matched = [(len(rule["path"]), ingress) for ingress in ingresses
               for rule in ingress["spec"]["rules"][0]["http"]["paths"] if _matches(rule, path)]
    assert matched, path
    return max(matched, key=lambda found: found[0])[1]


def test_no_gateway_path_has_a_body_limit_at_the_ingress_so_the_gateway_answers_every_413(rendered):
    # nginx's own 413 (a body declared past the ingress's limit: the public ingress's 16m, the uploads' 201m) is an
    # HTML page without `Access-Control-Allow-Origin`: a page calling `/v1` from another origin saw an opaque network
    # error instead. The gateway refuses such a body itself (its limit, in OpenAI's shape, with the CORS headers), and
    # reads no more of one than that limit: the body streams to it unbuffered, never held on nginx's disk.
    public = rendered.get("Ingress", "inferplane")
    ingresses = [rendered.get("Ingress", name) for name in PUBLIC_INGRESSES]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/models",
                 "/v1/files", "/v1/files/file-abc/content", "/v1/batches", "/v1/batches/batch_x/cancel", "/v1/x"):
        ingress = _ingress_of(ingresses, path)
        annotations = ingress["metadata"]["annotations"]
        assert _nginx_size(annotations["nginx.ingress.kubernetes.io/proxy-body-size"]) == math.inf, (
            ingress["metadata"]["name"], path)
        assert annotations["nginx.ingress.kubernetes.io/proxy-request-buffering"] == "off", path
        assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off", path  # streams token by token
        assert ingress["spec"]["rules"][0]["host"] == public["spec"]["rules"][0]["host"]
        assert ingress["spec"]["tls"][0]["hosts"] == [public["spec"]["rules"][0]["host"]]
    assert _nginx_size(public["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-body-size"]) != math.inf


def _egress_rules(rendered, workload: str) -> list[dict]:
    return [rule for policy in _policies_selecting(rendered, workload)
            if "Egress" in policy["spec"]["policyTypes"] for rule in policy["spec"].get("egress", [])]


def test_web_pods_reach_inside_the_network_only_dns_the_databases_and_the_engine_ports_of_the_node_networks(rendered):
    # A node registered on an internal service's address is refused by the control plane (INFERPLANE_NODE_NETWORKS,
    # tests/test_node_networks.py); without an egress policy the gateway could still be aimed at any port inside.
    import ipaddress

    rules = _egress_rules(rendered, "inferplane-web")
    assert rules, "the web pods have an egress policy"
    node_networks = {network.strip() for network in
                     rendered.config_map("inferplane-config")["data"]["INFERPLANE_NODE_NETWORKS"].split(",")}
    engine_ports = [{"port": DEFAULT_ENGINE_PORT_MIN, "endPort": DEFAULT_ENGINE_PORT_MAX, "protocol": "TCP"}]
    internal = [ipaddress.ip_network(cidr) for cidr in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
                                                        "100.64.0.0/10", "169.254.169.254/32", "127.0.0.0/8")]
    for rule in rules:
        assert rule.get("ports"), f"a rule open on every port: {rule}"
        ports = {port["port"] for port in rule["ports"]}
        for peer in rule.get("to", []):
            if "namespaceSelector" in peer:
                assert ports == {53}, "only DNS leaves the namespace by selector"
            block = peer.get("ipBlock")
            if block is None:
                continue
            if rule["ports"] == engine_ports:
                assert block["cidr"] in node_networks and not block.get("except"), block
                continue
            excepted = [ipaddress.ip_network(cidr) for cidr in block.get("except", [])]
            for network in internal:
                if network.subnet_of(ipaddress.ip_network(block["cidr"])):
                    assert any(network.subnet_of(out) for out in excepted), (network, block)
        if "to" not in rule:
            assert ports <= {5432, 6432, 6379}, f"only the databases' ports are open to any address: {rule}"
    assert any(rule["ports"] == engine_ports and {"ipBlock": {"cidr": network}} in rule["to"]
               for rule in rules for network in node_networks), "the node networks' engine ports are reachable"


def test_batch_workers_reach_inside_the_network_only_what_the_web_pods_reach(rendered):
    # A batch line routes through the same directory as the gateway: without the web pods' egress policy a replica on
    # a node registered at an internal address was reachable from the batch workers on any port.
    rules = _egress_rules(rendered, "inferplane-batch-worker")
    assert rules and rules == _egress_rules(rendered, "inferplane-web")


def test_agent_pods_whose_engines_run_tenants_models_reach_no_database_metadata_service_or_address_inside(rendered):
    # Every engine runs in its agent's pod network (its sandbox adds no network namespace), and an engine may run a
    # tenant's code (`trust_remote_code`, a hostile checkpoint). Without an egress policy it reached PostgreSQL and
    # Redis on any address (the gateway's directory, Celery's queues), the cloud's metadata service at
    # 169.254.169.254 (the node's own AWS credentials) and every other address inside the network. The agent needs
    # DNS and HTTPS outside: the control plane's public URL, the Hub, S3.
    import ipaddress

    rules = _egress_rules(rendered, "inferplane-agent")
    assert rules, "the agent pods have an egress policy"
    internal = [ipaddress.ip_network(cidr) for cidr in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
                                                        "100.64.0.0/10", "169.254.169.254/32", "169.254.170.23/32",
                                                        "127.0.0.0/8")]
    for rule in rules:
        assert rule.get("to"), f"a rule open to any address: {rule}"
        assert rule.get("ports"), f"a rule open on every port: {rule}"
        ports = {port["port"] for port in rule["ports"]}
        for peer in rule["to"]:
            if "ipBlock" not in peer:
                namespace = peer.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name")
                assert (namespace, frozenset(ports)) in {("kube-system", frozenset({53})), ("ingress-nginx", frozenset({443}))}, (
                    f"only DNS and the ingress controller's HTTPS are pods by selector: {rule}")
                continue
            assert ports == {443}, f"only HTTPS leaves by address: {rule}"
            block = peer["ipBlock"]
            excepted = [ipaddress.ip_network(cidr) for cidr in block.get("except", [])]
            for network in internal:
                if network.subnet_of(ipaddress.ip_network(block["cidr"])):
                    assert any(network.subnet_of(out) for out in excepted), (network, block)
    assert any({port["port"] for port in rule["ports"]} == {443} for rule in rules), "the control plane is reachable"
