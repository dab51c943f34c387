"""infra/prometheus and infra/grafana: the scrape configuration and the dashboard match the gateway's metrics."""

from __future__ import annotations

import json
import re

import yaml

from tests.infra.conftest import INFRA_DIR

# The series the web processes export (histograms by their _bucket series).
EXPORTED_SERIES = {
    "inferplane_requests_total",
    "inferplane_request_duration_seconds_bucket",
    "inferplane_time_to_first_token_seconds_bucket",
    "inferplane_tokens_total",
    "inferplane_inflight_requests",
    "inferplane_waiting_requests",
    "inferplane_replicas",
    "inferplane_cold_start_seconds_bucket",
    "inferplane_cold_start_phase_seconds_bucket",
    "inferplane_node_gpu_utilization",
    "inferplane_endpoint_info",
    "inferplane_node_info",
    "inferplane_pool_nodes",
    "inferplane_pool_node_hours",
    "inferplane_pool_cost",
    "inferplane_usage_past_reservation_total",
    "inferplane_clock_skew_seconds",
    "inferplane_prompt_render_refusals_total",
    "inferplane_usage_lines_set_aside_total",
    "inferplane_usage_rollups_held",
}
# The only series that carry names; every other one is labelled by ids.
INFO_SERIES = {"inferplane_endpoint_info", "inferplane_node_info"}
# Fleet-wide series: labelled by neither endpoint nor node, so a panel of them selects neither.
FLEET_SERIES = {"inferplane_cold_start_phase_seconds_bucket", "inferplane_pool_nodes", "inferplane_pool_node_hours",
                "inferplane_pool_cost", "inferplane_clock_skew_seconds", "inferplane_prompt_render_refusals_total",
                "inferplane_usage_lines_set_aside_total", "inferplane_usage_rollups_held"}


def _dashboard() -> dict:
    return json.loads((INFRA_DIR / "grafana" / "inferplane.json").read_text())


def _expressions(dashboard: dict) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def _series(expression: str) -> set[str]:
    return set(re.findall(r"\binferplane_[a-z_]+", expression))


def test_dashboard_charts_every_exported_series_and_no_other():
    used = set().union(*map(_series, _expressions(_dashboard())))
    histogram_companions = {
        name.removesuffix("_count") + "_bucket" for name in used if name.endswith("_count")
    }
    used = {name for name in used if not name.endswith("_count")} | histogram_companions
    assert used == EXPORTED_SERIES


def test_dashboard_has_the_panels_an_operator_needs():
    titles = " / ".join(panel["title"].lower() for panel in _dashboard()["panels"])
    for topic in ("requests", "latency", "first token", "tokens", "replicas", "cold starts", "queue", "gpu"):
        assert topic in titles, topic


def test_dashboard_panels_are_well_formed():
    dashboard = _dashboard()
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            for variable in re.findall(r"\$(\w+)", target["expr"]):
                assert variable.startswith("__") or variable in variables, variable


def test_gateway_registry_exports_only_series_the_dashboard_knows():
    from endpoints.gateway.metrics import REGISTRY

    suffix = {"counter": "_total", "histogram": "_bucket", "gauge": ""}
    exported = {family.name + suffix[family.type] for family in REGISTRY.collect()}
    assert exported <= EXPORTED_SERIES, sorted(exported - EXPORTED_SERIES)


def test_gateway_series_are_labelled_by_ids_and_only_the_info_series_carry_names():
    from endpoints.gateway import metrics

    collectors = {collector._name: collector for collector in vars(metrics).values()
                  if isinstance(collector, metrics.Counter | metrics.Gauge | metrics.Histogram)}
    for name, collector in collectors.items():
        labels = set(collector._labelnames)
        assert not labels & {"endpoint", "node"}, name
        if any(name.startswith(series) for series in INFO_SERIES):
            assert "name" in labels, name
        else:
            assert "name" not in labels, name
        if "endpoint_id" in labels:
            assert "organization_id" in labels, name


