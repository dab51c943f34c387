"""A stand-in for `vllm serve` that starts in milliseconds (supervisor and agent tests).

Serves /health, /metrics (running requests read from --running-file), with --served-context /v1/models (that context),
/tokenize (a chat template adding 3 tokens a conversation and 4 a message) and /v1/completions, and with --sleep-mode vLLM's sleep routes (`/sleep?level=N`, `/wake_up`, `/is_sleeping`:
--wake-fails answers `/wake_up` with 500, as an engine whose GPU memory was taken meanwhile); like a real engine under `EngineKeyGuard`, everything but /health needs the
replica's key from INFERPLANE_ENGINE_API_KEY; with --fill-cache-bytes/--fill-scratch-bytes writes that much into its
cache folder (XDG_CACHE_HOME) and scratch folder (TMPDIR) before it answers /health (with --unlink-scratch-fill removes
the scratch's file's name and holds it, open or only mapped; with --fill-shm-bytes holds a file that
big in /dev/shm, open and mapped, or with --shm-unlinked only mapped, or with --shm-closed neither); spawns a worker child like vLLM's EngineCore so that tests see
whether the whole process group goes away. With --give-shm-fd and --keep-shm-fds, one engine passes another a file
of its /dev/shm over a Unix socket, as a hostile tenant's two replicas would.
"""

import argparse
import http.server
import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import time

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--served-model-name", default="fake")
parser.add_argument("--ready-after-s", type=float, default=0.0)
parser.add_argument("--exit-after-s", type=float, default=None, help="crash (exit 3) after this long")
parser.add_argument("--unhealthy-after-s", type=float, default=None,
                    help="/health answers 500 after this long, the process alive (vLLM's EngineCore killed under it)")
parser.add_argument("--slow-health-after-s", type=float, default=None,
                    help="/health answers only after 3 s from this long on, idle meanwhile (an API server hung on a lock)")
parser.add_argument("--busy-health-after-s", type=float, default=None,
                    help="/health answers only after 3 s of computing from this long on (an API server busy under load)")
parser.add_argument("--running-file", default="", help="file holding the number of running requests")
parser.add_argument("--ignore-sigterm", action="store_true")
parser.add_argument("--sleep-mode", action="store_true", help="serve /sleep, /wake_up and /is_sleeping")
parser.add_argument("--wake-fails", action="store_true", help="/wake_up answers 500")
parser.add_argument("--log-line", action="append", default=[], help="a line to write at start, as vLLM logs")
parser.add_argument("--tokenize-fails", type=int, default=0, help="the first N /tokenize calls answer 503")
parser.add_argument("--fill-cache-bytes", type=int, default=0, help="write this many bytes to its cache folder")
parser.add_argument("--fill-scratch-bytes", type=int, default=0, help="write this many bytes to its scratch folder")
parser.add_argument("--unlink-scratch-fill", choices=["open", "mapped"], default=None,
                    help="then remove its name, held open or only mapped")
parser.add_argument("--fill-shm-bytes", type=int, default=0, help="write and hold (open, mapped) a file this big in --shm-dir")
parser.add_argument("--shm-dir", default="/dev/shm")
parser.add_argument("--shm-unlinked", action="store_true", help="then remove its name: only the mapping holds it")
parser.add_argument("--shm-closed", action="store_true", help="then close and unmap it: only its name keeps it")
parser.add_argument("--confine", action="store_true", help="confine itself first, as an engine does (`sandbox.py`)")
parser.add_argument("--give-shm-fd", action="append", default=[], help="pass a /dev/shm file on a socket there")
parser.add_argument("--keep-shm-fds", action="store_true", help="keep what every such socket passes")
parser.add_argument("--keep-mapped", action="store_true", help="... mapped, their descriptors closed")
parser.add_argument("--try-neighbour", default="", help="JSON {pid, shm}: log what it could do to that engine's process")
parser.add_argument("--try-shm-bytes", type=int, default=0, help="log how much of this it could write in /dev/shm")
parser.add_argument("--try-shm-files", type=int, default=0, help="log how many of these empty files it could make there")
parser.add_argument("--try-namespaces", action="store_true", help="log whether it could make a user namespace")
parser.add_argument("--chatter-bytes", type=int, default=0, help="write this many bytes of numbered log lines")
parser.add_argument("--chatter-bytes-per-s", type=int, default=0, help="... at this rate (0: as fast as it can)")
parser.add_argument("--served-context", type=int, default=None, help="the max_model_len its /v1/models answers")
parser.add_argument("--models-unanswered", action="store_true", help="/v1/models never answers (a hung API route)")
parser.add_argument("--relay-processes", action="store_true", help="a process forking and exiting, its child too")
args, _ = parser.parse_known_args()

