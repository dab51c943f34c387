"""Gateway overhead: the same upstream called directly and through the gateway, in the same run.

Proxies, in the same run against the same fast mock: the gateway, the bare-proxy floor
(`bench/bare_proxy.py`: uvicorn + aiohttp, nothing else) and the LiteLLM proxy (its own virtualenv,
installed by `bench/run.sh`; its defaults, no database), side by side in one table.

Upstreams:
  * the fast mock (`tests.fakes.mock_openai`): what the gateway itself costs, and its request rate;
  * a real vLLM replica of the tiny model (CPU engine, the agent's command line): what a client pays.

The gateway is one `uvicorn controlplane.asgi:application` process (uvloop, httptools, no access
log) on a dedicated data folder (`INFERPLANE_DATA_DIR=.data/bench`, embedded PostgreSQL and Redis),
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

    .venv/bin/python bench/bench_gateway.py [--duration-s 10] [--no-vllm] [--pin]

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
# NOTE: production settings (DEBUG off), as a deployed gateway runs; on plain HTTP, on localhost.
ENV = {"INFERPLANE_DATA_DIR": str(DATA_DIR), "DJANGO_SETTINGS_MODULE": "controlplane.settings", "DJANGO_DEBUG": "0",
       "DJANGO_SECRET_KEY": "bench-gateway-only-" + "x" * 40, "ALLOWED_HOSTS": "127.0.0.1,localhost",
       "SECURE_SSL_REDIRECT": "0"}
os.environ.update(ENV)

from controlplane import embedded  # noqa: E402 - after sys.path is set
from tests.processes import ChildProcess, free_port  # noqa: E402

# NOTE: production settings refuse to start embedded servers and need an encryption key: start the
# servers here and name them, as a deployment names its own.
os.environ.setdefault("DATABASE_URL", embedded.ensure_postgres())
os.environ.setdefault("REDIS_URL", embedded.ensure_redis())
os.environ.setdefault("INFERPLANE_ENCRYPTION_KEYS", "YmVuY2gtZ2F0ZXdheS1wcm9maWxlLW9ubHktMzJieXQ=")

CONCURRENCY_LEVELS = (1, 16, 64)
STREAM_TOKENS_CONCURRENCY = 32
SLOW_MOCK_DELAY_MS = 3  # per token: 48 ms per 16-token answer, so c16 offers ~330 requests/s, below saturation
CHAT_BODY = {"model": "MODEL", "messages": [{"role": "user", "content": "Say something about llamas."}], "max_tokens": 16}

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


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


async def run_streams(url: str, key: str, model: str, concurrency: int, duration_s: float, max_tokens: int,
                      extra: dict | None = None) -> dict:
    """Closed-loop streaming chats: time to first token, and completion tokens/s over the run.

    NOTE: aiohttp, reading raw lines and counting content chunks without parsing them: on two cores the
    client shares a core with the gateway, and a heavier client would measure itself.
    """
    import aiohttp

    body = json.dumps(CHAT_BODY | {"model": model, "max_tokens": max_tokens, "stream": True} | (extra or {})).encode()
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    ttfts, totals, num_tokens, num_errors = [], [], 0, 0
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as client:
        deadline = time.perf_counter() + duration_s

        async def worker() -> None:
            nonlocal num_tokens, num_errors
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                first = None
                try:
                    async with client.post(url, data=body, headers=headers) as response:
                        if response.status != 200:
                            await response.read()
                            num_errors += 1
                            continue
                        async for line in response.content:
                            # a chunk with text: `"content":"…"` (chat) that is not the empty role chunk
                            if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                                if first is None:
                                    first = time.perf_counter()
                                num_tokens += 1
                except aiohttp.ClientError:
                    num_errors += 1
                    continue
                if first is not None:
                    ttfts.append(first - started)
                totals.append(time.perf_counter() - started)

        started_at = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started_at
    return {
        "concurrency": concurrency,
        "requests": len(totals),
        "errors": num_errors,
        "ttft_p50_ms": round(percentile(ttfts, 0.50) * 1000, 2) if ttfts else None,
        "ttft_p95_ms": round(percentile(ttfts, 0.95) * 1000, 2) if ttfts else None,
        "ttft_p99_ms": round(percentile(ttfts, 0.99) * 1000, 2) if ttfts else None,
        "tokens_per_s": round(num_tokens / elapsed, 1),
        "requests_per_s": round(len(totals) / elapsed, 1),
    }


def pair(direct: dict, gateway: dict, keys: tuple[str, ...]) -> dict:
    added = {f"added_{k}": round(gateway[k] - direct[k], 3) for k in keys if direct.get(k) is not None and gateway.get(k) is not None}
    return {"concurrency": direct["concurrency"], "direct": direct, "gateway": gateway, **added}


# --- the runs ---------------------------------------------------------------------------------

def wrk_levels(label: str, gateway_url: str, upstream_url: str, key: str, model: str, duration_s: float,
               cores: str | None, *, warm_up: bool) -> list[dict]:
    """Non-streaming requests at each concurrency, direct then through the gateway."""
    levels = []
    for concurrency in CONCURRENCY_LEVELS:
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
                     label: str = "bare proxy") -> dict:
    """`bench/bare_proxy.py` against the same mock: the serving stack's own share of the overhead."""
    return {"non_streaming": wrk_levels(label, proxy_url, mock_url, key, "mock", duration_s, load_cores, warm_up=True),
            "streaming": []}


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
                       "LITELLM_MASTER_KEY": master_key})
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


