"""Gateway overhead: the same upstream called directly and through the gateway, in the same run.

Proxies, in the same run against the same fast mock, plain and streaming at concurrency 1, 16 and 64:
the gateway, the bare-proxy floor (`bench/bare_proxy.py`: uvicorn + aiohttp, nothing else) and the
LiteLLM proxy (its own virtualenv, installed by `bench/run.sh`; its defaults, no database), side by side
in one table; then the gateway and the floor with N processes each (`--processes`, the gateway through
`controlplane.serve` and `WEB_CONCURRENCY` as a pod runs it). Against the real replica, vLLM's own client
(`vllm bench serve`, random 128-in/64-out, concurrency 16) runs direct and through the gateway in
alternating pairs (`--vllm-bench-pairs`), and the vLLM streaming rows are alternating pairs too at each
concurrency (`--stream-pairs`, `bench/stream_pairs.py`), each judged on the median of its pairs' ratios. The summary (JSON `summary` and `targets_met`, printed
first) holds issue #20's ratios: gateway ÷ floor throughput at c16, added p50/p99 against the floor's,
streaming ÷ direct at c32 and c64 on vLLM, `vllm bench serve` gateway ÷ direct output tokens/s, and
Inferplane ÷ LiteLLM per row. The README's gateway table is what the script prints under "README table".

Upstreams:
  * the fast mock (`tests.fakes.mock_openai`): what the gateway itself costs, and its request rate;
  * a real vLLM replica of the tiny model (CPU engine, the agent's command line): what a client pays.

The gateway is one `python -m controlplane.serve` process (`WEB_CONCURRENCY=1`; uvloop, httptools, no
access log) on a dedicated data folder (`INFERPLANE_DATA_DIR=.data/bench`, embedded PostgreSQL and Redis),
with an organisation, a key, a READY node and one READY replica per endpoint made through the ORM.
Every request takes the production path: key lookup (cached), endpoint and replica lookups
(cached), spend reservation and settlement in Redis, least-outstanding pick in Redis, proxying,
one usage-ledger row, the request log line and metrics.

Request rate and latency (non-streaming) come from `wrk` (closed loop, N connections) with a Lua
script that POSTs a chat body and prints percentiles; streaming time to first token and tokens/s
come from an aiohttp client counting content chunks. Nothing is pinned by default: on a shared 2-core machine a
gateway held to one core waits behind whatever else runs there (vLLM's CPU threads spin on every
core). With `--pin` the gateway runs on core 0 and the mocks and wrk on core 1 for the mock runs.
For the vLLM runs the engine gets the last core (`VLLM_CPU_OMP_THREADS_BIND`; its threads spin at
barriers, so any process sharing its core stalls it) and the gateway and clients the others, direct
and through the gateway alike (`--shared-engine-cores` to let it use every core).

    .venv/bin/python bench/bench_gateway.py [--duration-s 5] [--no-vllm] [--pin] [--processes 2] [--stream-pairs 3]
    make bench ONLY=gateway BENCH_ARGS="--duration-s 3"
    make bench ONLY=gateway BENCH_ARGS=--quick   # a smoke run of every part (writes .data/bench/gateway-quick.json)

A full run takes about 10 minutes on a quiet 2-core machine with the default 5 s per measurement (14 at
load 5-8; it prints its wall time); `--quick` runs every part in a few minutes as a smoke test.
Writes `bench/results/gateway.json` and prints markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DATA_DIR = REPO / ".data" / "bench"
# NOTE: production settings (DEBUG off), as a deployed gateway runs; on plain HTTP, on localhost (its engines too).
ENV = {"INFERPLANE_DATA_DIR": str(DATA_DIR), "DJANGO_SETTINGS_MODULE": "controlplane.settings", "DJANGO_DEBUG": "0",
       "DJANGO_SECRET_KEY": "bench-gateway-only-" + "x" * 40, "ALLOWED_HOSTS": "127.0.0.1,localhost",
       "SECURE_SSL_REDIRECT": "0", "INFERPLANE_ALLOW_LOOPBACK_NODES": "1",
       "INFERPLANE_NODE_NETWORKS": "10.0.0.0/8"}
os.environ.update(ENV)

from bench.stream_pairs import CHAT_BODY, run_streams, stream_pairs  # noqa: E402 - profile_gateway reads run_streams here
from controlplane import embedded  # noqa: E402 - after sys.path is set
from gpu_agent.runtime.engine import cpu_openmp_env  # noqa: E402
from gpu_agent.runtime.tiny_model import build_tiny_model  # noqa: E402
from tests.processes import ChildProcess, free_port  # noqa: E402

# NOTE: production settings refuse to start embedded servers and need an encryption key: start the
# servers here and name them, as a deployment names its own.
os.environ.setdefault("DATABASE_URL", embedded.ensure_postgres())
os.environ.setdefault("REDIS_URL", embedded.ensure_redis())
os.environ.setdefault("INFERPLANE_ENCRYPTION_KEYS", "YmVuY2gtZ2F0ZXdheS1wcm9maWxlLW9ubHktMzJieXQ=")

CONCURRENCY_LEVELS = (1, 16, 64)
STREAM_TOKENS_CONCURRENCY = 32
PROCESSES_LEVELS = (16, 64)  # the N-process rows: where one process saturates
# `vllm bench serve` against the real replica: vLLM's own client, random prompts, fixed concurrency.
VLLM_BENCH = {"dataset": "random", "input_len": 128, "output_len": 64, "concurrency": 16}
# The defaults of a full run, and of `--quick` (a smoke run of every part, minutes; its figures are no result).
FULL = {"duration_s": 5.0, "stream_pairs": 3, "vllm_bench_pairs": 3, "vllm_bench_prompts": 64}
QUICK = {"duration_s": 1.0, "stream_pairs": 2, "vllm_bench_pairs": 1, "vllm_bench_prompts": 16}
# Issue #20's targets, checked in `targets_met`.
TARGET_SHARE_OF_FLOOR_C16 = 0.5
TARGET_ADDED_P50_OVER_FLOOR = 2.0
TARGET_STREAMING_RATIO = 0.95  # vLLM streaming tokens/s ÷ direct at concurrency 32 and 64
TARGET_VLLM_BENCH_RATIO = 0.90
SLOW_MOCK_DELAY_MS = 3  # per token: 48 ms per 16-token answer, so c16 offers ~330 requests/s, below saturation

WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = [[%(body)s]]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %(key)s"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRKJSON {"requests": %%d, "duration_us": %%d, "p50_us": %%d, "p95_us": %%d, ' ..
    '"p99_us": %%d, "mean_us": %%f, "errors": %%d, "non_2xx": %%d}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(95), latency:percentile(99),
    latency.mean, e.connect + e.read + e.write + e.timeout, e.status))
end
"""


# --- processes ------------------------------------------------------------------------------

