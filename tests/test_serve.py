"""`controlplane.serve`, the web process's launcher: how many gateway processes, and their metrics folder."""

from __future__ import annotations

import os

import pytest

from controlplane import serve


def test_a_pod_runs_one_gateway_process_per_core_it_may_use_by_default():
    assert serve.num_workers({}) == serve.available_cores()
    assert 1 <= serve.available_cores() <= len(os.sched_getaffinity(0))


def test_web_concurrency_sets_the_number_of_gateway_processes():
    assert serve.num_workers({"WEB_CONCURRENCY": "3"}) == 3


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_web_concurrency_that_is_not_a_positive_count_stops_the_start(value):
    with pytest.raises(SystemExit, match="WEB_CONCURRENCY"):
        serve.num_workers({"WEB_CONCURRENCY": value})


def test_the_cgroup_cpu_limit_caps_the_default(tmp_path, monkeypatch):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")  # a pod's `limits.cpu: 1.5`
    monkeypatch.setattr(serve, "CGROUP_CPU_MAX", cpu_max)
    assert serve.available_cores() == min(2, len(os.sched_getaffinity(0)))
    cpu_max.write_text("max 100000\n")
    assert serve.available_cores() == len(os.sched_getaffinity(0))


def test_a_cgroup_v1_cpu_limit_caps_the_default_too(tmp_path, monkeypatch):
    # A node still on cgroup v1 has no cpu.max: a pod limited to 1.5 CPUs there must not start one
    # gateway process per core of the node (each a whole gateway, within one memory limit).
    quota, period = tmp_path / "cpu.cfs_quota_us", tmp_path / "cpu.cfs_period_us"
    quota.write_text("150000\n")
    period.write_text("100000\n")
    monkeypatch.setattr(serve, "CGROUP_CPU_MAX", tmp_path / "absent")
    monkeypatch.setattr(serve, "CGROUP_V1_CPU_QUOTA", quota, raising=False)
    monkeypatch.setattr(serve, "CGROUP_V1_CPU_PERIOD", period, raising=False)
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert serve.available_cores() == 2
    quota.write_text("-1\n")  # no limit
    assert serve.available_cores() == 64


def test_the_metrics_folder_is_emptied_before_the_workers_start(tmp_path):
    folder = tmp_path / "prometheus"
    (folder / "nested").mkdir(parents=True)
    (folder / "counter_123.db").write_bytes(b"counts of a previous container")
    environ = {"PROMETHEUS_MULTIPROC_DIR": str(folder)}
    assert serve.prepare_metrics_dir(2, environ) == folder
    assert folder.is_dir() and list(folder.iterdir()) == []


def test_several_workers_without_a_configured_folder_get_a_private_one():
    environ: dict[str, str] = {}
    folder = serve.prepare_metrics_dir(2, environ)
    assert folder is not None and folder.is_dir() and environ["PROMETHEUS_MULTIPROC_DIR"] == str(folder)
    assert serve.prepare_metrics_dir(1, {}) is None  # one process keeps its metrics in memory


def _uvicorn_args(monkeypatch, given: tuple[str, ...]) -> list[str]:
    """The arguments `controlplane.serve` hands uvicorn for `given`."""
    started = []
    monkeypatch.setattr(serve.uvicorn, "main", lambda args: started.append(args))
    monkeypatch.setattr(serve, "prepare_metrics_dir", lambda workers: None)
    serve.main(["--workers", "1", "--port", "0", *given])
    (args,) = started
    return args


@pytest.mark.parametrize(("given", "expected"), [((), "--no-access-log"), (("--access-log",), "--access-log")])
def test_uvicorns_access_line_is_off_unless_asked_for(monkeypatch, given, expected):
    # The application logs each request itself (controlplane.access_log); uvicorn's line cost the gateway CPU.
    args = _uvicorn_args(monkeypatch, given)
    assert expected in args and ("--access-log" in args) != ("--no-access-log" in args)


@pytest.mark.parametrize(("given", "expected"), [((), "--no-server-header"), (("--server-header",), "--server-header")])
def test_no_server_header_names_the_software_unless_asked_for(monkeypatch, given, expected):
    args = _uvicorn_args(monkeypatch, given)
    assert expected in args and ("--server-header" in args) != ("--no-server-header" in args)


@pytest.mark.parametrize(("given", "expected"), [((), "--timeout-graceful-shutdown=10"),
                                                 (("--timeout-graceful-shutdown=30",), "--timeout-graceful-shutdown=30")])
def test_uvicorns_graceful_wait_is_bounded_unless_given(monkeypatch, given, expected):
    # After the gateway's drain (endpoints.gateway.drain) uvicorn waits for the connections left; by default for ever,
    # so the image's own command (which passes no bound) waited for an upload or a console request until SIGKILL.
    args = _uvicorn_args(monkeypatch, given)
    assert [arg for arg in args if arg.startswith("--timeout-graceful-shutdown")] == [expected]


def test_an_operators_malloc_arena_max_is_left_as_it_is():
    # glibc read it as the process started, and the workers inherit it.
    environ = {"MALLOC_ARENA_MAX": "8"}
    serve.limit_malloc_arenas(environ)
    assert environ == {"MALLOC_ARENA_MAX": "8"}