def bench_vllm(gateway_url: str, vllm_url: str, key: str, duration_s: float, cores: str | None) -> dict:
    levels = sorted(set(CONCURRENCY_LEVELS) | {STREAM_TOKENS_CONCURRENCY})
    return {
        "non_streaming": wrk_levels("vllm", gateway_url, vllm_url, key, "tiny", duration_s, cores, warm_up=True),
        "streaming": stream_levels("vllm", gateway_url, vllm_url, key, "tiny", duration_s, levels, 64,
                                   {"ignore_eos": True, "temperature": 0.0}),
    }


def start_vllm(logs: Path, engine_core: int | None) -> tuple[Child, str]:
    from gpu_agent.runtime.tiny_model import build_tiny_model

    model_dir = DATA_DIR / "tiny-model"
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir)
    port = free_port()
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", "512", "--max-num-seqs", "64", "--enforce-eager", "--distributed-executor-backend", "uni",
            "--disable-uvicorn-access-log"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}
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


def markdown(results: dict) -> str:
    lines = []
    titles = {"mock": "fast mock (answers at once)", "mock_slow": f"mock answering in {16 * SLOW_MOCK_DELAY_MS} ms",
              "vllm": "vLLM, tiny model (CPU)",
              "bare_proxy": "floor: bench/bare_proxy.py (uvicorn + aiohttp, nothing else) in place of the gateway, fast mock",
              "bare_proxy_slow": f"floor: bench/bare_proxy.py in place of the gateway, mock answering in {16 * SLOW_MOCK_DELAY_MS} ms",
              "litellm": "LiteLLM proxy in place of the gateway (its defaults, no database), fast mock"}
    lines += side_by_side(results)
    for upstream in ("mock", "bare_proxy", "litellm", "mock_slow", "bare_proxy_slow", "vllm"):
        section = results.get(upstream)
        if not section:
            continue
        lines += [f"\n**{titles[upstream]}, non-streaming** (wrk, closed loop; latency in ms)\n",
                  "| concurrency | direct req/s | gateway req/s | direct p50 / p95 / p99 | gateway p50 / p95 / p99 | added p50 / p95 / p99 |",
                  "|---:|---:|---:|---|---|---|"]
        for row in section["non_streaming"]:
            d, g = row["direct"], row["gateway"]
            lines.append(f"| {row['concurrency']} | {d['requests_per_s']:.0f} | {g['requests_per_s']:.0f} | "
                         f"{d['p50_ms']:.2f} / {d['p95_ms']:.2f} / {d['p99_ms']:.2f} | "
                         f"{g['p50_ms']:.2f} / {g['p95_ms']:.2f} / {g['p99_ms']:.2f} | "
                         f"{row['added_p50_ms']:+.2f} / {row['added_p95_ms']:+.2f} / {row['added_p99_ms']:+.2f} |")
        if not section["streaming"]:
            continue
        lines += [f"\n**{titles[upstream]}, streaming** (aiohttp client; time to first token in ms)\n",
                  "| concurrency | direct TTFT p50 / p99 | gateway TTFT p50 / p99 | added TTFT p50 / p99 | direct tok/s | gateway tok/s | ratio |",
                  "|---:|---|---|---|---:|---:|---:|"]
        for row in section["streaming"]:
            d, g = row["direct"], row["gateway"]
            ratio = g["tokens_per_s"] / d["tokens_per_s"] if d["tokens_per_s"] else 0
            lines.append(f"| {row['concurrency']} | {d['ttft_p50_ms']} / {d['ttft_p99_ms']} | {g['ttft_p50_ms']} / {g['ttft_p99_ms']} | "
                         f"{row.get('added_ttft_p50_ms', 0):+.2f} / {row.get('added_ttft_p99_ms', 0):+.2f} | "
                         f"{d['tokens_per_s']:.0f} | {g['tokens_per_s']:.0f} | {ratio:.1%} |")
    return "\n".join(lines)


