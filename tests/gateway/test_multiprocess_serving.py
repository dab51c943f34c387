"""One web pod, several gateway processes on one port (`controlplane.serve`, `WEB_CONCURRENCY`):
limits stay exact across them, every request leaves exactly one usage row, and `/metrics`, whichever
process answers it, reports the pod's sums.

Which process serves a request is the kernel's choice (they accept on one socket), so each test first
opens keep-alive connections until it holds one to each process: a connection stays with the process
that accepted it. The process behind a connection is told by the per-process counter files of
prometheus_client's multiprocess mode.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from billing.models import UsageRecord
from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import ApiKey, Scope
from controlplane.accounts.services import Actor
from tests.conftest import start_web_server, wait_until
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = [{"role": "user", "content": "Hello"}]
TOKEN = "scrape-" + "Mp4w" * 10
NUM_WORKERS = 2


@pytest.fixture
def pod(transactional_db, tmp_path):
    """The web process as a pod runs it: two gateway processes, one port, a shared metrics folder."""
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    (metrics_dir / "counter_1.db").write_bytes(b"left by a previous run")  # the launcher empties the folder
    child, base_url = start_web_server(
        tmp_path, name="pod", workers=NUM_WORKERS, server_args=("--timeout-keep-alive", "120"),
        extra_env={"INFERPLANE_METRICS_TOKEN": TOKEN, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)})

    class Pod:
        url = base_url
        metrics = metrics_dir

    yield Pod
    child.stop()


def _served_by_process(metrics_dir: Path) -> Counter:
    """Requests each gateway process has finished, from its own counter file."""
    served = Counter()
    for path in metrics_dir.glob("counter_*.db"):
        pid = int(path.stem.rsplit("_", 1)[1])
        for metric in MultiProcessCollector.merge([str(path)]):
            served[pid] += sum(s.value for s in metric.samples if s.name == "inferplane_requests_total")
    return served


def _chat(client: httpx.Client, key: str, model: str) -> httpx.Response:
    return client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": model, "messages": MESSAGES, "max_tokens": 1}, timeout=30)


def _fold(client: httpx.Client) -> None:
    """Make the process at the other end of `client`'s connection write its counts to its file now: a process
    folds its counts before it answers a scrape (and otherwise once a second, `metrics.FOLD_EVERY_S`)."""
    assert client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def _counted(pod, client: httpx.Client, total: int) -> Counter:
    """The files once they count `total` requests, scraping through `client` until then (a request's count is
    taken at its end, after its answer: a scrape right after the answer may come first)."""
    def counts() -> Counter | None:
        _fold(client)
        now = _served_by_process(pod.metrics)
        return now if sum(now.values()) == total else None
    return wait_until(counts, 30, message=f"{total} requests counted")


def _connection_to_each_process(pod, key: str, model: str) -> dict[int, httpx.Client]:
    """A keep-alive connection to every gateway process of the pod, keyed by the process's pid."""
    connections: dict[int, httpx.Client] = {}
    # NOTE: a request is attributed to the process whose count changed, once the files count every request sent
    # so far; each is scraped for through its own connection, which makes that process fold its count at once.
    before = _served_by_process(pod.metrics)
    for _ in range(200):
        client = httpx.Client(base_url=pod.url, limits=httpx.Limits(max_connections=1))
        assert _chat(client, key, model).status_code == 200
        after = _counted(pod, client, sum(before.values()) + 1)
        (pid,) = (after - before).keys()
        before = after
        if pid in connections:
            client.close()
        else:
            connections[pid] = client
        if len(connections) == NUM_WORKERS:
            return connections
    raise AssertionError(f"200 connections reached only processes {sorted(connections)}")


