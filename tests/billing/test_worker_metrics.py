"""A Celery worker's own `/metrics`: what its prefork children count (the lines its replay of the files bucket sets
aside) reaches the operator's Prometheus, under the web's bearer-token rule, never open."""

import socket
import sys
import threading
import time

import httpx
import psutil
import pytest
import yaml
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.parser import text_string_to_metric_families

from billing import journal_shipping
from billing.tasks import replay_shipped_usage
from controlplane import worker_metrics
from tests.batches.conftest import files_bucket, files_bucket_name, s3_child, s3_server  # noqa: F401 - fixtures used here
from tests.billing.conftest import usage_report
from tests.billing.test_journal_shipping import _put_signed
from tests.billing.test_usage_journal import line_of_a_newer_version
from tests.conftest import REPO_ROOT, child_env
from tests.factories import EndpointFactory
from tests.processes import ChildProcess, free_port, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "scrape-" + "Wk7r" * 10
SET_ASIDE = "inferplane_usage_lines_set_aside_total"


def _set_aside(text: str, reason: str) -> float:
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == SET_ASIDE and sample.labels.get("reason") == reason)


def _as_the_pod_starts_it(deployment: str) -> list[str]:
    """The command of a worker pod's container, as its manifest has it (`celery` run by this Python), and no
    `PROMETHEUS_MULTIPROC_DIR` set there or in the settings' ConfigMap."""
    manifest = REPO_ROOT / "infra" / "k8s" / "base" / f"{deployment}.yaml"
    (container,) = next(doc for doc in yaml.safe_load_all(manifest.read_text())
                        if doc["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "PROMETHEUS_MULTIPROC_DIR" not in {variable["name"] for variable in container.get("env", [])}
    assert "PROMETHEUS_MULTIPROC_DIR" not in (REPO_ROOT / "infra" / "k8s" / "base" / "config.env").read_text()
    command = container["command"] + container.get("args", [])
    assert command[0] == "celery" and "worker" in command
    return [sys.executable, "-m", "celery", *command[1:]]


def _worker_env(port: int, **more: str) -> dict[str, str]:
    env = child_env()
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # as the pods: unset, unless `more` sets it
    return env | {"INFERPLANE_METRICS_TOKEN": TOKEN, "INFERPLANE_WORKER_METRICS_PORT": str(port), **more}


def _scrape(port: int, within_s: float) -> httpx.Response:
    def scraped():
        try:
            return httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {TOKEN}"},
                             timeout=5)
        except httpx.TransportError:
            return None

    return wait_until(scraped, within_s, message="the worker's /metrics")


def _listeners_on(port: int, worker: ChildProcess) -> list[int]:
    """The processes of the worker's group that hold a listening socket on `port` (a child that exits between its
    listing and the read of its sockets holds none: a pool's child comes and goes)."""
    main = psutil.Process(worker.pid)
    listeners = []
    for process in [main, *main.children(recursive=True)]:
        try:
            connections = process.net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            if process.pid == main.pid:
                raise
            continue
        listeners += [process.pid for connection in connections
                      if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port]
    return listeners


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
        _as_the_pod_starts_it("worker"),
        _worker_env(port, INFERPLANE_USAGE_JOURNAL_SHIP="1", PROMETHEUS_MULTIPROC_DIR=str(metrics_dir)),
        tmp_path / "worker.log")
    try:
        assert replay_shipped_usage.delay().get(timeout=90) == 0  # its one line unreadable: set aside, counted
        url = f"http://127.0.0.1:{port}/metrics"
        answer = _scrape(port, 60)
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


@pytest.mark.parametrize("deployment", ["worker", "batch-worker"])
def test_a_worker_pod_started_as_its_manifest_starts_it_serves_what_its_children_count(
        deployment, files_bucket, tmp_path):  # noqa: F811
    """The pods' command, `PROMETHEUS_MULTIPROC_DIR` unset. Before, the worker listened on nothing (the scrape was
    refused until the test gave up; its log: "prometheus_client was imported before the worker started"): Celery's
    Django fixup had imported prometheus_client before `celeryd_init`, where the folder was made. The pool's children
    hold no copy of the listening socket."""
    port = free_port()
    if deployment == "worker":
        endpoint = EndpointFactory()
        data = line_of_a_newer_version(usage_report(endpoint, request_id="newer-w2"))
        _put_signed(files_bucket, journal_shipping.PREFIX + "web-w2-1.jsonl", data)
    worker = ChildProcess(_as_the_pod_starts_it(deployment), _worker_env(port, INFERPLANE_USAGE_JOURNAL_SHIP="1"),
                          tmp_path / "worker.log")
    try:
        answer = _scrape(port, 60)
        assert answer.status_code == 200, worker.log_tail()
        if deployment == "worker":
            assert replay_shipped_usage.delay().get(timeout=90) == 0  # counted in a pool child
            assert _set_aside(_scrape(port, 10).text, "unreadable") == 1
        assert _listeners_on(port, worker) == [worker.pid]
    finally:
        worker.stop(timeout_s=30)