def side_by_side(results: dict) -> list[str]:
    """One row per proxy in the same run, fast mock: throughput as a share of the bare-proxy floor,
    latency added over calling the mock directly, streaming tokens/s as a share of direct."""
    floor = {row["concurrency"]: row for row in (results.get("bare_proxy") or {}).get("non_streaming", [])}
    if not floor:
        return []
    lines = ["\n**Side by side, fast mock** (throughput ÷ the bare-proxy floor's at the same concurrency; "
             "added latency in ms over direct; streaming tokens/s ÷ direct)\n",
             "| proxy | concurrency | req/s | ÷ floor | added p50 / p99 | streaming ÷ direct |", "|---|---:|---:|---:|---|---:|"]
    for name, label in (("bare_proxy", "floor (uvicorn + aiohttp)"), ("mock", "Inferplane"), ("litellm", "LiteLLM proxy")):
        section = results.get(name)
        if not section:
            continue
        streams = {row["concurrency"]: row for row in section.get("streaming", [])}
        for row in section["non_streaming"]:
            c, through = row["concurrency"], row["gateway"]
            base = floor.get(c, {}).get("gateway", {}).get("requests_per_s")
            stream = streams.get(c, {}).get("tokens_per_s_ratio")
            share = f"{through['requests_per_s'] / base:.0%}" if base else "–"
            lines.append(f"| {label} | {c} | {through['requests_per_s']:.0f} | {share} | "
                         f"{row['added_p50_ms']:+.2f} / {row['added_p99_ms']:+.2f} | "
                         f"{f'{stream:.0%}' if stream is not None else '–'} |")
    return lines


