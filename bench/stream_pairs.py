"""Streaming runs for the benchmarks: closed-loop streaming chats, and the same upstream direct and through a
proxy in alternating pairs, judged on the median of the pairs' ratios.

No side effects at import (unlike `bench_gateway`, which starts the embedded servers): `bench_gateway` and
`profile_gateway` use it, and so can a test, against the mock.

Why pairs: on a shared 2-core machine a real CPU engine's own rate moves by up to 30 % between two runs a few
seconds apart, more than the gateway's share. One direct run and one gateway run per concurrency read 88 %, 94 %,
109 % and 104 % of direct tokens/s at concurrency 32 in four runs of the same code (issue #20). K pairs, the order
alternating (direct → gateway, then gateway → direct, ...), and the median of the K ratios, as `vllm bench serve`'s
rows already are: a drift during the pairs' time counts for and against the gateway alike.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

from bench.proc_cpu import tree_cpu_s

CHAT_BODY = {"model": "MODEL", "messages": [{"role": "user", "content": "Say something about llamas."}], "max_tokens": 16}
TTFT_KEYS = ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms")


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
        "tokens": num_tokens,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(num_tokens / elapsed, 1),
        "requests_per_s": round(len(totals) / elapsed, 1),
    }


def measured_streams(url: str, key: str, model: str, concurrency: int, duration_s: float, max_tokens: int,
                     extra: dict | None, proxy_pid: int | None) -> dict:
    """`run_streams`, with the CPU seconds `proxy_pid`'s process tree spent over the run (/proc) and per streamed
    token, when a proxy's pid is given."""
    before = tree_cpu_s(proxy_pid) if proxy_pid else None
    result = asyncio.run(run_streams(url, key, model, concurrency, duration_s, max_tokens, extra))
    if before is not None:
        spent = tree_cpu_s(proxy_pid) - before
        result["proxy_cpu_s"] = round(spent, 3)
        result["proxy_cpu_us_per_token"] = round(spent / result["tokens"] * 1e6, 1) if result["tokens"] else None
        # its share of one core over the run: near 100 % the proxy itself is the bottleneck
        result["proxy_cpu_share_of_a_core"] = round(spent / result["elapsed_s"], 3) if result["elapsed_s"] else None
    return result


def _ratio(through: float, direct: float) -> float | None:
    return round(through / direct, 3) if direct else None


def _combined(runs: list[dict]) -> dict:
    """The K runs of one side as one: tokens/s and requests/s their means, TTFT percentiles the median of the runs',
    requests and errors summed (the keys a single run has, so that readers of one run read this)."""
    combined = {"concurrency": runs[0]["concurrency"], "runs": len(runs),
                "requests": sum(run["requests"] for run in runs), "errors": sum(run["errors"] for run in runs),
                "tokens": sum(run["tokens"] for run in runs),
                "tokens_per_s": round(statistics.mean(run["tokens_per_s"] for run in runs), 1),
                "requests_per_s": round(statistics.mean(run["requests_per_s"] for run in runs), 1)}
    for key in TTFT_KEYS:
        values = [run[key] for run in runs if run.get(key) is not None]
        combined[key] = round(statistics.median(values), 2) if values else None
    spent = [run["proxy_cpu_s"] for run in runs if "proxy_cpu_s" in run]
    if spent:
        combined["proxy_cpu_s"] = round(sum(spent), 3)
        combined["proxy_cpu_us_per_token"] = round(sum(spent) / combined["tokens"] * 1e6, 1) if combined["tokens"] else None
    return combined


def stream_pairs(direct_url: str, proxy_url: str, key: str, model: str, concurrency: int, duration_s: float,
                 max_tokens: int, extra: dict | None = None, *, pairs: int = 3, proxy_pid: int | None = None) -> dict:
    """`pairs` alternating pairs at one concurrency: direct → proxy in odd pairs, proxy → direct in even ones.

    Returns a row with the keys a single pair's row had (`direct`, `gateway`: the K runs combined, `_combined`;
    `added_ttft_*`; `tokens_per_s_ratio`: now the median of the pairs' ratios, the figure a target is judged on),
    and `pairs` (each pair's order, runs and ratio), `median_ratio`, `ratio_of_means` (mean gateway tokens/s ÷
    mean direct) and `judged_on`. With `proxy_pid`, every proxy run carries the proxy's CPU over the run and per
    token (`measured_streams`): a miss with the proxy's CPU per token unchanged is the engine's noise."""
    if pairs < 1:
        raise ValueError("pairs must be at least 1")
    urls = {"direct": direct_url, "gateway": proxy_url}
    rows = []
    for index in range(pairs):
        order = ["direct", "gateway"] if index % 2 == 0 else ["gateway", "direct"]
        runs = {side: measured_streams(urls[side] + "/v1/chat/completions", key, model, concurrency, duration_s, max_tokens,
                                       extra, proxy_pid if side == "gateway" else None) for side in order}
        rows.append({"pair": index + 1, "order": order, "direct": runs["direct"], "gateway": runs["gateway"],
                     "tokens_per_s_ratio": _ratio(runs["gateway"]["tokens_per_s"], runs["direct"]["tokens_per_s"])})
    direct, through = _combined([row["direct"] for row in rows]), _combined([row["gateway"] for row in rows])
    ratios = [row["tokens_per_s_ratio"] for row in rows if row["tokens_per_s_ratio"] is not None]
    median = round(statistics.median(ratios), 3) if ratios else None
    added = {f"added_{k}": round(through[k] - direct[k], 3) for k in TTFT_KEYS
             if direct.get(k) is not None and through.get(k) is not None}
    return {"concurrency": concurrency, "direct": direct, "gateway": through, **added,
            "tokens_per_s_ratio": median, "median_ratio": median,
            "ratio_of_means": _ratio(through["tokens_per_s"], direct["tokens_per_s"]),
            "judged_on": "median_ratio", "pairs": rows}