def test_the_request_limit_is_exact_across_the_gateway_processes_of_one_pod(pod, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(token_delay_ms=5))
    connections = _connection_to_each_process(pod, tenant.key, endpoint.name)
    limited = create_api_key(Actor(user=tenant.owner), tenant.org, name="limited", scopes=[Scope.INFERENCE])
    ApiKey.objects.filter(pk=limited.api_key.pk).update(requests_per_minute=5)

    statuses: list[int] = []

    def send_six(client: httpx.Client) -> None:
        for _ in range(6):
            statuses.append(_chat(client, limited.plain, endpoint.name).status_code)

    threads = [threading.Thread(target=send_six, args=(client,)) for client in connections.values()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    # Twelve requests at once through both processes: five pass (ten if a minute boundary fell inside).
    assert len(statuses) == 12
    assert statuses.count(200) in (5, 10) and statuses.count(429) == 12 - statuses.count(200)
    rows = wait_until(lambda: (found := list(UsageRecord.objects.filter(api_key_id=limited.api_key.pk)))
                      and len(found) >= statuses.count(200) and found, 15, message="the usage rows")
    assert len(rows) == statuses.count(200)
    assert len({row.request_id for row in rows}) == len(rows)
    for client in connections.values():
        client.close()


def test_metrics_from_any_gateway_process_of_a_pod_sum_every_process(pod, tenant, start_mock_upstream):
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    # NOTE: which process serves a connection is the kernel's choice; what matters is that both served some
    # requests and that a scrape of either answers the pod's total, not its own share.
    connections = _connection_to_each_process(pod, tenant.key, endpoint.name)
    (first_pid, first), (second_pid, second) = connections.items()
    counted_before = sum(_served_by_process(pod.metrics).values())  # every request so far (`_connection_to_each_process`)
    for _ in range(3):
        assert _chat(first, tenant.key, endpoint.name).status_code == 200
    for _ in range(5):
        assert _chat(second, tenant.key, endpoint.name).status_code == 200
    _fold(first)
    counted = _counted(pod, second, counted_before + 8)
    total = float(sum(counted.values()))
    assert counted[first_pid] > 0 and counted[second_pid] > 0  # both processes' files, merged below

    for client in (first, second, httpx.Client(base_url=pod.url)):
        response = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status_code == 200
        samples = [sample for family in text_string_to_metric_families(response.text) for sample in family.samples]
        ok = [s.value for s in samples if s.name == "inferplane_requests_total"
              and s.labels == {"endpoint_id": str(endpoint.pk), "organization_id": str(tenant.org.pk), "status": "ok"}]
        assert ok == [total]
        durations = [s.value for s in samples if s.name == "inferplane_request_duration_seconds_count"
                     and s.labels["endpoint_id"] == str(endpoint.pk)]
        assert durations == [total]
        inflight = [s.value for s in samples if s.name == "inferplane_inflight_requests"
                    and s.labels["endpoint_id"] == str(endpoint.pk)]
        assert inflight == [0.0]
        assert {s.labels["endpoint_id"] for s in samples if s.name == "inferplane_replicas"} == {str(endpoint.pk)}
        client.close()


def test_metrics_of_a_multi_process_pod_still_need_the_token(pod):
    for headers in ({}, {"Authorization": f"Bearer {TOKEN}x"}):
        response = httpx.get(f"{pod.url}/metrics", headers=headers)
        assert response.status_code == 401
        assert response.content == b""
        assert "server" not in response.headers  # no software named to a caller (controlplane.serve)


def test_no_answer_of_a_pod_names_its_server(pod, tenant, start_mock_upstream):
    # `server: uvicorn` named the software and its maker to every caller (a scanner's first finding); `date` stays
    # (RFC 9110 asks an origin server with a clock for it).
    endpoint = serve_endpoint(tenant.org, start_mock_upstream())
    with httpx.Client(base_url=pod.url) as client:
        answers = [_chat(client, tenant.key, endpoint.name), _chat(client, "sk-not-a-key", endpoint.name),
                   client.get("/login/"), client.get("/healthz")]
    assert [answer.status_code for answer in answers] == [200, 401, 200, 200]
    for answer in answers:
        assert "server" not in answer.headers and "date" in answer.headers