def verdict(results: dict) -> dict:
    targets = {}
    if results.get("mock"):
        mock = results["mock"]["non_streaming"]
        c16 = next(row for row in mock if row["concurrency"] == 16)
        slow_c16 = next(row for row in results["mock_slow"]["non_streaming"] if row["concurrency"] == 16)
        targets |= {
            "added_p50_ms_at_c16<=2 (fast mock, saturated)": c16["added_p50_ms"] <= 2,
            "added_p99_ms_at_c16<=10 (fast mock, saturated)": c16["added_p99_ms"] <= 10,
            "added_p50_ms_at_c16<=2 (48 ms mock)": slow_c16["added_p50_ms"] <= 2,
            "added_p99_ms_at_c16<=10 (48 ms mock)": slow_c16["added_p99_ms"] <= 10,
            "gateway_requests_per_s_with_mock>=500": max(row["gateway"]["requests_per_s"] for row in mock) >= 500,
        }
    if results.get("mock") and results.get("bare_proxy"):
        floor16 = next(row for row in results["bare_proxy"]["non_streaming"] if row["concurrency"] == 16)
        targets["gateway_requests_per_s_at_c16>=50%_of_floor"] = (
            c16["gateway"]["requests_per_s"] >= 0.5 * floor16["gateway"]["requests_per_s"])
        targets["added_p50_ms_at_c16<=2x_floor"] = c16["added_p50_ms"] <= 2 * max(floor16["added_p50_ms"], 0.01)
    if results.get("mock") and results.get("litellm"):
        ours = {(row["concurrency"], "plain"): row["gateway"]["requests_per_s"] for row in results["mock"]["non_streaming"]}
        ours |= {(row["concurrency"], "stream"): row["gateway"]["tokens_per_s"] for row in results["mock"]["streaming"]}
        theirs = {(row["concurrency"], "plain"): row["gateway"]["requests_per_s"] for row in results["litellm"]["non_streaming"]}
        theirs |= {(row["concurrency"], "stream"): row["gateway"]["tokens_per_s"] for row in results["litellm"]["streaming"]}
        targets["ahead_of_litellm_on_every_row"] = all(ours[k] > theirs[k] for k in theirs if k in ours)
    if results.get("vllm"):
        c32 = next(row for row in results["vllm"]["streaming"] if row["concurrency"] == STREAM_TOKENS_CONCURRENCY)
        targets["streaming_tokens_per_s_ratio_at_c32>=0.95"] = c32["tokens_per_s_ratio"] >= 0.95
    return targets


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=10)
    parser.add_argument("--no-vllm", action="store_true", help="skip the real-replica runs")
    parser.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM proxy's row")
    parser.add_argument("--only-vllm", action="store_true", help="only the real-replica runs (no mock, no floor)")
    parser.add_argument("--pin", action="store_true",
                        help="pin the gateway to core 0 and the mocks and wrk to core 1 (vLLM runs stay unpinned)")
    parser.add_argument("--shared-engine-cores", action="store_true",
                        help="let vLLM use every core (by default it gets the last core, the rest run gateway and clients)")
    parser.add_argument("--gateway-processes", type=int, default=1,
                        help="uvicorn worker processes of the gateway (production runs one per pod and scales pods)")
    parser.add_argument("--output", default=None,
                        help="default bench/results/gateway.json (gateway-<N>proc.json with --gateway-processes N > 1)")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        print("wrk is missing: apt-get install -y wrk", file=sys.stderr)
        return 2
    pin = args.pin and (os.cpu_count() or 1) >= 2
    gateway_cores, load_cores = ("0", "1") if pin else (None, None)
    engine_core = (os.cpu_count() - 1) if not args.shared_engine_cores and (os.cpu_count() or 1) >= 2 else None

    load_at_start = round(os.getloadavg()[0], 2)
    setup_django()
    logs = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    children: list[ChildProcess] = []
    results: dict = {}
    try:
        mock_port, gateway_port = free_port(), free_port()
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
        gateway = Child([sys.executable, "-m", "uvicorn", "controlplane.asgi:application", "--port", str(gateway_port),
                         "--workers", str(args.gateway_processes), *serve], logs / "gateway.log", cores=gateway_cores)
        children.append(gateway)
        gateway_url = f"http://127.0.0.1:{gateway_port}"
        wait_healthy(gateway_url + "/healthz", gateway, 60)
        bare_urls = {}
        for name, upstream in (("fast", mock_url), ("slow", slow_url)):
            bare_port = free_port()
            bare = Child([sys.executable, "-m", "uvicorn", "bench.bare_proxy:app", "--port", str(bare_port),
                          "--workers", str(args.gateway_processes), *serve], logs / f"bare-proxy-{name}.log",
                         cores=gateway_cores, env={"BARE_PROXY_UPSTREAM": upstream})
            children.append(bare)
            bare_urls[name] = f"http://127.0.0.1:{bare_port}"
            wait_healthy(bare_urls[name] + "/health", bare, 60)

        print(f"gateway overhead (gateway on core {gateway_cores}, mock and wrk on core {load_cores})" if pin else "gateway overhead (unpinned)", flush=True)
        if not args.only_vllm:
            results["mock"] = bench_mock(gateway_url, mock_url, key, args.duration_s, load_cores)
            results["bare_proxy"] = bench_bare_proxy(bare_urls["fast"], mock_url, key, args.duration_s, load_cores)
            venv = None if args.no_litellm else litellm_venv()
            if venv:
                litellm, litellm_url, litellm_key = start_litellm(venv, logs, mock_url, args.gateway_processes, gateway_cores)
                children.append(litellm)
                results["litellm"] = bench_litellm(litellm_url, mock_url, litellm_key, args.duration_s, load_cores)
                litellm.stop()
            else:
                print("the LiteLLM proxy is not installed (bench/run.sh installs it): no LiteLLM row", flush=True)
            results["mock_slow"] = bench_slow_mock(gateway_url, slow_url, key, args.duration_s, load_cores)
            results["bare_proxy_slow"] = bench_bare_proxy(bare_urls["slow"], slow_url, key, args.duration_s, load_cores,
                                                          label="bare proxy, slow mock")
        if vllm_url:
            if engine_core is not None:
                # NOTE: vLLM's CPU threads spin at barriers: a process sharing their core stalls the whole
                # engine. The engine gets the last core; gateway and clients share the others.
                others = f"0-{engine_core - 1}"
                subprocess.run(["taskset", "-a", "-p", "-c", others, str(gateway.process.pid)], check=True, capture_output=True)
                os.sched_setaffinity(0, range(engine_core))
            results["vllm"] = bench_vllm(gateway_url, vllm_url, key, args.duration_s, others if engine_core else None)
    finally:
        for child in reversed(children):
            child.stop()
        unseed()
        shutil.rmtree(logs, ignore_errors=True)

    document = {
        "benchmark": "gateway",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(), "processor": platform.processor() or platform.machine(),
        "num_cpus": os.cpu_count(), "load_average_1m_at_start": load_at_start, "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "pinned": {"gateway": gateway_cores, "mock_and_wrk": load_cores} if pin else None,
        "gateway_processes": args.gateway_processes,
        "vllm_runs": (f"vLLM on core {engine_core} (VLLM_CPU_OMP_THREADS_BIND); gateway, wrk and streaming clients on "
                      f"cores 0-{engine_core - 1}") if engine_core is not None else "unpinned",
        "duration_s_per_run": args.duration_s,
        "request": {"chat_messages": 1, "max_tokens_mock": 16, "max_tokens_vllm_streaming": 64},
        **results,
    }
    document["targets_met"] = verdict(results)
    default_name = "gateway.json" if args.gateway_processes == 1 else f"gateway-{args.gateway_processes}proc.json"
    output = Path(args.output or REPO / "bench" / "results" / default_name)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")
    print(markdown(results))
    print(f"\nload average (1 min) at end: {document['load_average_1m_at_end']}; targets: {document['targets_met']}")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
