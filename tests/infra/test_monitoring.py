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
    "inferplane_node_gpu_utilization",
}


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
