"""Command line: `python -m gpu_agent run ...` / `inferplane-agent run ...` and `tiny-model DIR`."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import resource
import signal
import sys
import threading
from pathlib import Path

from gpu_agent.protocol import DEFAULT_ENGINE_PORT_MAX, DEFAULT_ENGINE_PORT_MIN
from gpu_agent.runtime.engine_disk import (
    DEFAULT_ENGINE_CACHE_BYTES,
    DEFAULT_ENGINE_CACHE_MAX_AGE_S,
    DEFAULT_ENGINE_MAX_BYTES,
    EngineDiskBounds,
)
from gpu_agent.runtime.sandbox import DEFAULT_MODE, MODE_ENV, SandboxMode, parse_mode


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferplane-agent", description="Inferplane GPU agent")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="register with the control plane and run replicas")
    run.add_argument(
        "--control-plane", required=True, help="control plane base URL, e.g. https://inferplane.example"
    )
    run.add_argument("--join-token", default=os.environ.get("INFERPLANE_JOIN_TOKEN", ""))
    run.add_argument(
        "--data-dir",
        default=os.environ.get("INFERPLANE_AGENT_DATA_DIR", str(Path.home() / ".inferplane-agent")),
    )
    run.add_argument("--name", default="", help="node name (default: host name)")
    run.add_argument("--cpu", action="store_true", help="run engines on CPU even if GPUs are present")
    run.add_argument("--weights-budget-gb", type=float, default=None, help="disk budget of the weights cache")
    run.add_argument(
        "--weights-disk-reserve-percent",
        default=os.environ.get("INFERPLANE_AGENT_WEIGHTS_DISK_RESERVE_PERCENT", "0"),
        type=_reserve_percent,
        help="the share of the weights cache's disk no download takes (default 0; the DaemonSet's 20 keeps the node's"
        " disk above the kubelet's eviction thresholds)",
    )
    run.add_argument(
        "--adapter-max-gb",
        default=os.environ.get("INFERPLANE_AGENT_ADAPTER_MAX_GB"),
        type=_positive_float,
        help="the most a LoRA adapter's files may take (default 8); a larger one is refused before it is downloaded",
    )
    run.add_argument(
        "--private-weights-grace-min",
        default=os.environ.get("INFERPLANE_AGENT_PRIVATE_WEIGHTS_GRACE_MIN"),
        type=_non_negative_float,
        help="how long an organisation's own cached weights that no replica of this node wants any more stay"
        " (default 15; 0: removed at the next heartbeat); shared catalogue weights stay under the budget",
    )
    run.add_argument(
        "--s3-endpoint-url", default=None, help="S3-compatible endpoint (default: AWS_ENDPOINT_URL_S3)"
    )
    run.add_argument(
        "--keep-engines-on-exit",
        action="store_true",
        help="leave engines running when the agent exits; the next agent adopts them (no standby: every"
        " replica starts with a plain `vllm serve`, since what a standby becomes dies with the agent)",
    )
    run.add_argument(
        "--no-standby",
        dest="standby",
        action="store_false",
        help="no warm standby engine: every replica starts with a plain `vllm serve` (slower cold starts)",
    )
    run.add_argument(
        "--no-zygote",
        dest="zygote",
        action="store_false",
        help="a one-shot standby that becomes the engine (replaced after use) instead of a fork server",
    )
    run.add_argument(
        "--advertise-host",
        default=os.environ.get("INFERPLANE_AGENT_ADVERTISE_HOST", "127.0.0.1"),
        help="address at which the gateway reaches this node's engines (default: loopback, single machine)",
    )
    run.add_argument(
        "--engine-ports",
        default=os.environ.get(
            "INFERPLANE_AGENT_ENGINE_PORTS", f"{DEFAULT_ENGINE_PORT_MIN}-{DEFAULT_ENGINE_PORT_MAX}"
        ),
        type=_port_range,
        help="LOW-HIGH: the ports engines listen on; the control plane accepts no engine address outside them",
    )
    run.add_argument(
        "--cpu-kv-cache-gib", type=int, default=1,
        help="KV cache per engine on CPU nodes, at most (less when its sequences fill less)",
    )  # fmt: skip
    run.add_argument(
        "--min-download-kib-per-s",
        default=os.environ.get("INFERPLANE_AGENT_MIN_DOWNLOAD_KIB_PER_S", "64"),
        type=_positive_int,
        help="the slowest a store may send each of a download's (8 parallel) parts after its first 60 s before it"
        " is given up on; the deadline of a part is 60 s plus its bytes at this rate",
    )
    run.add_argument(
        "--engine-sandbox",
        default=os.environ.get(MODE_ENV, DEFAULT_MODE.value),
        type=_sandbox_mode,
        help="confine each engine with Landlock, in its own user, PID and mount namespaces: required (a replica fails"
        " where the kernel cannot), best-effort (engines run without there, as the node's facts say) or off",
    )
    run.add_argument(
        "--engine-disk-gb",
        default=os.environ.get("INFERPLANE_AGENT_ENGINE_DISK_GB", str(DEFAULT_ENGINE_MAX_BYTES / 1e9)),
        type=_positive_float,
        help="the most one running engine may keep in its scratch folder and its endpoint's cache folder together"
        " (default 20); past it its replica fails and both are emptied",
    )
    run.add_argument(
        "--engine-cache-gb",
        default=os.environ.get("INFERPLANE_AGENT_ENGINE_CACHE_GB", str(DEFAULT_ENGINE_CACHE_BYTES / 1e9)),
        type=_positive_float,
        help="the most all endpoints' engine cache folders may take together (default 50); past it those of endpoints"
        " with no replica here go, least recently used first",
    )
    run.add_argument(
        "--engine-cache-days",
        default=os.environ.get("INFERPLANE_AGENT_ENGINE_CACHE_DAYS", str(DEFAULT_ENGINE_CACHE_MAX_AGE_S / 86400)),
        type=_positive_float,
        help="an endpoint's engine cache folder unused this long goes (default 14)",
    )
    run.add_argument(
        "--engine-hung-after-s",
        default=os.environ.get("INFERPLANE_AGENT_ENGINE_HUNG_AFTER_S"),
        type=_positive_float,
        help="a READY engine that leaves its health check unanswered this long while its processes compute next to"
        " nothing is hung: killed and restarted (default 15)",
    )
    run.add_argument("--log-level", default=os.environ.get("INFERPLANE_AGENT_LOG_LEVEL", "INFO"))

    tiny = commands.add_parser("tiny-model", help="write a tiny random Llama for tests (no download)")
    tiny.add_argument("directory")
    tiny.add_argument("--embedding", action="store_true", help="an embedding model (served on /v1/embeddings)")
    tiny.add_argument("--lora", action="store_true", help="a LoRA adapter for the tiny model (PEFT layout)")
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of at least 1, not {value}")
    return value


def _sandbox_mode(text: str) -> SandboxMode:
    try:
        return parse_mode(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, not {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of at least 0, not {text}")
    return value


def _reserve_percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not 0 <= value < 100:
        raise argparse.ArgumentTypeError(f"expected a percentage of at least 0 and below 100, not {text}")
    return value


def _port_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        ports = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH, not {text!r}") from None
    if not 1024 <= ports[0] <= ports[1] <= 65535:
        raise argparse.ArgumentTypeError("ports must satisfy 1024 <= LOW <= HIGH <= 65535")
    return ports


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # NOTE: botocore's DEBUG lines print request headers, a replica's session token among them.
    logging.getLogger("botocore").setLevel(max(logging.getLogger().level, logging.INFO))
    if args.command == "tiny-model":
        from gpu_agent.runtime.tiny_model import (
            build_tiny_embedding_model,
            build_tiny_lora_adapter,
            build_tiny_model,
        )

        if args.lora:
            print(build_tiny_lora_adapter(args.directory))
        else:
            print((build_tiny_embedding_model if args.embedding else build_tiny_model)(args.directory))
        return 0

    from gpu_agent.runtime.agent import Agent
    from gpu_agent.runtime.config import AgentConfig
    from gpu_agent.runtime.supervisor import SupervisorPolicy

    if not args.join_token:
        print("--join-token (or INFERPLANE_JOIN_TOKEN) is required", file=sys.stderr)
        return 2
    raise_open_files_limit()
    keep_memory_from_engines()
    config = AgentConfig(
        control_plane_url=args.control_plane,
        join_token=args.join_token,
        data_dir=Path(args.data_dir),
        name=args.name,
        force_cpu=args.cpu,
        weights_budget_bytes=int(args.weights_budget_gb * 1e9) if args.weights_budget_gb else None,
        weights_disk_reserve_fraction=args.weights_disk_reserve_percent / 100,
        **({"adapter_max_bytes": int(args.adapter_max_gb * 1e9)} if args.adapter_max_gb else {}),
        s3_endpoint_url=args.s3_endpoint_url,
        **({"private_weights_grace_s": args.private_weights_grace_min * 60}
           if args.private_weights_grace_min is not None else {}),
        cpu_kv_cache_gib=args.cpu_kv_cache_gib,
        advertise_host=args.advertise_host,
        engine_ports=args.engine_ports,
        keep_engines_on_exit=args.keep_engines_on_exit,
        standby=args.standby,
        zygote=args.zygote,
        min_download_bytes_per_s=args.min_download_kib_per_s * 1024,
        engine_sandbox=args.engine_sandbox,
        engine_disk=engine_disk_bounds(args),
    )
    policy = SupervisorPolicy()
    if args.engine_hung_after_s is not None:
        policy.hung_after_s = args.engine_hung_after_s
    run_until_signalled(Agent(config, policy=policy))
    return 0


def engine_disk_bounds(args: argparse.Namespace) -> EngineDiskBounds:
    """What engines may keep on the disk, as the command line (or the environment) says."""
    return EngineDiskBounds(
        engine_max_bytes=int(args.engine_disk_gb * 1e9),
        cache_budget_bytes=int(args.engine_cache_gb * 1e9),
        cache_max_age_s=args.engine_cache_days * 86400,
    )


_PR_SET_DUMPABLE = 4


def keep_memory_from_engines() -> bool:
    """Make the agent's process not dumpable; whether it could.

    NOTE: engines run as the agent's user, and a process of the same user reads another's `/proc/<pid>/environ`,
    `maps` and `mem` unless that one is not dumpable (then only a holder of CAP_SYS_PTRACE does, which a container's
    root lacks by default). Landlock leaves `/proc` readable to engines (`sandbox.py`): a compromised engine read the
    agent's environment, its join token and any cloud credentials given there among them (found by the sandbox's
    helper). Not inherited across `execve`: the engines and helpers the agent starts stay dumpable, so the agent still
    reads their environments (each engine's replica marker) to adopt them."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0


# The most open files the agent asks for (its soft limit raised up to the hard one, never past this).
MAX_OPEN_FILES = 1_048_576


def raise_open_files_limit() -> int:
    """Raise the process's soft limit on open files to its hard limit (at most `MAX_OPEN_FILES`); returns it.

    NOTE: a download holds a descriptor per file of the model (up to `MAX_MODEL_FILES`) while it runs, and a
    tenant's store may drip its bytes for hours: under a container's default soft limit of 1,024 one such download
    left the agent's other threads (other tenants' downloads, the heartbeat's sockets, engines' pipes and logs)
    failing with EMFILE. The systemd unit sets the limit itself; a container's runtime does not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, MAX_OPEN_FILES)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError) as exc:
        logging.getLogger(__name__).warning("could not raise the open-files limit from %d to %d (%s)", soft, wanted, exc)
        return soft
    return wanted


# How long the agent may take to stop after SIGTERM or SIGINT before it dumps every thread's stack and exits
# anyway (`EXIT_STUCK_STOPPING`). Its own bounds add up to well under this (the monitor's join, the zygote's
# wait, `SupervisorPolicy.stop_timeout_s` per engine); below the 180 s after which systemd and Kubernetes kill
# the whole group, so a stuck stop leaves the stacks that explain it in the log, not only a SIGKILL.
SHUTDOWN_DEADLINE_S = 120.0
EXIT_STUCK_STOPPING = 3


def run_until_signalled(agent, *, shutdown_deadline_s: float = SHUTDOWN_DEADLINE_S) -> None:
    """Run the agent until SIGTERM or SIGINT; engines are stopped (or detached) before this returns.

    A stop that outlasts `shutdown_deadline_s` ends the process with `EXIT_STUCK_STOPPING` after writing every
    thread's stack to stderr. NOTE: the engines still go (the parent-death signal their reapers arm, unless they
    were meant to outlive the agent), and the next agent kills any left by marker (`recover`)."""
    stop = threading.Event()
    stopped = threading.Event()

    def on_signal(signum, _frame) -> None:
        logging.getLogger(__name__).info("received %s: stopping engines", signal.Signals(signum).name)
        stop.set()

    def exit_if_stuck() -> None:  # started before any signal: a handler never starts a thread
        stop.wait()
        if stopped.wait(shutdown_deadline_s):
            return
        logging.getLogger(__name__).error(
            "still stopping %.0fs after the signal: exiting with code %d; every thread's stack follows",
            shutdown_deadline_s, EXIT_STUCK_STOPPING,
        )  # fmt: skip
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(EXIT_STUCK_STOPPING)

    threading.Thread(target=exit_if_stuck, name="shutdown-deadline", daemon=True).start()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        agent.run(stop)  # stops every engine before returning
    finally:
        stopped.set()


if __name__ == "__main__":
    sys.exit(main())