if args.confine:
    from gpu_agent.runtime import sandbox

    sandbox.apply_from_environment()
started_at = time.monotonic()
sleeping_level = 0
num_tokenize_calls = 0
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
if args.ignore_sigterm:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:

    def on_term(*_):
        worker.terminate()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)


def running() -> int:
    try:
        with open(args.running_file) as handle:
            return int(handle.read().strip() or 0)
    except (OSError, ValueError):
        return 0


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *_):
        pass

    def _send(self, status, body, content_type="application/json"):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        key = os.environ.get("INFERPLANE_ENGINE_API_KEY", "")
        if key and self.headers.get("Authorization", "") == f"Bearer {key}":
            return True
        self._send(401, '{"error": "unauthorized"}')
        return False

    def do_GET(self):
        ready = time.monotonic() - started_at >= args.ready_after_s
        if self.path != "/health" and not self._authorized():
            return
        if self.path == "/health":
            dead = args.unhealthy_after_s is not None and time.monotonic() - started_at >= args.unhealthy_after_s
            if args.slow_health_after_s is not None and time.monotonic() - started_at >= args.slow_health_after_s:
                time.sleep(3.0)
            if args.busy_health_after_s is not None and time.monotonic() - started_at >= args.busy_health_after_s:
                computing_until = time.monotonic() + 3.0
                while time.monotonic() < computing_until:
                    pass
            self._send(500 if dead else 200 if ready else 503, "")
        elif self.path == "/is_sleeping" and args.sleep_mode:
            self._send(200, json.dumps({"is_sleeping": sleeping_level > 0}))
        elif self.path == "/metrics":
            text = (
                f'vllm:num_requests_running{{engine="0"}} {running()}.0\n'
                'vllm:num_requests_waiting{engine="0"} 0.0\n'
                'vllm:kv_cache_usage_perc{engine="0"} 0.25\n'
                'vllm:prefix_cache_queries_total{engine="0"} 400.0\n'
                'vllm:prefix_cache_hits_total{engine="0"} 96.0\n'
                f'vllm:generation_tokens_total{{engine="0"}} {int((time.monotonic() - started_at) * 10)}.0\n'
            )
            self._send(200, text, "text/plain")
        elif self.path == "/v1/models" and args.models_unanswered:
            time.sleep(3600)
        elif self.path == "/v1/models" and args.served_context is not None:
            card = {"id": args.served_model_name, "object": "model", "max_model_len": args.served_context}
            self._send(200, json.dumps({"object": "list", "data": [card]}))
        else:
            self._send(404, "{}")

    def do_POST(self):
        global sleeping_level, num_tokenize_calls
        length = int(self.headers.get("Content-Length", 0))
        request = self.rfile.read(length)
        if not self._authorized():
            return
        path, _, query = self.path.partition("?")
        if path == "/tokenize":
            num_tokenize_calls += 1
            if num_tokenize_calls <= args.tokenize_fails:
                self._send(503, '{"error": "busy"}')
                return
            messages = json.loads(request).get("messages", [])
            self._send(200, json.dumps({"count": 3 + 4 * len(messages), "tokens": [], "max_model_len": 512}))
            return
        if args.sleep_mode and path == "/sleep":
            sleeping_level = int(query.partition("level=")[2] or 1)
            print(f"==> fake engine sleeps (level {sleeping_level})", flush=True)
            self._send(200, json.dumps({"status": "sleeping", "level": sleeping_level}))
            return
        if args.sleep_mode and path == "/wake_up":
            if args.wake_fails:
                self._send(500, '{"error": "CUDA out of memory"}')
                return
            sleeping_level = 0
            print("==> fake engine wakes", flush=True)
            self._send(200, json.dumps({"status": "awake"}))
            return
        if sleeping_level:
            self._send(503, '{"error": "sleeping"}')
            return
        body = {
            "model": args.served_model_name,
            "choices": [{"text": "ok"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        self._send(200, json.dumps(body))


print(f"==> fake engine started at {time.time():.3f}", flush=True)
for folder_env, num_bytes in (("XDG_CACHE_HOME", args.fill_cache_bytes), ("TMPDIR", args.fill_scratch_bytes)):
    if num_bytes:  # what an engine's compile caches and temporary files take, on disk (not sparse)
        with open(os.path.join(os.environ[folder_env], "fill.bin"), "wb") as fill:
            fill.write(os.urandom(num_bytes))
held_unlinked = []
if args.unlink_scratch_fill:  # a hostile engine's way to write past its disk bound where no walk of its folders looks
    scratch_fill = os.path.join(os.environ["TMPDIR"], "fill.bin")
    held_unlinked.append(open(scratch_fill, "rb"))  # noqa: SIM115 - held for the engine's life
    if args.unlink_scratch_fill == "mapped":
        held_unlinked.append(mmap.mmap(held_unlinked[0].fileno(), 0, prot=mmap.PROT_READ))
        held_unlinked.pop(0).close()
    os.unlink(scratch_fill)
held_shm = []
if args.fill_shm_bytes:  # what vLLM's ring buffers and NCCL's segments take, in RAM
    shm_path = os.path.join(args.shm_dir, f"inferplane-test-{os.getpid()}-{os.urandom(4).hex()}")
    shm_fd = os.open(shm_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(os.dup(shm_fd), "wb") as shm_file:
        shm_file.write(os.urandom(args.fill_shm_bytes))
    if args.shm_closed:
        os.close(shm_fd)
    else:
        held_shm.append(mmap.mmap(shm_fd, args.fill_shm_bytes))
    if args.shm_unlinked:
        os.close(shm_fd)
        os.unlink(shm_path)
    print(f"==> shared memory {shm_path}", flush=True)
if args.relay_processes:  # a hostile engine's way to keep what it holds on no process the agent's walk asks
    import ctypes

    # PR_SET_CHILD_SUBREAPER, as the engine's reaper: the relay stays below
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)
    if os.fork() == 0:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # NOTE: as fast as it can: a walk must never fit between two forks
            if os.fork() != 0:
                os._exit(0)
        os._exit(0)

    def reap() -> None:
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                time.sleep(0.01)

    threading.Thread(target=reap, daemon=True).start()
for line in args.log_line:
    print(line, flush=True)


def chatter() -> None:
    """A chatty engine: numbered lines straight to its stdout (the log the agent gave it), then how long its slowest
    write took (a write blocked on a reader that does not keep up shows there)."""
    written, number, slowest_s, began = 0, 0, 0.0, time.monotonic()
    while written < args.chatter_bytes:
        batch = b"".join(f"chatter line {number + index:09d} {'.' * 72}\n".encode() for index in range(256))
        number += 256
        before = time.monotonic()
        os.write(1, batch)
        slowest_s = max(slowest_s, time.monotonic() - before)
        written += len(batch)
        if args.chatter_bytes_per_s:
            time.sleep(max(0.0, began + written / args.chatter_bytes_per_s - time.monotonic()))
    os.write(1, f"chatter done: {written} bytes in {number} lines, {time.monotonic() - began:.2f} s, "
                f"slowest write {slowest_s * 1000:.1f} ms\n".encode())


if args.chatter_bytes:
    threading.Thread(target=chatter, daemon=True).start()
# A hostile tenant's two replicas: one passes the other a file of its /dev/shm.
PASS_SOCKET = "inferplane-pass.sock"


def give_shm_fd(folder: str) -> None:
    """Make a 1-byte file in its /dev/shm, and pass it to whoever connects to a socket it makes in `folder` (a FIFO
    is tried there too). Logs what the sandbox let it make."""
    import socket

    shm_path = f"/dev/shm/inferplane-tiny-{os.getpid()}-{os.urandom(4).hex()}"
    shm_fd = os.open(shm_path, os.O_RDWR | os.O_CREAT, 0o600)
    os.write(shm_fd, b"x")
    os.unlink(shm_path)  # the descriptor alone holds it
    server = socket.socket(socket.AF_UNIX)
    socket_path = os.path.join(folder, PASS_SOCKET)
    if len(os.fsencode(socket_path)) >= 100:
        # NOTE: a socket's path has at most 107 bytes (a fresh clone's pytest folders are longer: the bind failed for
        # its length, not for the sandbox): bound through the folder's descriptor, the same folder and the same rule.
        socket_path = f"/proc/self/fd/{os.open(folder, os.O_PATH | os.O_DIRECTORY)}/{PASS_SOCKET}"
    made = {"folder": folder, "socket": attempt(lambda: server.bind(socket_path) or "made")}
    made["fifo"] = attempt(lambda: os.mkfifo(os.path.join(folder, "inferplane-pass.fifo")) or "made")
    print(f"==> give {json.dumps(made)}", flush=True)
    if made["socket"] == "made":
        server.listen(8)
        while True:
            client, _ = server.accept()
            socket.send_fds(client, [b"x"], [shm_fd])
            client.close()


def map_only(fd: int) -> int:
    """Map the file (shared, read) and close `fd`: only the mapping holds it. NOTE: not `mmap.mmap`, which keeps a
    descriptor of its own (a duplicate), through which the agent measures the file as if it were open."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, *[ctypes.c_int] * 3, ctypes.c_long]
    address = libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    assert address not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    os.close(fd)
    return address


def keep_shm_fds(mapped: bool) -> None:
    """Connect to every socket named `PASS_SOCKET` that /proc/net/unix lists, keeping the files passed (`mapped`: only
    mapped, `map_only`); logs each socket's first refusal."""
    import socket

    kept, done, refused = [], set(), set()
    while True:
        with open("/proc/net/unix") as sockets:
            found = {line.split()[-1] for line in sockets if line.rstrip().endswith("/" + PASS_SOCKET)}
        for path in found - done:
            try:
                with socket.socket(socket.AF_UNIX) as client:
                    client.connect(path)
                    _, fds, _, _ = socket.recv_fds(client, 1, 1)
            except OSError as exc:  # removed meanwhile, or out of its reach (its folder hidden): tried again
                if path not in refused:
                    refused.add(path)
                    print(f"==> refused {json.dumps({'path': path, 'error': exc.strerror})}", flush=True)
                continue
            done.add(path)
            for fd in fds:
                kept.append(map_only(fd) if mapped else fd)
            print(f"==> kept {len(kept)}", flush=True)
        time.sleep(0.2)


def attempt(call):
    try:
        return call()
    except OSError as exc:
        return f"refused: {exc.strerror}"


for folder_env in args.give_shm_fd:
    threading.Thread(target=give_shm_fd, args=(os.environ[folder_env],), daemon=True).start()
if args.keep_shm_fds:
    threading.Thread(target=keep_shm_fds, args=(args.keep_mapped,), daemon=True).start()


def write_shm(num_bytes: int) -> int:
    """How many bytes of a file in /dev/shm it could write, 1 MiB at a time."""
    written = 0
    with open(f"/dev/shm/inferplane-try-{os.getpid()}", "wb", buffering=0) as shm_file:
        try:
            while written < num_bytes:
                written += shm_file.write(b"x" * min(1 << 20, num_bytes - written))
        except OSError:
            pass
    os.unlink(f"/dev/shm/inferplane-try-{os.getpid()}")
    return written


def make_shm_files(num_files: int) -> int:
    """How many empty files it could make in /dev/shm (kept: closed, never mapped)."""
    for made in range(num_files):
        try:
            os.close(os.open(f"/dev/shm/inferplane-try-{made}", os.O_CREAT | os.O_WRONLY, 0o600))
        except OSError:
            return made
    return num_files


def make_user_namespace() -> dict:
    """In a child: whether it could make a user namespace, and lift its namespace's limit on them."""
    import ctypes

    read_end, write_end = os.pipe()
    if os.fork() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        lifted = attempt(lambda: open("/proc/sys/user/max_user_namespaces", "w").write("100"))
        made = "made" if libc.unshare(0x10000000) == 0 else f"refused: {os.strerror(ctypes.get_errno())}"
        os.write(write_end, json.dumps({"unshare_user": made, "lift_limit": lifted}).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as answer:
        return json.loads(answer.read())


if args.try_neighbour or args.try_shm_bytes or args.try_shm_files or args.try_namespaces:  # a hostile tenant's tries
    neighbour = json.loads(args.try_neighbour or "{}")
    pid, shm = neighbour.get("pid"), neighbour.get("shm")
    seen = {"own_pid": os.getpid(), "pids": sorted(int(entry) for entry in os.listdir("/proc") if entry.isdigit())}
    if pid:
        seen["oom_score_adj"] = attempt(lambda: open(f"/proc/{pid}/oom_score_adj", "w").write("1000"))
    if shm:
        seen["shm_listing"] = attempt(lambda: os.listdir("/dev/shm"))
        seen["shm_open"] = attempt(lambda: open(shm, "r+b").write(b"x" * 4096))  # never creates it
    if args.try_shm_bytes:
        seen["shm_written"] = write_shm(args.try_shm_bytes)
    if args.try_shm_files:
        seen["shm_files_made"] = make_shm_files(args.try_shm_files)
    if args.try_namespaces:
        seen.update(make_user_namespace())
    print(f"==> tried {json.dumps(seen)}", flush=True)


def crash():
    print(f"==> fake engine exits at {time.time():.3f}", flush=True)
    os._exit(3)


if args.exit_after_s is not None:
    threading.Timer(args.exit_after_s, crash).start()
http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
