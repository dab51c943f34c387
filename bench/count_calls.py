"""Python function calls per proxied request on the gateway's event loop thread, by package (cProfile).

Starts the fast mock and the gateway of this tree (and, with `--compare-with DIR`, the gateway of an
older checkout), each under uvicorn (uvloop, httptools) inside this script's `serve` mode, which turns
cProfile on at SIGUSR1 and off at SIGUSR2 (then writes its stats); between the two, one wrk run
(non-streaming chat, concurrency 16). Prints calls per request, in all and by top-level package.
cProfile's own cost makes the run slow: the counts, not the times, are the measure.

    .venv/bin/python bench/count_calls.py [--compare-with .data/before] [--duration-s 3] [--top 40]
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def serve(app: str, port: int, stats_path: str) -> None:
    """The server side: uvicorn in this process, profiled between SIGUSR1 and SIGUSR2."""
    import cProfile

    import uvicorn

    profiler = cProfile.Profile()

    def start(*_):
        profiler.enable()

    def stop(*_):
        profiler.disable()
        profiler.dump_stats(stats_path)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", access_log=False, log_level="warning")


def by_package(stats_path: str) -> collections.Counter:
    import pstats

    counts = collections.Counter()
    for (filename, _, _name), (_, total_calls, *_rest) in pstats.Stats(stats_path).stats.items():
        if filename == "~":
            package = "builtins"
        else:
            parts = Path(filename).parts
            if "site-packages" in parts:
                package = parts[parts.index("site-packages") + 1].removesuffix(".py")
            elif "lib" in parts and any(p.startswith("python3") for p in parts):
                package = "stdlib:" + parts[-1].removesuffix(".py") if "asyncio" not in parts else "stdlib:asyncio"
            else:
                rel = [p for p in parts if p not in ("", "/")]
                package = ".".join(rel[-3:-1]) if len(rel) >= 3 else rel[-1]
        counts[package] += total_calls
    return counts


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return 0
    sys.path.insert(0, str(REPO))
    from bench import bench_gateway as bench

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=3)
    parser.add_argument("--compare-with", default=None)
    parser.add_argument("--top", type=int, default=0, help="also list the functions with the most calls per request")
    args = parser.parse_args()
    bench.setup_django()
    logs = Path(tempfile.mkdtemp(prefix="count-calls-"))
    children = []
    try:
        mock_port = bench.free_port()
        mock = bench.Child([sys.executable, "-m", "tests.fakes.mock_openai", "--port", str(mock_port)], logs / "mock.log")
        children.append(mock)
        mock_url = f"http://127.0.0.1:{mock_port}"
        bench.wait_healthy(mock_url + "/health", mock, 30)
        key = bench.seed({"mock": mock_url})
        trees = {"this tree": REPO}
        if args.compare_with:
            trees["compared"] = Path(args.compare_with).resolve()
        results = {}
        for label, tree in trees.items():
            port = bench.free_port()
            stats_path = str(logs / f"{port}.prof")
            env = {"PYTHONPATH": os.pathsep.join([str(tree), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                               if p and Path(p).resolve() != REPO]])}
            child = bench.Child(["env", "-C", str(tree), sys.executable, str(Path(__file__).resolve()), "serve",
                                 "controlplane.asgi:application", str(port), stats_path], logs / f"{port}.log", env=env)
            children.append(child)
            url = f"http://127.0.0.1:{port}"
            bench.wait_healthy(url + "/healthz", child, 60)
            bench.run_wrk(url + "/v1/chat/completions", key, "mock", 16, 2, None)  # warm up
            pid = child.process.pid
            os.kill(pid, signal.SIGUSR1)
            run = bench.run_wrk(url + "/v1/chat/completions", key, "mock", 16, args.duration_s, None)
            os.kill(pid, signal.SIGUSR2)
            deadline = time.monotonic() + 30
            while not Path(stats_path).exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(0.5)
            counts = by_package(stats_path)
            requests = max(1, run["requests"])
            results[label] = (requests, counts)
            print(f"{label}: {requests} requests, {sum(counts.values()) / requests:,.0f} calls per request, errors {run['errors']}")
            for package, n in counts.most_common(14):
                print(f"    {n / requests:8.1f}  {package}")
            if args.top:
                import pstats

                functions = sorted(pstats.Stats(stats_path).stats.items(), key=lambda item: -item[1][1])[: args.top]
                for (filename, line, name), (_, total_calls, *_rest) in functions:
                    print(f"    {total_calls / requests:8.1f}  {name} ({Path(filename).name}:{line})")
    finally:
        for child in reversed(children):
            child.stop()
        bench.unseed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
