"""A Celery worker's own `/metrics`: what its prefork children count (the lines its replay of the files bucket sets
aside) reaches the operator's Prometheus, under the web's bearer-token rule, never open."""

import sys

import httpx
import pytest
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.parser import text_string_to_metric_families

from billing import journal_shipping
from billing.tasks import replay_shipped_usage
from controlplane import worker_metrics
from tests.batches.conftest import files_bucket, files_bucket_name, s3_child, s3_server  # noqa: F401 - fixtures used here
from tests.billing.conftest import usage_report
from tests.billing.test_journal_shipping import _put_signed
from tests.billing.test_usage_journal import line_of_a_newer_version
from tests.conftest import child_env
from tests.factories import EndpointFactory
from tests.processes import ChildProcess, free_port, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "scrape-" + "Wk7r" * 10
SET_ASIDE = "inferplane_usage_lines_set_aside_total"


def _set_aside(text: str, reason: str) -> float:
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == SET_ASIDE and sample.labels.get("reason") == reason)


def _a_previous_runs_count(directory) -> None:
    """A counter file as a process of the worker's previous run left it in the pod's folder: 1000 lines set aside."""
    directory.mkdir()
    files = MmapedDict(str(directory / "counter_1.db"))
    files.write_value(mmap_key("inferplane_usage_lines_set_aside", SET_ASIDE, ["reason"], ["unreadable"], "help"),
                      1000.0, 0.0)
    files.close()


def test_what_a_workers_prefork_child_sets_aside_is_scraped_from_the_worker_with_its_token_only(
        files_bucket, tmp_path):  # noqa: F811
    """Before, no worker served /metrics (the test's scrape of the worker's port was refused): the lines the worker's
    replay of the bucket set aside were counted in a pool child's memory and shown in its log alone."""
    endpoint = EndpointFactory()
    data = line_of_a_newer_version(usage_report(endpoint, request_id="newer-w1"))
    _put_signed(files_bucket, journal_shipping.PREFIX + "web-w1-1.jsonl", data)
    metrics_dir = tmp_path / "metrics"
    _a_previous_runs_count(metrics_dir)
    port = free_port()
    worker = ChildProcess(
        [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "--pool=prefork", "--concurrency=2",
         "--loglevel=INFO", "--without-gossip", "--without-mingle", "-n", f"metrics-{port}@%h"],
        child_env() | {"INFERPLANE_METRICS_TOKEN": TOKEN, "INFERPLANE_WORKER_METRICS_PORT": str(port),
                       "INFERPLANE_USAGE_JOURNAL_SHIP": "1", "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)},
        tmp_path / "worker.log")
    try:
        assert replay_shipped_usage.delay().get(timeout=90) == 0  # its one line unreadable: set aside, counted
        url = f"http://127.0.0.1:{port}/metrics"

        def scraped():
            try:
                return httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
            except httpx.TransportError:
                return None

        answer = wait_until(scraped, 60, message="the worker's /metrics")
        assert answer.status_code == 200
        # Counted in a pool child, read through the main process; the previous run's 1000 emptied at the start.
        assert _set_aside(answer.text, "unreadable") == 1
        for headers in ({}, {"Authorization": "Bearer " + "x" * len(TOKEN)}, {"Authorization": TOKEN}):
            refused = httpx.get(url, headers=headers, timeout=5)
            assert refused.status_code == 401 and SET_ASIDE not in refused.text
    finally:
        worker.stop(timeout_s=30)


def test_a_worker_without_a_metrics_token_serves_no_metrics(tmp_path):
    assert worker_metrics.serve(free_port(), "", str(tmp_path)) is None
    assert worker_metrics.serve(0, TOKEN, str(tmp_path)) is None