def Child(args: list[str], log_path: Path, *, cores: str | None = None, env: dict | None = None) -> ChildProcess:  # noqa: N802
    """A child process, optionally pinned to `cores`, with the benchmark's environment."""
    if cores:
        args = ["taskset", "-c", cores, *args]
    return ChildProcess(args, {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, log_path)


def wait_healthy(url: str, child: Child, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.process.poll() is not None:
            raise RuntimeError(f"{url} exited early:\n{child.log_path.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout_s} s")


# --- database rows --------------------------------------------------------------------------

def setup_django() -> None:
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    logging.getLogger("httpx").setLevel(logging.WARNING)


def seed(upstreams: dict[str, str]) -> str:
    """An organisation, a key, a READY node and one READY endpoint per upstream; returns the key."""
    from django.utils import timezone

    from controlplane.accounts.signup import bootstrap_organization
    from endpoints.models import Endpoint, Replica
    from endpoints.nodes.models import Node
    from gpu_agent.protocol import NodeState, ReplicaState

    organization, _, created_key = bootstrap_organization(slug="bench-gateway", owner_email="bench@inferplane.local")
    # NOTE: no agent beats for this node: its heartbeat is set a day ahead so that a sweeper running on
    # the same data folder (another benchmark's Celery beat) does not mark it OFFLINE mid-run.
    # The gateway routes only to a node's own engine ports: the upstreams listen on any free port.
    node, _ = Node.objects.update_or_create(
        name="bench-gateway-node",
        defaults=dict(gpu_type="l4", num_gpus=1, gpu_memory_mb=24_000, secret_lookup="benchgateway", secret_digest="x",
                      state=NodeState.READY, quantizations=["none"], last_heartbeat_at=timezone.now() + timedelta(days=1),
                      engine_port_min=1024, engine_port_max=65535),
    )
    # Limits high enough never to refuse, still counted in Redis on every request.
    organization.api_keys.update(requests_per_minute=100_000_000, tokens_per_minute=1_000_000_000)
    for name, address in upstreams.items():
        # NOTE: kept between runs (its usage rows protect it); only its replica is replaced.
        endpoint, _ = Endpoint.objects.live().update_or_create(
            organization=organization, name=name,
            defaults=dict(model_source="bench/tiny", gpu_type="l4", max_model_len=512, min_replicas=0, max_replicas=1,
                          price_input_per_million="0.10", price_cached_input_per_million="0.05",
                          price_output_per_million="0.30"),
        )
        Replica.objects.filter(endpoint=endpoint).delete()
        Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY, address=address,
                               ready_at=timezone.now())
    return created_key.plain


# --- load generators --------------------------------------------------------------------------

def run_wrk(url: str, key: str, model: str, concurrency: int, duration_s: float, cores: str | None,
            max_tokens: int = 16) -> dict:
    body = json.dumps(CHAT_BODY | {"model": model, "max_tokens": max_tokens})
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(WRK_SCRIPT % {"body": body, "key": key})
    args = ["wrk", "-t", "1", "-c", str(concurrency), "-d", f"{max(1, round(duration_s))}s", "--timeout", "30s", "-s", script.name, url]
    if cores:
        args = ["taskset", "-c", cores, *args]
    try:
        output = subprocess.run(args, capture_output=True, text=True, timeout=duration_s + 60, check=True).stdout
    finally:
        os.unlink(script.name)
    line = next(line for line in output.splitlines() if line.startswith("WRKJSON "))
    raw = json.loads(line.removeprefix("WRKJSON "))
    return {
        "concurrency": concurrency,
        "requests": raw["requests"],
        "requests_per_s": round(raw["requests"] / (raw["duration_us"] / 1e6), 1),
        "p50_ms": raw["p50_us"] / 1000, "p95_ms": raw["p95_us"] / 1000, "p99_ms": raw["p99_us"] / 1000,
        "mean_ms": round(raw["mean_us"] / 1000, 3),
        "errors": raw["errors"] + raw["non_2xx"],
    }


def pair(direct: dict, gateway: dict, keys: tuple[str, ...]) -> dict:
    added = {f"added_{k}": round(gateway[k] - direct[k], 3) for k in keys if direct.get(k) is not None and gateway.get(k) is not None}
    return {"concurrency": direct["concurrency"], "direct": direct, "gateway": gateway, **added}


# --- the runs ---------------------------------------------------------------------------------

def wrk_levels(label: str, gateway_url: str, upstream_url: str, key: str, model: str, duration_s: float,
               cores: str | None, *, warm_up: bool, concurrencies: tuple[int, ...] = CONCURRENCY_LEVELS) -> list[dict]:
    """Non-streaming requests at each concurrency, direct then through the gateway."""
    levels = []
    for concurrency in concurrencies:
        if warm_up:
            run_wrk(gateway_url + "/v1/chat/completions", key, model, concurrency, 2, cores)
        direct = run_wrk(upstream_url + "/v1/chat/completions", key, model, concurrency, duration_s, cores)
        through = run_wrk(gateway_url + "/v1/chat/completions", key, model, concurrency, duration_s, cores)
        levels.append(pair(direct, through, ("p50_ms", "p95_ms", "p99_ms")))
        print(f"  {label} c{concurrency}: direct {direct['requests_per_s']}/s p50 {direct['p50_ms']} ms; "
              f"gateway {through['requests_per_s']}/s p50 {through['p50_ms']} p99 {through['p99_ms']} ms", flush=True)
    return levels


def stream_levels(label: str, gateway_url: str, upstream_url: str, key: str, model: str, duration_s: float,
                  levels: list[int], max_tokens: int, extra: dict | None = None) -> list[dict]:
    """Streaming chats at each concurrency, direct then through the gateway: TTFT and tokens/s."""
    rows = []
    for concurrency in levels:
        direct = asyncio.run(run_streams(upstream_url + "/v1/chat/completions", key, model, concurrency, duration_s, max_tokens, extra))
        through = asyncio.run(run_streams(gateway_url + "/v1/chat/completions", key, model, concurrency, duration_s, max_tokens, extra))
        row = pair(direct, through, ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms"))
        row["tokens_per_s_ratio"] = round(through["tokens_per_s"] / direct["tokens_per_s"], 3) if direct["tokens_per_s"] else None
        rows.append(row)
        print(f"  {label} stream c{concurrency}: tokens/s direct {direct['tokens_per_s']} gateway {through['tokens_per_s']}; "
              f"ttft p50 direct {direct['ttft_p50_ms']} gateway {through['ttft_p50_ms']} ms", flush=True)
    return rows


def bench_mock(gateway_url: str, mock_url: str, key: str, duration_s: float, load_cores: str | None) -> dict:
    return {
        "non_streaming": wrk_levels("mock", gateway_url, mock_url, key, "mock", duration_s, load_cores, warm_up=True),
        "streaming": stream_levels("mock", gateway_url, mock_url, key, "mock", duration_s, list(CONCURRENCY_LEVELS), 16),
    }


def bench_bare_proxy(proxy_url: str, mock_url: str, key: str, duration_s: float, load_cores: str | None,
                     label: str = "bare proxy", streaming: bool = True) -> dict:
    """`bench/bare_proxy.py` against the same mock: the serving stack's own share of the overhead."""
    return {"non_streaming": wrk_levels(label, proxy_url, mock_url, key, "mock", duration_s, load_cores, warm_up=True),
            "streaming": stream_levels(label, proxy_url, mock_url, key, "mock", duration_s, list(CONCURRENCY_LEVELS), 16)
            if streaming else []}


def bench_processes(gateway_url: str, floor_url: str, mock_url: str, key: str, duration_s: float,
                    load_cores: str | None, processes: int) -> tuple[dict, dict]:
    """The gateway and the floor with `processes` processes each, plain requests against the fast mock;
    at each concurrency direct, then the gateway, then the floor, so that both meet the same moment's load."""
    gateway_rows, floor_rows = [], []
    for concurrency in PROCESSES_LEVELS:
        for url in (gateway_url, floor_url):
            run_wrk(url + "/v1/chat/completions", key, "mock", concurrency, 2, load_cores)
        direct = run_wrk(mock_url + "/v1/chat/completions", key, "mock", concurrency, duration_s, load_cores)
        through = run_wrk(gateway_url + "/v1/chat/completions", key, "mock", concurrency, duration_s, load_cores)
        floor = run_wrk(floor_url + "/v1/chat/completions", key, "mock", concurrency, duration_s, load_cores)
        gateway_rows.append(pair(direct, through, ("p50_ms", "p95_ms", "p99_ms")))
        floor_rows.append(pair(direct, floor, ("p50_ms", "p95_ms", "p99_ms")))
        print(f"  {processes} processes c{concurrency}: gateway {through['requests_per_s']}/s p50 {through['p50_ms']} ms; "
              f"floor {floor['requests_per_s']}/s p50 {floor['p50_ms']} ms", flush=True)
    return ({"processes": processes, "non_streaming": gateway_rows, "streaming": []},
            {"processes": processes, "non_streaming": floor_rows, "streaming": []})


def litellm_venv() -> Path | None:
    """The LiteLLM proxy's own virtualenv (`bench/run.sh` installs it), or None when it is not there."""
    venv = Path(os.environ.get("LITELLM_VENV") or DATA_DIR / "litellm-venv")
    return venv if (venv / ".installed").exists() and (venv / "bin" / "litellm").exists() else None


def start_litellm(venv: Path, logs: Path, mock_url: str, processes: int, cores: str | None) -> tuple[Child, str, str]:
    """The LiteLLM proxy with its own defaults and no database, routing model `mock` to the fast mock;
    returns it, its address and its master key (it checks every request's key, as the gateway does)."""
    config = logs / "litellm.yaml"
    config.write_text("model_list:\n  - model_name: mock\n    litellm_params:\n      model: openai/mock\n"
                      f"      api_base: {mock_url}/v1\n      api_key: bench-not-checked\n")
    port, master_key = free_port(), "sk-bench-" + secrets.token_hex(16)
    # NOTE: LiteLLM reads DATABASE_URL and REDIS_URL from its environment: it gets neither of ours.
    child = Child(["env", "-u", "DATABASE_URL", "-u", "REDIS_URL", str(venv / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
                   "--num_workers", str(processes)], logs / "litellm.log", cores=cores,
                  env={"LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False", "DISABLE_SCHEMA_UPDATE": "True",
                       "LITELLM_MASTER_KEY": master_key,
                       # its bundled model price list, rather than a download attempt at each start
                       "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url + "/health/liveliness", child, 180)
    return child, url, master_key


def bench_litellm(litellm_url: str, mock_url: str, key: str, duration_s: float, load_cores: str | None) -> dict:
    """The LiteLLM proxy in the gateway's place, same mock, same load: the alternative users pick."""
    return {"non_streaming": wrk_levels("litellm", litellm_url, mock_url, key, "mock", duration_s, load_cores, warm_up=True),
            "streaming": stream_levels("litellm", litellm_url, mock_url, key, "mock", duration_s, list(CONCURRENCY_LEVELS), 16)}


def bench_slow_mock(gateway_url: str, mock_url: str, key: str, duration_s: float, load_cores: str | None) -> dict:
    """The mock answering after `SLOW_MOCK_DELAY_MS` × 16 tokens: the gateway below saturation, as with a real engine."""
    return {"non_streaming": wrk_levels("slow mock", gateway_url, mock_url, key, "mock-slow", duration_s, load_cores,
                                        warm_up=False),
            "streaming": []}


def bench_vllm(gateway_url: str, vllm_url: str, key: str, duration_s: float, cores: str | None, *, stream_pairs_k: int,
               gateway_pid: int | None) -> dict:
    """Plain requests (wrk), then streams at each concurrency in `stream_pairs_k` alternating pairs
    (`stream_pairs.stream_pairs`: each pair's ratio, their median, judged, and the ratio of the means), with the
    gateway's CPU per streamed token in each of its runs."""
    levels = sorted(set(CONCURRENCY_LEVELS) | {STREAM_TOKENS_CONCURRENCY})
    non_streaming = wrk_levels("vllm", gateway_url, vllm_url, key, "tiny", duration_s, cores, warm_up=True)
    streaming = []
    for concurrency in levels:
        row = stream_pairs(vllm_url, gateway_url, key, "tiny", concurrency, duration_s, 64, {"ignore_eos": True, "temperature": 0.0},
                           pairs=stream_pairs_k, proxy_pid=gateway_pid)
        streaming.append(row)
        shown = ", ".join(f"{run['tokens_per_s_ratio']:.1%}" if run["tokens_per_s_ratio"] is not None else "–" for run in row["pairs"])
        print(f"  vllm stream c{concurrency}: {len(row['pairs'])} pairs {shown}; median {percent(row['median_ratio'])}, "
              f"ratio of the means {percent(row['ratio_of_means'])} (tokens/s direct {row['direct']['tokens_per_s']} gateway "
              f"{row['gateway']['tokens_per_s']}); gateway CPU {row['gateway'].get('proxy_cpu_us_per_token')} µs a token", flush=True)
    return {
        "non_streaming": non_streaming,
        "streaming": streaming,
        "streaming_method": {"pairs": stream_pairs_k, "order": "direct → gateway in odd pairs, gateway → direct in even ones",
                             "judged_on": "median_ratio", "tokens_per_s_ratio": "the median of the pairs' ratios"},
    }


# `vllm bench serve` itself: the subcommand's own parser and `main`. NOTE: not through vLLM's CLI entry
# point, which looks up the version of a distribution named `vllm` first and fails where the engine is
# vllm-cpu (a distribution of that name).
VLLM_BENCH_SERVE = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
                    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                    "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))")


def run_vllm_bench(url: str, key: str, work_dir: Path, label: str, num_prompts: int, seed: int) -> dict:
    """One `vllm bench serve` run (vLLM's own client, from the project's virtualenv): streamed chat
    completions of random prompts at `VLLM_BENCH`'s concurrency, after as many unmeasured warm-up
    requests; its saved result, abridged."""
    command = [
        sys.executable, "-c", VLLM_BENCH_SERVE,
        "--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions",
        "--model", "tiny", "--tokenizer", str(TINY_MODEL_DIR), "--dataset-name", VLLM_BENCH["dataset"],
        "--random-input-len", str(VLLM_BENCH["input_len"]), "--random-output-len", str(VLLM_BENCH["output_len"]),
        "--num-prompts", str(num_prompts), "--max-concurrency", str(VLLM_BENCH["concurrency"]), "--ignore-eos",
        "--seed", str(seed), "--num-warmups", str(VLLM_BENCH["concurrency"]), "--save-result", "--result-dir", str(work_dir), "--result-filename", f"{label}.json",
        "--disable-tqdm",
    ]  # fmt: skip
    env = {**os.environ, "OPENAI_API_KEY": key, "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    output = work_dir / f"{label}.json"
    if done.returncode != 0 or not output.exists():
        raise RuntimeError(f"vllm bench serve ({label}) exited {done.returncode}: {(done.stderr or done.stdout)[-2000:]}")
    raw = json.loads(output.read_text())
    keys = ("completed", "duration", "output_throughput", "request_throughput", "total_token_throughput",
            "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")
    return {k: round(raw[k], 3) if isinstance(raw.get(k), float) else raw.get(k) for k in keys}


def bench_vllm_serve(gateway_url: str, vllm_url: str, key: str, pairs: int, num_prompts: int) -> dict:
    """`vllm bench serve` direct and through the gateway in alternating pairs (direct first in odd pairs,
    the gateway first in even ones), each pair on its own seed; output tokens/s gateway ÷ direct per pair."""
    work_dir = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    rows = []
    try:
        for index in range(pairs):
            order = [("direct", vllm_url), ("gateway", gateway_url)]
            if index % 2:
                order.reverse()
            runs = {label: run_vllm_bench(url, key, work_dir, f"{label}-{index}", num_prompts, seed=index) for label, url in order}
            direct, through = runs["direct"], runs["gateway"]
            ratio = round(through["output_throughput"] / direct["output_throughput"], 3) if direct["output_throughput"] else None
            rows.append({"pair": index + 1, "order": [label for label, _ in order], "direct": direct, "gateway": through,
                         "output_tokens_per_s_ratio": ratio})
            print(f"  vllm bench serve pair {index + 1} ({' then '.join(label for label, _ in order)}): output tokens/s "
                  f"direct {direct['output_throughput']:.0f} gateway {through['output_throughput']:.0f} ({ratio:.1%}); "
                  f"completed {direct['completed']} / {through['completed']} of {num_prompts}", flush=True)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    ratios = [row["output_tokens_per_s_ratio"] for row in rows if row["output_tokens_per_s_ratio"] is not None]
    direct_mean = statistics.mean(row["direct"]["output_throughput"] for row in rows)
    gateway_mean = statistics.mean(row["gateway"]["output_throughput"] for row in rows)
    return {"config": VLLM_BENCH | {"num_prompts": num_prompts, "backend": "openai-chat", "pairs": pairs}, "pairs": rows,
            "median_ratio": round(statistics.median(ratios), 3) if ratios else None,
            "ratio_of_means": round(gateway_mean / direct_mean, 3) if direct_mean else None,
            "all_completed": all(row[side]["completed"] == num_prompts for row in rows for side in ("direct", "gateway"))}


TINY_MODEL_DIR = DATA_DIR / "tiny-model"


def start_vllm(logs: Path, engine_core: int | None) -> tuple[Child, str]:
    model_dir = TINY_MODEL_DIR
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir)
    port = free_port()
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", "512", "--max-num-seqs", "64", "--enforce-eager", "--distributed-executor-backend", "uni",
            "--disable-uvicorn-access-log"]
    # NOTE: OpenMP's settings as the agent gives its CPU engines (`engine.cpu_openmp_env`): threads that
    # sleep between parallel regions instead of spinning on cores the gateway and the clients share.
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu", **cpu_openmp_env()}
    if engine_core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(engine_core)
    child = Child(args, logs / "vllm.log", cores=None if engine_core is None else str(engine_core), env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url + "/health", child, 300)
    return child, url


def unseed() -> None:
    """Replicas, node and traffic go with the upstreams: a scheduler on this data folder (another
    benchmark's Celery beat) must find nothing of this run to route to, count or scale."""
    from controlplane import redis_keys
    from controlplane.redis_client import get_redis
    from endpoints.models import Endpoint, Replica
    from endpoints.nodes.models import Node

    endpoints = list(Endpoint.objects.filter(organization__slug="bench-gateway").values_list("pk", "organization_id"))
    endpoint_ids = [str(pk) for pk, _ in endpoints]
    Replica.objects.filter(endpoint_id__in=endpoint_ids).delete()
    Node.objects.filter(name="bench-gateway-node").delete()
    if endpoint_ids:
        redis = get_redis()
        redis.zrem(redis_keys.RECENT_ENDPOINTS_KEY, *endpoint_ids)
        redis.delete(*[redis_keys.last_request_key(org, str(pk)) for pk, org in endpoints])


TITLES = {"mock": "fast mock (answers at once)", "mock_slow": f"mock answering in {16 * SLOW_MOCK_DELAY_MS} ms",
          "vllm": "vLLM, tiny model (CPU)",
          "bare_proxy": "floor: bench/bare_proxy.py (uvicorn + aiohttp, nothing else) in place of the gateway, fast mock",
          "bare_proxy_slow": f"floor: bench/bare_proxy.py in place of the gateway, mock answering in {16 * SLOW_MOCK_DELAY_MS} ms",
          "litellm": "LiteLLM proxy in place of the gateway (its defaults, no database), fast mock",
          "mock_nproc": "gateway with {n} processes (controlplane.serve, WEB_CONCURRENCY), fast mock",
          "bare_proxy_nproc": "floor with {n} processes (uvicorn --workers), fast mock"}
# The side-by-side rows: section, label, and the floor section its throughput is divided by.
SIDE_BY_SIDE = (("bare_proxy", "floor (uvicorn + aiohttp)", "bare_proxy"), ("mock", "**Inferplane**", "bare_proxy"),
                ("litellm", "LiteLLM proxy", "bare_proxy"), ("bare_proxy_nproc", "floor, {n} processes", "bare_proxy_nproc"),
                ("mock_nproc", "**Inferplane, {n} processes**", "bare_proxy_nproc"))


def find_row(results: dict, section: str, concurrency: int, kind: str = "non_streaming") -> dict | None:
    return next((row for row in (results.get(section) or {}).get(kind, []) if row["concurrency"] == concurrency), None)


def share(value: float | None, base: float | None) -> float | None:
    return round(value / base, 3) if value is not None and base else None


def per_row(section: dict) -> dict[str, float]:
    """A proxy's throughput per row: requests/s plain, content tokens/s streaming."""
    rows = {f"plain_c{row['concurrency']}": row["gateway"]["requests_per_s"] for row in section["non_streaming"]}
    return rows | {f"streaming_c{row['concurrency']}": row["gateway"]["tokens_per_s"] for row in section["streaming"]}


def summarize(results: dict) -> dict:
    """Issue #20's ratios, each within this run."""
    summary: dict = {}
    gateway16, floor16 = find_row(results, "mock", 16), find_row(results, "bare_proxy", 16)
    if gateway16 and floor16:
        summary["gateway_over_floor_requests_per_s_c16"] = share(gateway16["gateway"]["requests_per_s"], floor16["gateway"]["requests_per_s"])
        summary["added_p50_ms_c16"] = {"gateway": gateway16["added_p50_ms"], "floor": floor16["added_p50_ms"]}
        summary["added_p99_ms_c16"] = {"gateway": gateway16["added_p99_ms"], "floor": floor16["added_p99_ms"]}
        summary["added_p50_c16_over_floor"] = share(gateway16["added_p50_ms"], max(floor16["added_p50_ms"], 0.01))
        summary["added_p99_c16_over_floor"] = share(gateway16["added_p99_ms"], max(floor16["added_p99_ms"], 0.01))
    gateway_n, floor_n = find_row(results, "mock_nproc", 16), find_row(results, "bare_proxy_nproc", 16)
    if gateway_n and floor_n:
        n = results["mock_nproc"]["processes"]
        summary[f"gateway_over_floor_requests_per_s_c16_{n}_processes"] = share(
            gateway_n["gateway"]["requests_per_s"], floor_n["gateway"]["requests_per_s"])
        if gateway16:
            summary[f"gateway_{n}_processes_over_1_process_requests_per_s_c16"] = share(
                gateway_n["gateway"]["requests_per_s"], gateway16["gateway"]["requests_per_s"])
    mock_streaming = {f"{label}_c{row['concurrency']}": row["tokens_per_s_ratio"]
                      for section, label in (("mock", "inferplane"), ("bare_proxy", "floor"), ("litellm", "litellm"))
                      for row in (results.get(section) or {}).get("streaming", [])}
    if mock_streaming:
        summary["mock_streaming_tokens_per_s_ratio"] = mock_streaming
    for concurrency in (STREAM_TOKENS_CONCURRENCY, 64):
        if row := find_row(results, "vllm", concurrency, "streaming"):
            summary[f"vllm_streaming_tokens_per_s_ratio_c{concurrency}"] = row["tokens_per_s_ratio"]
            if "pairs" in row:
                summary[f"vllm_streaming_ratio_of_means_c{concurrency}"] = row["ratio_of_means"]
                summary[f"vllm_streaming_pair_ratios_c{concurrency}"] = [run["tokens_per_s_ratio"] for run in row["pairs"]]
                summary[f"vllm_streaming_gateway_cpu_us_per_token_c{concurrency}"] = row["gateway"].get("proxy_cpu_us_per_token")
                summary["vllm_streaming_judged_on"] = (f"the median of {len(row['pairs'])} alternating pairs' ratios "
                                                       "(vllm_streaming_tokens_per_s_ratio_c*)")
    bench = results.get("vllm_bench") or {}
    if bench.get("median_ratio") is not None:
        summary["vllm_bench_serve_output_tokens_per_s_ratio"] = bench["median_ratio"]
    if results.get("mock") and results.get("litellm"):
        ours, theirs = per_row(results["mock"]), per_row(results["litellm"])
        summary["inferplane_over_litellm"] = {name: share(ours[name], theirs[name]) if theirs[name] else None
                                              for name in theirs if name in ours}
    return summary


def targets_met(summary: dict) -> dict:
    """Issue #20's "done when", one entry per target measured in this run."""
    targets = {}
    if (value := summary.get("gateway_over_floor_requests_per_s_c16")) is not None:
        targets["requests_per_s_c16>=50%_of_floor"] = value >= TARGET_SHARE_OF_FLOOR_C16
    if (value := summary.get("added_p50_c16_over_floor")) is not None:
        targets["added_p50_c16<=2x_floor"] = value <= TARGET_ADDED_P50_OVER_FLOOR
    for concurrency in (STREAM_TOKENS_CONCURRENCY, 64):
        if (value := summary.get(f"vllm_streaming_tokens_per_s_ratio_c{concurrency}")) is not None:
            targets[f"vllm_streaming_c{concurrency}>=95%_of_direct"] = value >= TARGET_STREAMING_RATIO
    if (value := summary.get("vllm_bench_serve_output_tokens_per_s_ratio")) is not None:
        targets["vllm_bench_serve>=90%_of_direct"] = value >= TARGET_VLLM_BENCH_RATIO
    if ratios := summary.get("inferplane_over_litellm"):
        # NOTE: a row LiteLLM served nothing in (None: no tokens at all) counts as Inferplane ahead.
        targets["ahead_of_litellm_on_every_row"] = all(value is None or value > 1 for value in ratios.values())
    return targets


def earlier_targets_met(results: dict) -> dict:
    """The targets of the gateway's first benchmark (absolute figures, before #20), kept for comparison."""
    targets = {}
    mock16, slow16 = find_row(results, "mock", 16), find_row(results, "mock_slow", 16)
    if mock16:
        targets |= {"added_p50_ms_at_c16<=2 (fast mock, saturated)": mock16["added_p50_ms"] <= 2,
                    "added_p99_ms_at_c16<=10 (fast mock, saturated)": mock16["added_p99_ms"] <= 10,
                    "gateway_requests_per_s_with_mock>=500":
                        max(row["gateway"]["requests_per_s"] for row in results["mock"]["non_streaming"]) >= 500}
    if slow16:
        targets |= {"added_p50_ms_at_c16<=2 (48 ms mock)": slow16["added_p50_ms"] <= 2,
                    "added_p99_ms_at_c16<=10 (48 ms mock)": slow16["added_p99_ms"] <= 10}
    return targets


def percent(value: float | None) -> str:
    return f"{value:.0%}" if value is not None else "–"


def summary_table(summary: dict, targets: dict, results: dict) -> list[str]:
    yes = {True: "**met**", False: "missed", None: "not run"}
    lines = ["\n**Issue #20's targets, this run** (each a ratio within the run)\n",
             "| target | this run | met |", "|---|---|---|"]
    added50, added99 = summary.get("added_p50_ms_c16"), summary.get("added_p99_ms_c16")
    lines.append(f"| throughput at c16 ≥ 50% of the floor's | {percent(summary.get('gateway_over_floor_requests_per_s_c16'))} | "
                 f"{yes[targets.get('requests_per_s_c16>=50%_of_floor')]} |")
    if added50:
        lines.append(f"| added p50 at c16 ≤ 2× the floor's | {added50['gateway']:+.2f} vs {added50['floor']:+.2f} ms "
                     f"({summary['added_p50_c16_over_floor']:.1f}×); p99 {added99['gateway']:+.2f} vs {added99['floor']:+.2f} ms | "
                     f"{yes[targets.get('added_p50_c16<=2x_floor')]} |")
    for concurrency in (STREAM_TOKENS_CONCURRENCY, 64):
        row = find_row(results, "vllm", concurrency, "streaming") or {}
        shown = ", ".join(percent(run["tokens_per_s_ratio"]) for run in row.get("pairs", []))
        lines.append(f"| streaming ≥ 95% of direct tokens/s at c{concurrency} (vLLM) | "
                     f"{percent(summary.get(f'vllm_streaming_tokens_per_s_ratio_c{concurrency}'))}"
                     f"{f' (median of {shown})' if shown else ''} | "
                     f"{yes[targets.get(f'vllm_streaming_c{concurrency}>=95%_of_direct')]} |")
    bench = results.get("vllm_bench") or {}
    pairs = ", ".join(percent(row["output_tokens_per_s_ratio"]) for row in bench.get("pairs", []))
    lines.append(f"| `vllm bench serve` ≥ 90% of direct output tokens/s | "
                 f"{percent(summary.get('vllm_bench_serve_output_tokens_per_s_ratio'))}"
                 f"{f' (median of {pairs})' if pairs else ''} | {yes[targets.get('vllm_bench_serve>=90%_of_direct')]} |")
    if ratios := summary.get("inferplane_over_litellm"):
        shown = ", ".join(f"{name.replace('_', ' ')} {value:.1f}×" if value is not None else f"{name} –" for name, value in ratios.items())
        lines.append(f"| ahead of LiteLLM on every row (Inferplane ÷ LiteLLM) | {shown} | "
                     f"{yes[targets.get('ahead_of_litellm_on_every_row')]} |")
    else:
        lines.append("| ahead of LiteLLM on every row | – | not run |")
    for name, value in summary.items():
        if name.startswith("gateway_over_floor_requests_per_s_c16_"):
            n = name.rsplit("_", 2)[-2]
            lines.append(f"| (no target) {n} processes each: gateway ÷ floor at c16 | {percent(value)}; gateway {n} ÷ 1 process "
                         f"{summary.get(f'gateway_{n}_processes_over_1_process_requests_per_s_c16') or 0:.2f}× | – |")
    return lines


def side_by_side(results: dict) -> list[str]:
    """One row per proxy and concurrency in the same run, fast mock: throughput as a share of the
    bare-proxy floor's with as many processes, latency added over calling the mock directly, streaming
    tokens/s as a share of direct, and Inferplane's throughput ÷ LiteLLM's."""
    if not results.get("bare_proxy"):
        return []
    lines = ["\n**Side by side, fast mock** (req/s ÷ the floor's with as many processes at the same concurrency; "
             "added latency in ms over direct; streaming: content tokens/s and ÷ direct)\n",
             "| proxy | concurrency | req/s | ÷ floor | added p50 / p99 | errors | streaming tok/s | streaming ÷ direct | Inferplane ÷ it, plain / streaming |",
             "|---|---:|---:|---:|---|---:|---:|---:|---|"]
    ours = per_row(results["mock"]) if results.get("mock") else {}
    for name, label, floor_name in SIDE_BY_SIDE:
        section = results.get(name)
        if not section:
            continue
        label = label.format(n=section.get("processes", 1))
        floor = {row["concurrency"]: row["gateway"]["requests_per_s"] for row in results.get(floor_name, {}).get("non_streaming", [])}
        streams = {row["concurrency"]: row for row in section.get("streaming", [])}
        theirs = per_row(section) if name == "litellm" else {}
        for row in section["non_streaming"]:
            c, through = row["concurrency"], row["gateway"]
            stream = streams.get(c)
            versus = ""
            if theirs:
                plain = share(ours.get(f"plain_c{c}"), theirs.get(f"plain_c{c}"))
                streamed = share(ours.get(f"streaming_c{c}"), theirs.get(f"streaming_c{c}"))
                versus = " / ".join(f"{value:.1f}×" if value is not None else "–" for value in (plain, streamed))
            stream_errors = stream["gateway"]["errors"] if stream else 0
            lines.append(f"| {label} | {c} | {through['requests_per_s']:.0f} | {percent(share(through['requests_per_s'], floor.get(c)))} | "
                         f"{row['added_p50_ms']:+.2f} / {row['added_p99_ms']:+.2f} | {through['errors'] + stream_errors} | "
                         f"{format(stream['gateway']['tokens_per_s'], '.0f') if stream else '–'} | "
                         f"{percent(stream['tokens_per_s_ratio']) if stream else '–'} | {versus} |")
    return lines


def vllm_tables(results: dict) -> list[str]:
    lines = []
    section = results.get("vllm")
    if section and section["streaming"]:
        pairs = (section.get("streaming_method") or {}).get("pairs")
        if pairs:
            lines += [f"\n**vLLM tiny model (CPU), streaming 64 tokens** (aiohttp client; at each concurrency {pairs} "
                      f"alternating pairs, direct → gateway then gateway → direct, {pairs} × 2 runs; tok/s the mean of a side's "
                      f"runs; **judged on the median of the pairs' ratios**; gateway CPU a token: its process's /proc CPU over "
                      f"its runs ÷ the tokens they streamed)\n",
                      "| concurrency | added TTFT p50 | direct tok/s | gateway tok/s | pairs' ratios | **median** | ratio of the means | "
                      "gateway CPU a token |", "|---:|---:|---:|---:|---|---:|---:|---:|"]
        else:  # a result of the one-pair method (before issue #20's pairs)
            lines += ["\n**vLLM tiny model (CPU), streaming 64 tokens** (aiohttp client; direct and through the gateway)\n",
                      "| concurrency | added TTFT p50 | direct tok/s | gateway tok/s | ratio |", "|---:|---:|---:|---:|---:|"]
        for row in section["streaming"]:
            cells = (f"| {row['concurrency']} | {row.get('added_ttft_p50_ms', 0):+.1f} ms | {row['direct']['tokens_per_s']:.0f} | "
                     f"{row['gateway']['tokens_per_s']:.0f} | ")
            if pairs:
                cpu = row["gateway"].get("proxy_cpu_us_per_token")
                cells += (f"{', '.join(percent(run['tokens_per_s_ratio']) for run in row['pairs'])} | **{percent(row['median_ratio'])}** | "
                          f"{percent(row['ratio_of_means'])} | {f'{cpu:.0f} µs' if cpu is not None else '–'} |")
            else:
                cells += f"{percent(row['tokens_per_s_ratio'])} |"
            lines.append(cells)
    bench = results.get("vllm_bench")
    if bench and bench.get("pairs"):
        config = bench["config"]
        lines += [f"\n**`vllm bench serve`** (vLLM's own client; {config['dataset']} {config['input_len']}-in/"
                  f"{config['output_len']}-out, concurrency {config['concurrency']}, {config['num_prompts']} prompts a run, "
                  f"{config['backend']}; direct and through the gateway alternating)\n",
                  "| pair | order | direct output tok/s | gateway output tok/s | ratio | TTFT p50 direct / gateway | completed |",
                  "|---:|---|---:|---:|---:|---|---|"]
        for row in bench["pairs"]:
            d, g = row["direct"], row["gateway"]
            lines.append(f"| {row['pair']} | {' → '.join(row['order'])} | {d['output_throughput']:.0f} | {g['output_throughput']:.0f} | "
                         f"{percent(row['output_tokens_per_s_ratio'])} | {d['median_ttft_ms']:.1f} / {g['median_ttft_ms']:.1f} ms | "
                         f"{d['completed']} / {g['completed']} |")
        lines.append(f"\nMedian ratio {percent(bench['median_ratio'])}; ratio of the means {percent(bench['ratio_of_means'])}.")
    elif bench and bench.get("error"):
        lines.append(f"\n`vllm bench serve` failed: {bench['error'][:300]}")
    return lines


def details(results: dict) -> list[str]:
    lines = []
    for upstream in ("mock", "bare_proxy", "litellm", "mock_nproc", "bare_proxy_nproc", "mock_slow", "bare_proxy_slow", "vllm"):
        section = results.get(upstream)
        if not section:
            continue
        title = TITLES[upstream].format(n=section.get("processes", 1))
        lines += [f"\n**{title}, non-streaming** (wrk, closed loop; latency in ms)\n",
                  "| concurrency | direct req/s | proxy req/s | direct p50 / p95 / p99 | proxy p50 / p95 / p99 | added p50 / p95 / p99 | errors |",
                  "|---:|---:|---:|---|---|---|---:|"]
        for row in section["non_streaming"]:
            d, g = row["direct"], row["gateway"]
            lines.append(f"| {row['concurrency']} | {d['requests_per_s']:.0f} | {g['requests_per_s']:.0f} | "
                         f"{d['p50_ms']:.2f} / {d['p95_ms']:.2f} / {d['p99_ms']:.2f} | "
                         f"{g['p50_ms']:.2f} / {g['p95_ms']:.2f} / {g['p99_ms']:.2f} | "
                         f"{row['added_p50_ms']:+.2f} / {row['added_p95_ms']:+.2f} / {row['added_p99_ms']:+.2f} | {g['errors']} |")
        if not section["streaming"]:
            continue
        lines += [f"\n**{title}, streaming** (aiohttp client; time to first token in ms)\n",
                  "| concurrency | direct TTFT p50 / p99 | proxy TTFT p50 / p99 | added TTFT p50 / p99 | direct tok/s | proxy tok/s | ratio | errors |",
                  "|---:|---|---|---|---:|---:|---:|---:|"]
        for row in section["streaming"]:
            d, g = row["direct"], row["gateway"]
            lines.append(f"| {row['concurrency']} | {d['ttft_p50_ms']} / {d['ttft_p99_ms']} | {g['ttft_p50_ms']} / {g['ttft_p99_ms']} | "
                         f"{row.get('added_ttft_p50_ms', 0):+.2f} / {row.get('added_ttft_p99_ms', 0):+.2f} | "
                         f"{d['tokens_per_s']:.0f} | {g['tokens_per_s']:.0f} | {percent(row['tokens_per_s_ratio'])} | {g['errors']} |")
    return lines


def markdown(document: dict) -> str:
    """The README's gateway table (side by side, #20's targets, vLLM), then every measurement in detail."""
    results = document["results"]
    head = (f"_{document['date']}, {document['num_cpus']} cores, load average (1 min) {document['load_average_1m_at_start']} at "
            f"the start, {document['load_average_1m_at_end']} at the end; {document['duration_s_per_run']:g} s per measurement; "
            f"wall time {document['wall_s'] / 60:.1f} min_")
    lines = ["=== README table (bench/bench_gateway.py) ===", head, *side_by_side(results),
             *summary_table(document["summary"], document["targets_met"], results), *vllm_tables(results),
             "\n=== details ===", *details(results)]
    return "\n".join(lines)


def pin_tree(pid: int, cores: str) -> None:
    """Every thread of a process and of its children (a launcher's workers) onto `cores`."""
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    for process in (pid, *map(int, children)):
        subprocess.run(["taskset", "-a", "-p", "-c", cores, str(process)], check=False, capture_output=True)


def start_gateway(logs: Path, name: str, processes: int, cores: str | None, serve: list[str]) -> tuple[Child, str]:
    """The gateway as a pod runs it: `python -m controlplane.serve`, `WEB_CONCURRENCY` processes on one port
    (with several, Prometheus multiprocess mode in a private folder)."""
    port = free_port()
    child = Child([sys.executable, "-m", "controlplane.serve", "--port", str(port), *serve], logs / f"{name}.log",
                  cores=cores, env={"WEB_CONCURRENCY": str(processes)})
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url + "/healthz", child, 90)
    return child, url


def start_floor(logs: Path, name: str, upstream: str, processes: int, cores: str | None, serve: list[str]) -> tuple[Child, str]:
    port = free_port()
    # NOTE: no `server` header, as `controlplane.serve` serves the gateway beside it: the same uvicorn work an answer
    child = Child([sys.executable, "-m", "uvicorn", "bench.bare_proxy:app", "--port", str(port), "--workers", str(processes),
                   "--no-server-header", *serve], logs / f"{name}.log", cores=cores, env={"BARE_PROXY_UPSTREAM": upstream})
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url + "/health", child, 60)
    return child, url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run of every part: {QUICK['duration_s']:g} s per measurement, {QUICK['stream_pairs']} streaming "
                             f"pairs, {QUICK['vllm_bench_pairs']} `vllm bench serve` pair of {QUICK['vllm_bench_prompts']} prompts, no "
                             "slow mock; writes .data/bench/gateway-quick.json unless --output says otherwise (the results of "
                             "record stay); options given explicitly win")
    parser.add_argument("--duration-s", type=float, default=None, help="seconds per measurement (default 5: ~10 min in all on a quiet 2-core machine)")
    parser.add_argument("--no-vllm", action="store_true", help="skip the real-replica runs")
    parser.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM proxy's row")
    parser.add_argument("--no-slow-mock", action="store_true", help="skip the runs against the mock answering in 48 ms")
    parser.add_argument("--only-vllm", action="store_true", help="only the real-replica runs (no mock, no floor)")
    parser.add_argument("--processes", type=int, default=2,
                        help="gateway and floor processes for the N-process rows (default 2; 0 or 1 skips them)")
    parser.add_argument("--vllm-bench-pairs", type=int, default=None,
                        help="`vllm bench serve` runs direct and through the gateway, alternating (default 3 pairs; 0 skips)")
    parser.add_argument("--stream-pairs", type=int, default=None,
                        help="vLLM streaming rows: direct and through the gateway in this many alternating pairs at each "
                             "concurrency, judged on the median ratio (default 3)")
    parser.add_argument("--vllm-bench-prompts", type=int, default=None, help="prompts per `vllm bench serve` run (default 64)")
    parser.add_argument("--pin", action="store_true",
                        help="pin the gateway to core 0 and the mocks and wrk to core 1 (vLLM runs stay unpinned)")
    parser.add_argument("--shared-engine-cores", action="store_true",
                        help="let vLLM use every core (by default it gets the last core, the rest run gateway and clients)")
    parser.add_argument("--output", default=None, help="default bench/results/gateway.json")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (their folder is printed)")
    args = parser.parse_args()
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.no_slow_mock = args.no_slow_mock or args.quick
    if args.stream_pairs < 1:
        parser.error("--stream-pairs must be at least 1")
    if shutil.which("wrk") is None:
        print("wrk is missing: `make bench ONLY=gateway` (bench/run.sh) installs it", file=sys.stderr)
        return 2
    started = time.monotonic()
    pin = args.pin and (os.cpu_count() or 1) >= 2
    gateway_cores, load_cores = ("0", "1") if pin else (None, None)
    engine_core = (os.cpu_count() - 1) if not args.shared_engine_cores and (os.cpu_count() or 1) >= 2 else None

    load_at_start = round(os.getloadavg()[0], 2)
    setup_django()
    logs = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    children: list[ChildProcess] = []
    results: dict = {}
    try:
        mock_port = free_port()
        mock = Child([sys.executable, "-m", "tests.fakes.mock_openai", "--port", str(mock_port)], logs / "mock.log", cores=load_cores)
        children.append(mock)
        mock_url = f"http://127.0.0.1:{mock_port}"
        wait_healthy(mock_url + "/health", mock, 30)
        slow_port = free_port()
        slow = Child([sys.executable, "-m", "tests.fakes.mock_openai", "--port", str(slow_port), "--token-delay-ms",
                      str(SLOW_MOCK_DELAY_MS)], logs / "mock-slow.log", cores=load_cores)
        children.append(slow)
        slow_url = f"http://127.0.0.1:{slow_port}"
        wait_healthy(slow_url + "/health", slow, 30)
        vllm_url = None
        if not args.no_vllm:
            vllm, vllm_url = start_vllm(logs, engine_core)
            children.append(vllm)
        upstreams = {"mock": mock_url, "mock-slow": slow_url} | ({"tiny": vllm_url} if vllm_url else {})
        key = seed(upstreams)
        serve = ["--host", "127.0.0.1", "--no-access-log", "--log-level", "warning", "--loop", "uvloop", "--http", "httptools"]
        gateway, gateway_url = start_gateway(logs, "gateway", 1, gateway_cores, serve)
        children.append(gateway)

        print(f"gateway overhead (gateway on core {gateway_cores}, mock and wrk on core {load_cores})" if pin else "gateway overhead (unpinned)", flush=True)
        if not args.only_vllm:
            floor, floor_url = start_floor(logs, "bare-proxy", mock_url, 1, gateway_cores, serve)
            children.append(floor)
            results["mock"] = bench_mock(gateway_url, mock_url, key, args.duration_s, load_cores)
            results["bare_proxy"] = bench_bare_proxy(floor_url, mock_url, key, args.duration_s, load_cores)
            venv = None if args.no_litellm else litellm_venv()
            if venv:
                litellm, litellm_url, litellm_key = start_litellm(venv, logs, mock_url, 1, gateway_cores)
                children.append(litellm)
                results["litellm"] = bench_litellm(litellm_url, mock_url, litellm_key, args.duration_s, load_cores)
                litellm.stop()
            elif not args.no_litellm:
                print("the LiteLLM proxy is not installed (bench/run.sh installs it): no LiteLLM row", flush=True)
            if not args.no_slow_mock:
                slow_floor, slow_floor_url = start_floor(logs, "bare-proxy-slow", slow_url, 1, gateway_cores, serve)
                children.append(slow_floor)
                results["mock_slow"] = bench_slow_mock(gateway_url, slow_url, key, args.duration_s, load_cores)
                results["bare_proxy_slow"] = bench_bare_proxy(slow_floor_url, slow_url, key, args.duration_s, load_cores,
                                                              label="bare proxy, slow mock", streaming=False)
                slow_floor.stop()
            if args.processes > 1:
                gateway_n, gateway_n_url = start_gateway(logs, f"gateway-{args.processes}", args.processes, gateway_cores, serve)
                children.append(gateway_n)
                floor_n, floor_n_url = start_floor(logs, f"bare-proxy-{args.processes}", mock_url, args.processes, gateway_cores, serve)
                children.append(floor_n)
                results["mock_nproc"], results["bare_proxy_nproc"] = bench_processes(
                    gateway_n_url, floor_n_url, mock_url, key, args.duration_s, load_cores, args.processes)
                gateway_n.stop()
                floor_n.stop()
        if vllm_url:
            others = None
            if engine_core is not None:
                # NOTE: vLLM's CPU threads spin at barriers: a process sharing their core stalls the whole
                # engine. The engine gets the last core; gateway and clients (this process, wrk, vLLM's
                # benchmark client) share the others.
                others = f"0-{engine_core - 1}"
                pin_tree(gateway.process.pid, others)
                os.sched_setaffinity(0, range(engine_core))
            results["vllm"] = bench_vllm(gateway_url, vllm_url, key, args.duration_s, others,
                                         stream_pairs_k=args.stream_pairs, gateway_pid=gateway.process.pid)
            if args.vllm_bench_pairs > 0:
                try:
                    results["vllm_bench"] = bench_vllm_serve(gateway_url, vllm_url, key, args.vllm_bench_pairs, args.vllm_bench_prompts)
                except (RuntimeError, subprocess.TimeoutExpired) as error:
                    print(f"vllm bench serve failed: {error}", file=sys.stderr, flush=True)
                    results["vllm_bench"] = {"error": str(error)}
    finally:
        for child in reversed(children):
            child.stop()
        unseed()
        if args.keep_logs:
            print(f"logs kept in {logs}", flush=True)
        else:
            shutil.rmtree(logs, ignore_errors=True)

    summary = summarize(results)
    document = {
        "benchmark": "gateway",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(), "processor": platform.processor() or platform.machine(),
        "num_cpus": os.cpu_count(), "load_average_1m_at_start": load_at_start, "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "wall_s": round(time.monotonic() - started, 1),
        "pinned": {"gateway": gateway_cores, "mock_and_wrk": load_cores} if pin else None,
        "vllm_runs": (f"vLLM on core {engine_core} (VLLM_CPU_OMP_THREADS_BIND); gateway, wrk, streaming clients and "
                      f"vllm bench serve on cores 0-{engine_core - 1}") if engine_core is not None else "unpinned",
        "duration_s_per_run": args.duration_s,
        "quick": args.quick,
        "request": {"chat_messages": 1, "max_tokens_mock": 16, "max_tokens_vllm_streaming": 64},
        "summary": summary,
        "targets_met": targets_met(summary),
        "earlier_targets_met": earlier_targets_met(results),
        "results": results,
    }
    output = Path(args.output or (DATA_DIR / "gateway-quick.json" if args.quick else REPO / "bench" / "results" / "gateway.json"))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")
    print(markdown(document))
    print(f"\ntargets met: {document['targets_met']}")
    print(f"wall time {document['wall_s']:.0f} s ({document['wall_s'] / 60:.1f} min); wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
