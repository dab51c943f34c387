"""The gateway benchmark's vLLM streaming rows (`bench/stream_pairs.py`, issue #20): K alternating pairs of a
direct run and a proxied run, each pair's ratio, their median (what a target is judged on) and the ratio of the
means, with the proxy's CPU per streamed token. On a tiny duration against the mock, through the bare-proxy floor
(`bench/bare_proxy.py`) standing in for the gateway: no vLLM, no database."""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import httpx
import pytest

from bench.stream_pairs import stream_pairs
from tests.processes import ChildProcess, free_port, wait_until


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def mock_and_proxy(tmp_path: Path):
    """The mock (16 tokens a stream, 1 ms apart) and the bare proxy in front of it; their addresses and the proxy's pid."""
    mock_port, proxy_port = free_port(), free_port()
    mock = ChildProcess([sys.executable, "-m", "tests.fakes.mock_openai", "--port", str(mock_port), "--token-delay-ms", "1"],
                        dict(os.environ), tmp_path / "mock.log")
    mock_url, proxy_url = f"http://127.0.0.1:{mock_port}", f"http://127.0.0.1:{proxy_port}"
    proxy = ChildProcess([sys.executable, "-m", "uvicorn", "bench.bare_proxy:app", "--host", "127.0.0.1", "--port", str(proxy_port),
                          "--log-level", "warning", "--no-access-log"],
                         {**os.environ, "BARE_PROXY_UPSTREAM": mock_url}, tmp_path / "proxy.log")
    try:
        wait_until(lambda: _healthy(mock_url + "/health"), 30, message="the mock")
        wait_until(lambda: _healthy(proxy_url + "/health"), 30, message="the bare proxy")
        yield mock_url, proxy_url, proxy.pid
    finally:
        proxy.stop()
        mock.stop()


def test_streaming_rows_are_alternating_pairs_judged_on_the_median(mock_and_proxy):
    mock_url, proxy_url, proxy_pid = mock_and_proxy
    row = stream_pairs(mock_url, proxy_url, "not-checked", "mock", 4, 0.4, 16, pairs=3, proxy_pid=proxy_pid)

    assert [run["order"] for run in row["pairs"]] == [["direct", "gateway"], ["gateway", "direct"], ["direct", "gateway"]]
    for run in row["pairs"]:
        direct, through = run["direct"], run["gateway"]
        assert direct["errors"] == through["errors"] == 0
        assert direct["tokens"] > 0 and through["tokens"] > 0
        assert run["tokens_per_s_ratio"] == round(through["tokens_per_s"] / direct["tokens_per_s"], 3)
        # the proxy's CPU over its own runs only, per token it streamed; none for a direct run
        assert through["proxy_cpu_s"] > 0
        assert through["proxy_cpu_us_per_token"] == round(through["proxy_cpu_s"] / through["tokens"] * 1e6, 1)
        assert "proxy_cpu_s" not in direct

    ratios = [run["tokens_per_s_ratio"] for run in row["pairs"]]
    assert row["median_ratio"] == round(statistics.median(ratios), 3)
    # the figure the summary and the targets read, under its old name, is the median
    assert row["tokens_per_s_ratio"] == row["median_ratio"]
    assert row["judged_on"] == "median_ratio"
    direct_mean = statistics.mean(run["direct"]["tokens_per_s"] for run in row["pairs"])
    gateway_mean = statistics.mean(run["gateway"]["tokens_per_s"] for run in row["pairs"])
    assert row["direct"]["tokens_per_s"] == round(direct_mean, 1)
    assert row["gateway"]["tokens_per_s"] == round(gateway_mean, 1)
    assert row["ratio_of_means"] == round(round(gateway_mean, 1) / round(direct_mean, 1), 3)
    # a single run's keys, so that the benchmark's detail tables read the combined sides as they read one run
    for side in ("direct", "gateway"):
        assert row[side]["runs"] == 3
        assert row[side]["requests"] == sum(run[side]["requests"] for run in row["pairs"])
        assert row[side]["ttft_p50_ms"] == round(statistics.median(run[side]["ttft_p50_ms"] for run in row["pairs"]), 2)
    assert row["added_ttft_p50_ms"] == round(row["gateway"]["ttft_p50_ms"] - row["direct"]["ttft_p50_ms"], 3)
    assert row["gateway"]["proxy_cpu_us_per_token"] == round(
        sum(run["gateway"]["proxy_cpu_s"] for run in row["pairs"]) / row["gateway"]["tokens"] * 1e6, 1)


def test_a_pair_count_below_one_is_refused():
    with pytest.raises(ValueError):
        stream_pairs("http://127.0.0.1:9", "http://127.0.0.1:9", "k", "mock", 1, 0.1, 1, pairs=0)