def test_dashboard_selects_endpoints_and_nodes_by_id_through_the_info_series():
    for expression in _expressions(_dashboard()):
        assert not re.search(r"\b(endpoint|node)\s*=~?", expression), expression
        used = _series(expression) - INFO_SERIES
        if used <= FLEET_SERIES:
            continue
        if any(name.startswith("inferplane_node_") for name in used):
            assert "on (node_id)" in expression and "inferplane_node_info{" in expression, expression
        else:
            assert "on (endpoint_id)" in expression, expression
            assert 'inferplane_endpoint_info{organization_id=~"$organization", name=~"$endpoint"}' in expression
    variables = {variable["name"]: variable for variable in _dashboard()["templating"]["list"]}
    assert "inferplane_endpoint_info" in variables["endpoint"]["definition"]
    assert "inferplane_node_info" in variables["node"]["definition"]


def test_prometheus_sends_the_metrics_token_from_a_mounted_secret():
    config = yaml.safe_load((INFRA_DIR / "prometheus" / "prometheus.yml").read_text())
    (web,) = [job for job in config["scrape_configs"] if job["job_name"] == "inferplane-web"]
    assert web["authorization"]["type"] == "Bearer"
    assert web["authorization"]["credentials_file"].startswith("/etc/prometheus/secrets/")
    assert "credentials" not in web["authorization"], "the token is never written into the configuration"


def test_prometheus_scrapes_the_web_pods_metrics_port():
    config = yaml.safe_load((INFRA_DIR / "prometheus" / "prometheus.yml").read_text())
    (web,) = [job for job in config["scrape_configs"] if job["job_name"] == "inferplane-web"]
    assert web["metrics_path"] == "/metrics"
    keep = {
        tuple(rule["source_labels"]): rule["regex"]
        for rule in web["relabel_configs"]
        if rule.get("action") == "keep"
    }
    assert (
        keep[
            (
                "__meta_kubernetes_pod_label_app_kubernetes_io_part_of",
                "__meta_kubernetes_pod_label_app_kubernetes_io_component",
            )
        ]
        == "inferplane;web"
    )
    assert keep[("__meta_kubernetes_pod_container_port_name",)] == "http"


def test_prometheus_scrapes_every_celery_workers_metrics_port_with_the_same_token():
    """Before, no job scraped a worker: what a worker counts (the lines its replays of the files bucket set aside)
    was in its log alone."""
    config = yaml.safe_load((INFRA_DIR / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    worker = jobs["inferplane-worker"]
    assert worker["metrics_path"] == "/metrics"
    assert worker["authorization"] == jobs["inferplane-web"]["authorization"]
    keep = {tuple(rule["source_labels"]): rule["regex"] for rule in worker["relabel_configs"]
            if rule.get("action") == "keep"}
    components = keep[("__meta_kubernetes_pod_label_app_kubernetes_io_part_of",
                       "__meta_kubernetes_pod_label_app_kubernetes_io_component")]
    for component in ("worker", "batch-worker"):
        assert re.fullmatch(components, f"inferplane;{component}"), component
    for component in ("web", "beat", "agent"):
        assert not re.fullmatch(components, f"inferplane;{component}"), component
    assert keep[("__meta_kubernetes_pod_container_port_name",)] == "metrics"


def test_the_set_aside_panel_charts_the_workers_lines_beside_the_gateways():
    (panel,) = [panel for panel in _dashboard()["panels"]
                if any("inferplane_usage_lines_set_aside_total" in target["expr"] for target in panel["targets"])]
    for target in panel["targets"]:
        assert "job=" not in target["expr"], "both jobs: the gateways' and the workers'"
        assert re.search(r"by \((job, reason|reason, job)\)", target["expr"]), target["expr"]
    assert "inferplane-worker" in panel["description"]
