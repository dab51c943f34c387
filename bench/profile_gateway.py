"""The gateway's own CPU per proxied request, next to the bare-proxy floor, in the same run.

Starts the fast mock, the gateway and `bench/bare_proxy.py` (each one process, the same server
flags as `bench/bench_gateway.py`, whose seeding and wrk runner it reuses), then alternates wrk runs
(non-streaming chat, concurrency 16) against the floor and the gateway. For each run it reads the
server process's CPU time (user + system, from /proc) before and after: CPU µs per request is that
difference over the requests wrk counted. With `--py-spy` one more gateway run is sampled by
py-spy (and with `--compare-with`, one of the older gateway right after), and the functions with the most
samples (self and total) are printed. With `--machine-cpu`, each run also prints the server's user and system
time a request and how often its loop was preempted: Python's cost apart from the kernel's. With `--perf`, the
same sampled runs go to Linux `perf record` (cpu-clock, so it works where the VM has no hardware counters) instead
of py-spy: native symbols, so CPython's own C functions (attribute look-ups, the interpreter loop) and compiled
modules show, which py-spy's Python frames hide (round 22).

    .venv/bin/python bench/profile_gateway.py [--duration-s 5] [--rounds 2] [--py-spy|--perf] [--server uvicorn|granian]
        [--compare-server granian|uvicorn-access-log|uvicorn-server-header|lean|lean-asgi [--granian-args "--runtime-mode st"]]

`--compare-server` serves the same tree (gateway and floor) a second time under the other server,
measured in the same rounds, alternating; the summary gives the medians and the paired differences.
`--tree DIR` serves the gateway from another checkout instead of this one: with `--compare-with`, two older commits
are paired by this script (round 21: `3d66954` against its parent).

The record of what this showed, before and after each change, is `bench/results/gateway_profile.md`.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import bench_gateway as bench  # noqa: E402 - sets the benchmark's environment first
from bench.proc_cpu import cpu_s, machine_busy_s, preemptions, server_pids, tree_cpu_s, user_system_s  # noqa: E402

CONCURRENCY = 16


def serve_args(server: str, app: str, port: int, granian_args: tuple[str, ...] = ()) -> list[str]:
    if server in ("lean", "lean-asgi"):
        # NOTE: bench/lean_server.py (round 29): "lean" serves the floor without ASGI (a Protocol of its own),
        # "lean-asgi" serves bench/bare_proxy.py's ASGI app; both serve the gateway's ASGI app.
        floor = server == "lean" and app == "bench.bare_proxy:app"
        return [sys.executable, str(REPO / "bench" / "lean_server.py"), *(["--bare-floor"] if floor else [app]),
                "--host", "127.0.0.1", "--port", str(port)]
    if server == "granian":
        return [sys.executable, "-m", "granian", "--interface", "asgi", "--host", "127.0.0.1", "--port", str(port),
                "--workers", "1", "--loop", "uvloop", "--no-ws", "--no-access-log", "--log-level", "warning",
                *granian_args, app]
    access_log = [] if server == "uvicorn-access-log" else ["--no-access-log"]  # the former: as a pod ran it before
    # NOTE: no `server: uvicorn` header, as `controlplane.serve` runs a pod (round 28); uvicorn-server-header: with it,
    # as this bench ran every gateway and floor through round 27.
    server_header = ["--server-header"] if server == "uvicorn-server-header" else ["--no-server-header"]
    return [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port), *access_log,
            *server_header, "--log-level", "info" if access_log == [] else "warning", "--loop", "uvloop",
            "--http", "httptools"]


def in_tree(tree: str, command: list[str]) -> tuple[list[str], dict[str, str]]:
    """`command` run from another checkout, importing its code (not this tree's)."""
    tree = str(Path(tree).resolve())
    python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
    return ["env", "-C", tree, *command], {"PYTHONPATH": os.pathsep.join([tree, *python_path])}


def server_pid(child) -> int:
    """The process that serves: granian serves from a worker process it spawns."""
    pid = child.process.pid
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists() and children.read_text().split():
        return int(children.read_text().split()[0])
    return pid


def py_spy_bin(given: str | None) -> str:
    if given:
        return given
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else (shutil.which("py-spy") or str(beside))


def snapshot(pid: int) -> dict:
    children = os.times()
    redis_pid, postgres_pid = server_pids(bench.DATA_DIR)
    return {"server": cpu_s(pid), "redis": tree_cpu_s(redis_pid), "postgres": tree_cpu_s(postgres_pid),
            "mock": cpu_s(MOCK_PID[0]) if MOCK_PID else 0.0, "wrk": children.children_user + children.children_system,
            "machine": machine_busy_s()}


MOCK_PID: list[int] = []  # the fast mock's pid, once started


def measure(url: str, key: str, pid: int, duration_s: float) -> dict:
    before, split_before, preempted_before = snapshot(pid), user_system_s(pid), preemptions(pid)
    run = bench.run_wrk(url + "/v1/chat/completions", key, "mock", CONCURRENCY, duration_s, None)
    after, split_after, preempted_after = snapshot(pid), user_system_s(pid), preemptions(pid)
    per = max(1, run["requests"])
    run["cpu_us_per_request"] = round((after["server"] - before["server"]) / per * 1e6, 1)
    # The server process's own CPU as user and system time, and how often a request's loop was preempted.
    run["server_split"] = {"user": round((split_after[0] - split_before[0]) / per * 1e6),
                           "system": round((split_after[1] - split_before[1]) / per * 1e6),
                           "preempted": round((preempted_after - preempted_before) / per, 2)}
    # Where the rest of the machine's CPU went, per request: Redis, PostgreSQL, the mock upstream, wrk, and all of it.
    run["others_us_per_request"] = {name: round((after[name] - before[name]) / per * 1e6) for name in after if name != "server"}
    # NOTE: "bench" is this run's own processes (the server, Redis, PostgreSQL, the mock, wrk): on a machine other
    # engineers share, "machine" counts their work too, and only this sum compares trees.
    run["others_us_per_request"]["bench"] = round(sum(after[name] - before[name] for name in after if name != "machine")
                                                  / per * 1e6)
    return run


def top_functions(raw_path: Path, num: int = 25) -> str:
    """The functions with the most samples in py-spy's raw (collapsed) output: self and total."""
    own, total, num_samples = collections.Counter(), collections.Counter(), 0
    for line in raw_path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        count = int(count)
        num_samples += count
        frames = [frame.split(" (")[0] + " (" + frame.split(" (")[1].split(":")[0].rsplit("/", 1)[-1] + ")"
                  if " (" in frame else frame for frame in stack.split(";")]
        own[frames[-1]] += count
        for frame in set(frames):
            total[frame] += count
    lines = [f"{num_samples} samples", "", "| self % | function |", "|---:|---|"]
    lines += [f"| {100 * n / num_samples:.1f} | `{name}` |" for name, n in own.most_common(num)]
    lines += ["", "| total % | function |", "|---:|---|"]
    lines += [f"| {100 * n / num_samples:.1f} | `{name}` |" for name, n in total.most_common(num)]
    return "\n".join(lines)


def top_symbols(perf_data: Path, num: int = 30) -> str:
    """The native functions (shared object and symbol) with the most of perf's samples, self time only."""
    report = subprocess.run(["perf", "report", "-i", str(perf_data), "--no-children", "-g", "none", "--sort", "dso,sym", "-n",
                             "--percent-limit", "0.3"], capture_output=True, text=True).stdout
    lines = [line for line in report.splitlines() if line.strip() and not line.startswith("#")]
    return "\n".join(lines[:num])


def compare_summary(server: str, other: str, rows: list[tuple]) -> str:
    """Medians of each column and of the paired differences (other server's gateway − this one's), as a table."""
    import statistics

    names = (f"floor {server}", f"gateway {server}", f"floor {other}", f"gateway {other}")
    lines = ["| round | " + " | ".join(f"{n} req/s | {n} µs/req" for n in names) + f" | gateway {other} − {server} µs |",
             "|---:|" + "---:|" * (2 * len(names) + 1)]
    diffs = []
    for number, row in enumerate(rows, 1):
        diffs.append(row[3]["cpu_us_per_request"] - row[1]["cpu_us_per_request"])
        lines.append(f"| {number} | " + " | ".join(f"{run['requests_per_s']:,.0f} | {run['cpu_us_per_request']:,.0f}" for run in row)
                     + f" | {diffs[-1]:+,.0f} |")
    medians = [(statistics.median(r[i]["requests_per_s"] for r in rows), statistics.median(r[i]["cpu_us_per_request"] for r in rows))
               for i in range(len(names))]
    lines.append("| median | " + " | ".join(f"{rps:,.0f} | {us:,.0f}" for rps, us in medians)
                 + f" | {statistics.median(diffs):+,.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--py-spy", action="store_true")
    parser.add_argument("--py-spy-output", default=None, help="keep py-spy's raw (collapsed) stacks here")
    parser.add_argument("--perf", action="store_true",
                        help="sample with Linux perf (native symbols, cpu-clock) instead of py-spy; the output keeps "
                             "perf's data file next to --py-spy-output's name, with `.perf` added")
    parser.add_argument("--py-spy-bin", default=None,
                        help="py-spy's executable (default: next to this Python, else on PATH); e.g. a virtualenv "
                             "under .data/, never the project's")
    parser.add_argument("--compare-with", default=None,
                        help="a checkout of older code (e.g. `git archive <commit> | tar -x -C DIR`): its gateway is "
                             "measured too, in the same rounds")
    parser.add_argument("--tree", default=None,
                        help="serve the gateway from this checkout instead of this tree's (with --compare-with: two "
                             "older commits paired by this script)")
    parser.add_argument("--stream-concurrency", default="",
                        help="also streaming runs at these concurrencies (e.g. 32,64): tokens/s direct and through "
                             "the gateway (fast mock, 16 tokens), alternating, and the gateway's CPU µs per token")
    parser.add_argument("--stream-token-delay-ms", type=float, default=0.0,
                        help="the streaming runs go to a second mock pausing this long before each token (below "
                             "saturation, as a real engine)")
    parser.add_argument("--skip-wrk", action="store_true", help="only the streaming runs")
    parser.add_argument("--server", choices=("uvicorn", "granian"), default="uvicorn")
    parser.add_argument("--compare-server", choices=("uvicorn", "granian", "uvicorn-access-log", "uvicorn-server-header", "lean",
                                 "lean-asgi"),
                        default=None,
                        help="also serve the gateway and the floor of this tree under this server, in the same rounds "
                             "(uvicorn-access-log: uvicorn writing its access line, as a pod's web process did before "
                             "`controlplane.serve`; uvicorn-server-header: uvicorn's `server: uvicorn` header on, which "
                             "a pod's web process turns off; lean: bench/lean_server.py, the floor without ASGI and the "
                             "gateway under a minimal ASGI server; lean-asgi: the same with the floor's ASGI app)")
    parser.add_argument("--granian-args", default="", help="extra granian flags, e.g. \"--runtime-mode st\"")
    parser.add_argument("--machine-cpu", action="store_true",
                        help="also print, per request, the CPU of Redis, PostgreSQL, the mock, wrk and the whole machine")
    args = parser.parse_args()
    granian_args = tuple(args.granian_args.split())
    bench.setup_django()
    logs = Path(tempfile.mkdtemp(prefix="profile-gateway-"))
    children = []
    try:
        mock_port, gateway_port, bare_port = bench.free_port(), bench.free_port(), bench.free_port()
        mock = bench.Child([sys.executable, "-m", "tests.fakes.mock_openai", "--port", str(mock_port)], logs / "mock.log")
        children.append(mock)
        mock_url = f"http://127.0.0.1:{mock_port}"
        bench.wait_healthy(mock_url + "/health", mock, 30)
        MOCK_PID.append(mock.process.pid)
        upstreams = {"mock": mock_url}
        stream_model, stream_upstream = "mock", mock_url
        if args.stream_token_delay_ms:
            slow_port = bench.free_port()
            slow = bench.Child([sys.executable, "-m", "tests.fakes.mock_openai", "--port", str(slow_port), "--token-delay-ms",
                                str(args.stream_token_delay_ms)], logs / "mock-slow.log")
            children.append(slow)
            stream_model, stream_upstream = "mock-slow", f"http://127.0.0.1:{slow_port}"
            bench.wait_healthy(stream_upstream + "/health", slow, 30)
            upstreams[stream_model] = stream_upstream
        key = bench.seed(upstreams)
        gateway_command = serve_args(args.server, "controlplane.asgi:application", gateway_port, granian_args)
        gateway_command, gateway_env = in_tree(args.tree, gateway_command) if args.tree else (gateway_command, None)
        gateway = bench.Child(gateway_command, logs / "gateway.log", env=gateway_env)
        children.append(gateway)
        gateway_url = f"http://127.0.0.1:{gateway_port}"
        bench.wait_healthy(gateway_url + "/healthz", gateway, 60)
        bare = bench.Child(serve_args(args.server, "bench.bare_proxy:app", bare_port, granian_args), logs / "bare.log",
                           env={"BARE_PROXY_UPSTREAM": mock_url})
        children.append(bare)
        bare_url = f"http://127.0.0.1:{bare_port}"
        bench.wait_healthy(bare_url + "/health", bare, 60)
        before_url = before_pid = None
        if args.compare_with:
            before_port = bench.free_port()
            before_command, before_env = in_tree(args.compare_with, serve_args(
                args.server, "controlplane.asgi:application", before_port, granian_args))
            before = bench.Child(before_command, logs / "before.log", env=before_env)
            children.append(before)
            before_url = f"http://127.0.0.1:{before_port}"
            bench.wait_healthy(before_url + "/healthz", before, 60)
            before_pid = server_pid(before)
            bench.run_wrk(before_url + "/v1/chat/completions", key, "mock", CONCURRENCY, 2, None)  # warm up
        other = None  # (gateway url, gateway pid, floor url, floor pid) under --compare-server
        if args.compare_server:
            other_gateway_port, other_bare_port = bench.free_port(), bench.free_port()
            other_gateway = bench.Child(serve_args(args.compare_server, "controlplane.asgi:application", other_gateway_port,
                                                   granian_args), logs / "gateway-other.log")
            children.append(other_gateway)
            other_bare = bench.Child(serve_args(args.compare_server, "bench.bare_proxy:app", other_bare_port, granian_args),
                                     logs / "bare-other.log", env={"BARE_PROXY_UPSTREAM": mock_url})
            children.append(other_bare)
            other = (f"http://127.0.0.1:{other_gateway_port}", None, f"http://127.0.0.1:{other_bare_port}", None)
            bench.wait_healthy(other[0] + "/healthz", other_gateway, 60)
            bench.wait_healthy(other[2] + "/health", other_bare, 60)
            other = (other[0], server_pid(other_gateway), other[2], server_pid(other_bare))
            bench.run_wrk(other[0] + "/v1/chat/completions", key, "mock", CONCURRENCY, 2, None)  # warm up
            bench.run_wrk(other[2] + "/v1/chat/completions", key, "mock", CONCURRENCY, 2, None)
        gateway_pid, bare_pid = server_pid(gateway), server_pid(bare)
        bench.run_wrk(gateway_url + "/v1/chat/completions", key, "mock", CONCURRENCY, 2, None)  # warm up
        bench.run_wrk(bare_url + "/v1/chat/completions", key, "mock", CONCURRENCY, 2, None)
        rows = []
        for round_index in range(0 if args.skip_wrk else args.rounds):
            # NOTE: under `--compare-server` too, the two servers take turns at going first (round 28: before, the
            # other server always ran last).
            other_runs = ((measure(other[2], key, other[3], args.duration_s),
                           measure(other[0], key, other[1], args.duration_s)) if other and round_index % 2 else None)
            floor = measure(bare_url, key, bare_pid, args.duration_s)
            # NOTE: with `--compare-with`, the two gateways take turns at going first: the slot a run has in its
            # round moves its figures more than most changes (two runs of the same pair of trees, swapped between
            # slots, read the tree in the last slot 10-70 µs a request lower every time).
            older = measure(before_url, key, before_pid, args.duration_s) if before_url and round_index % 2 else None
            through = measure(gateway_url, key, gateway_pid, args.duration_s)
            rows.append((floor, through))
            if other:
                other_floor, other_through = other_runs or (measure(other[2], key, other[3], args.duration_s),
                                                             measure(other[0], key, other[1], args.duration_s))
                rows[-1] += (other_floor, other_through)
                print(f"{args.compare_server}: floor {other_floor['requests_per_s']}/s {other_floor['cpu_us_per_request']} µs/req "
                      f"p50 {other_floor['p50_ms']} ms | gateway {other_through['requests_per_s']}/s "
                      f"{other_through['cpu_us_per_request']} µs/req p50 {other_through['p50_ms']} p99 {other_through['p99_ms']} ms "
                      f"errors {other_through['errors']} | ratio {other_through['requests_per_s'] / other_floor['requests_per_s']:.1%}",
                      flush=True)
            if before_url:
                older = older or measure(before_url, key, before_pid, args.duration_s)
                if args.machine_cpu:
                    print(f"  µs per request elsewhere: before {older['others_us_per_request']} {older['server_split']}", flush=True)
                print(f"before {older['requests_per_s']}/s {older['cpu_us_per_request']} µs/req p50 {older['p50_ms']} "
                      f"p99 {older['p99_ms']} ms errors {older['errors']} | "
                      f"ratio {older['requests_per_s'] / floor['requests_per_s']:.1%}", flush=True)
            if args.machine_cpu:
                print(f"  µs per request elsewhere: floor {floor['others_us_per_request']} {floor['server_split']} | "
                      f"gateway {through['others_us_per_request']} {through['server_split']}", flush=True)
            print(f"floor {floor['requests_per_s']}/s {floor['cpu_us_per_request']} µs/req p50 {floor['p50_ms']} ms | "
                  f"gateway {through['requests_per_s']}/s {through['cpu_us_per_request']} µs/req p50 {through['p50_ms']} "
                  f"p99 {through['p99_ms']} ms errors {through['errors']} | "
                  f"ratio {through['requests_per_s'] / floor['requests_per_s']:.1%}", flush=True)
        if other and rows:
            print(compare_summary(args.server, args.compare_server, rows), flush=True)
        for concurrency in [int(c) for c in args.stream_concurrency.split(",") if c]:
            for _ in range(args.rounds):
                direct = bench.asyncio.run(bench.run_streams(stream_upstream + "/v1/chat/completions", key, stream_model, concurrency,
                                                             args.duration_s, 16))
                before_cpu = cpu_s(gateway_pid)
                through = bench.asyncio.run(bench.run_streams(gateway_url + "/v1/chat/completions", key, stream_model, concurrency,
                                                              args.duration_s, 16))
                used = cpu_s(gateway_pid) - before_cpu
                line = (f"stream c{concurrency}: tokens/s direct {direct['tokens_per_s']} gateway {through['tokens_per_s']} "
                        f"ratio {through['tokens_per_s'] / max(1, direct['tokens_per_s']):.1%} | gateway "
                        f"{used / max(1, through['tokens_per_s'] * args.duration_s) * 1e6:.1f} µs CPU per token, "
                        f"errors {through['errors']}")
                if before_url:
                    before_cpu = cpu_s(before_pid)
                    older = bench.asyncio.run(bench.run_streams(before_url + "/v1/chat/completions", key, stream_model,
                                                                concurrency, args.duration_s, 16))
                    used = cpu_s(before_pid) - before_cpu
                    line += (f" | before {older['tokens_per_s']} ratio {older['tokens_per_s'] / max(1, direct['tokens_per_s']):.1%} "
                             f"{used / max(1, older['tokens_per_s'] * args.duration_s) * 1e6:.1f} µs CPU per token")
                if other:
                    before_cpu = cpu_s(other[1])
                    third = bench.asyncio.run(bench.run_streams(other[0] + "/v1/chat/completions", key, stream_model,
                                                                concurrency, args.duration_s, 16))
                    used = cpu_s(other[1]) - before_cpu
                    line += (f" | {args.compare_server} {third['tokens_per_s']} ratio "
                             f"{third['tokens_per_s'] / max(1, direct['tokens_per_s']):.1%} "
                             f"{used / max(1, third['tokens_per_s'] * args.duration_s) * 1e6:.1f} µs CPU per token, "
                             f"errors {third['errors']}")
                print(line, flush=True)
        if args.py_spy or args.perf:
            raw = Path(args.py_spy_output or logs / "gateway.raw")
            # With `--compare-with`, the older gateway is sampled too, right after, under the same load (its stacks
            # beside this tree's, with `.before` added to the name).
            spied = [(gateway_url, gateway_pid, raw)]
            if before_url:
                spied.append((before_url, before_pid, raw.with_name(raw.name + ".before")))
            for url, pid, path in spied:
                if args.perf:
                    path = path.with_name(path.name + ".perf")
                    spy = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "1999", "-g", "-p", str(pid), "-o", str(path),
                                            "--", "sleep", str(int(args.duration_s) + 1)],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                else:
                    spy = subprocess.Popen([py_spy_bin(args.py_spy_bin), "record", "--pid", str(pid), "--format", "raw", "--rate",
                                            "200", "--nonblocking", "--output", str(path), "--duration",
                                            str(int(args.duration_s) + 1)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                time.sleep(0.5)
                if args.skip_wrk and args.stream_concurrency:  # sample a streaming run
                    bench.asyncio.run(bench.run_streams(url + "/v1/chat/completions", key, stream_model,
                                                        int(args.stream_concurrency.split(",")[0]), args.duration_s, 16))
                else:
                    bench.run_wrk(url + "/v1/chat/completions", key, "mock", CONCURRENCY, args.duration_s, None)
                spy.wait(timeout=60)
                print(f"{'perf' if args.perf else 'py-spy'} of {'this tree' if pid == gateway_pid else 'the compared tree'}:")
                if not path.exists():
                    print(f"{'perf' if args.perf else 'py-spy'} wrote nothing: {spy.stderr.read().decode()[-2000:]}")
                elif args.perf:
                    print(top_symbols(path))
                else:
                    print(top_functions(path))
        if not args.skip_wrk and not through["requests"]:
            print(gateway.log_tail())
    finally:
        for child in reversed(children):
            child.stop()
        bench.unseed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