def test_a_worker_started_while_its_broker_is_down_serves_metrics_all_through_the_outage(tmp_path):
    """Before, the server started at `worker_ready`, once the broker answered: the scrape of a worker whose broker
    was down was refused until the test gave up."""
    port = free_port()
    worker = ChildProcess(_as_the_pod_starts_it("worker"),
                          _worker_env(port, CELERY_BROKER_URL=f"redis://127.0.0.1:{free_port()}/0"),
                          tmp_path / "worker.log")
    try:
        wait_until(lambda: "Cannot connect" in worker.log_text(), 60, message="the worker's broker refused")
        answer = _scrape(port, 10)
        assert answer.status_code == 200, worker.log_tail()
        assert " ready." not in worker.log_text()  # never connected: no `worker_ready`
    finally:
        worker.stop(timeout_s=30)


def _connect(port: int, num: int, timeout_s: float) -> list[socket.socket]:
    """`num` connections to the server on `port`, each given a moment to be accepted before the next. NOTE: opened at
    once, the seventh overflowed the listen backlog (5) before the server's thread had accepted any, and its SYN was
    sent again only a second later: 50 connections took 8 s."""
    connections = []
    for _ in range(num):
        connections.append(socket.create_connection(("127.0.0.1", port), timeout=timeout_s))
        time.sleep(0.02)
    return connections


def _request_threads() -> int:
    return sum("process_request_thread" in thread.name for thread in threading.enumerate())


def test_idle_connections_neither_pile_up_threads_nor_stay_open(tmp_path, monkeypatch):
    """Before, each connection got a thread of its own, held with no timeout: 50 silent sockets, 50 threads, open for
    good."""
    monkeypatch.setattr(worker_metrics, "IDLE_TIMEOUT_S", 1.0, raising=False)
    port = free_port()
    server = worker_metrics.serve(port, TOKEN, str(tmp_path))
    before = _request_threads()
    idle = []
    try:
        idle.extend(_connect(port, 50, timeout_s=5))
        time.sleep(0.5)
        assert _request_threads() - before <= getattr(worker_metrics, "MAX_CONNECTIONS", 8)
        for connection in idle:  # every one closed by the server: within the timeout, or at once past the cap
            assert connection.recv(1) == b""
        wait_until(lambda: _request_threads() == before, 5, message="the handlers' threads gone")
        answer = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {TOKEN}"},
                           timeout=5)
        assert answer.status_code == 200
    finally:
        for connection in idle:
            connection.close()
        server.shutdown()
        server.server_close()


def test_sockets_trickling_a_byte_at_a_time_neither_keep_prometheus_out_nor_hold_a_slot_past_the_deadline(
        tmp_path, monkeypatch):
    """Before, the idle timeout was per read and the connection past the cap was the one closed: `MAX_CONNECTIONS`
    sockets sending a byte each second (under `IDLE_TIMEOUT_S`) kept every scrape out (the test saw "Server
    disconnected without sending a response" for each) and stayed open past the deadline. Now a newcomer takes the
    oldest trickler's place, and a request not whole `REQUEST_DEADLINE_S` after its accept is closed."""
    monkeypatch.setattr(worker_metrics, "IDLE_TIMEOUT_S", 3.0)
    monkeypatch.setattr(worker_metrics, "REQUEST_DEADLINE_S", 2.0, raising=False)
    port = free_port()
    server = worker_metrics.serve(port, TOKEN, str(tmp_path))
    slow = _connect(port, worker_metrics.MAX_CONNECTIONS, timeout_s=10)
    closed_at: dict[int, float] = {}
    trickling_until = time.monotonic() + 6
    started = time.monotonic()

    def trickle():
        while time.monotonic() < trickling_until:
            for number, connection in enumerate(slow):
                if number in closed_at:
                    continue
                try:
                    connection.send(b"G")
                except OSError:
                    closed_at[number] = time.monotonic() - started
            time.sleep(1)

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    try:
        time.sleep(0.5)
        for _ in range(3):  # Prometheus's scrapes while the slots are taken
            scraped_at = time.monotonic()
            answer = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {TOKEN}"},
                               timeout=5)
            assert answer.status_code == 200
            assert time.monotonic() - scraped_at < 1.0
            time.sleep(1)
        trickler.join(10)
        for connection in slow:  # every trickler closed by now: within the deadline, or for a scrape
            connection.settimeout(1)
            try:
                assert connection.recv(1) == b""
            except ConnectionResetError:
                pass
    finally:
        for connection in slow:
            connection.close()
        server.shutdown()
        server.server_close()


def test_a_worker_given_a_folder_that_does_not_exist_yet_makes_it_and_serves(tmp_path):
    """`PROMETHEUS_MULTIPROC_DIR` set (say in a manifest) to a folder not made yet. Before, the worker died as Django
    was set up: endpoints.gateway.metrics built its multiprocess collector on a folder that did not exist."""
    port = free_port()
    worker = ChildProcess(_as_the_pod_starts_it("worker"),
                          _worker_env(port, PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "not-yet" / "metrics")),
                          tmp_path / "worker.log")
    try:
        assert _scrape(port, 60).status_code == 200, worker.log_tail()
        assert (tmp_path / "not-yet" / "metrics").is_dir()
    finally:
        worker.stop(timeout_s=30)
